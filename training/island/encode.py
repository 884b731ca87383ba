"""Pseudo-gradient, quantization and error feedback in one jitted function on the island's devices.

`DeviceEncoder(codec, block).encode(anchor, local, residual)` computes, per tensor of a fragment,

    x = (anchor - local) [+ residual]       # training/protocol/pseudograd.py's sign
    payload = codec(x),  new_residual = x - decode(payload),  new_anchor = copy(local)

in one XLA computation, and returns device arrays: only `payload` (the encoded bytes) is ever
fetched to the host, by whoever uploads it. The payload layout is exactly training/codecs/host.py's
(its docstring), so the store, the merger and `codecs.decode` cannot tell the two apart.

Exactness: every operation is the same IEEE float32 operation in the same order as the numpy
codec, and two XLA rewrites that would change the rounding are kept out: a division by a
broadcast divisor becomes a multiplication by the reciprocal (`_div` divides by a full-shape
divisor behind an optimization barrier), and `x - q * scale` fused into one loop becomes a
multiply-add (the residual is a second computation over the materialized dequantized payload).
So on CPU the payloads and the residuals are bit-identical to `codecs.encode`, for every codec
(tests/test_device_codec.py compares the bytes over four publishes with error feedback). Other
backends are held to the same test where one is at hand; a backend whose division or
rounding differs would give codes that differ by one at rounding boundaries, which error
feedback repays.

`new_anchor` is a device copy of `local` (never the same buffer: the train step donates its
parameters). The finiteness check of `codecs.encode` is a boolean per tensor, checked on the
host with the payload (`host_payload`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from training.codecs import host as codecs
from training.codecs import int2 as codec2bit
from training.protocol import pseudograd

_LEVELS = {"int8": 127, "int4": 7}
_barrier = jax.lax.optimization_barrier


def _div(a: jax.Array, b) -> jax.Array:
    """a / b, correctly rounded as numpy's: XLA rewrites a division by a broadcast divisor
    (a scalar, a row) into a multiplication by its reciprocal, which rounds differently; a
    full-shape divisor behind an optimization barrier stays a division."""
    return a / _barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    flat = x.reshape(-1)
    n = flat.size
    nb = -(-n // block)
    if n % block:
        flat = jnp.zeros(nb * block, jnp.float32).at[:n].set(flat)
    return flat.reshape(nb, block)


def _quantize(x: jax.Array, levels: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q int8 of x.size, scales, dequantized x): codecs._quantize / _dequantize."""
    n = x.size
    blocks = _blocks(x, block)
    absmax = jnp.maximum(blocks.max(axis=1), -blocks.min(axis=1))
    scales = _div(absmax, levels)
    inv = jnp.where(
        absmax > 0, _div(jnp.full_like(absmax, levels), jnp.where(absmax > 0, absmax, 1)), 0
    )
    scratch = jnp.clip(jnp.rint(blocks * inv.astype(jnp.float32)[:, None]), -levels, levels)
    q, scales = _barrier((scratch.astype(jnp.int8), scales))
    deq = (q.astype(jnp.float32) * scales[:, None]).reshape(-1)[:n]
    return q.reshape(-1)[:n], scales, deq.reshape(x.shape)


def _pack4(q: jax.Array) -> jax.Array:
    codes = (q.astype(jnp.int16) + 8).astype(jnp.uint8)
    if codes.size % 2:
        codes = jnp.concatenate([codes, jnp.full((1,), 8, jnp.uint8)])
    return codes[0::2] | (codes[1::2] << 4)


def _int2(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(packed uint8, scales, dequantized x): training/codecs/int2.py."""
    n = x.size
    blocks = _blocks(x, block)
    scales = _div(jnp.abs(blocks).max(axis=1), codec2bit.HALF_RANGE)
    safe = jnp.where(scales > 0, scales, jnp.float32(1))
    y = _div(blocks, safe[:, None])
    codes = jnp.clip(jnp.floor(y + jnp.float32(2.0)), 0, 3).astype(jnp.uint8).reshape(-1)[:n]
    codes, scales = _barrier((codes, scales))
    per_element = jnp.repeat(scales, block)[:n]
    deq = (codes.astype(jnp.float32) - jnp.float32(codec2bit.HALF_RANGE)) * per_element
    padded = jnp.zeros(-(-n // 4) * 4, jnp.uint8).at[:n].set(codes).reshape(-1, 4)
    packed = padded[:, 0] | (padded[:, 1] << 2) | (padded[:, 2] << 4) | (padded[:, 3] << 6)
    return packed, scales, deq.reshape(x.shape)


def _encode_tensor(name: str, x: jax.Array, codec: str, block: int):
    """(payload entries, decoded x) for one tensor; shapes of int4/int2 are added on the host."""
    if codec == "fp32":
        return {name: x}, x
    if codec == "bf16":
        b = x.astype(jnp.bfloat16)
        return {name: b}, b.astype(jnp.float32)
    if codec == "int2":
        packed, scales, deq = _int2(x, block)
        return {name: packed, name + codecs.SCALE_SUFFIX: scales}, deq
    q, scales, deq = _quantize(x, _LEVELS[codec], block)
    if codec == "int8":
        return {name: q.reshape(x.shape), name + codecs.SCALE_SUFFIX: scales}, deq
    return {name: _pack4(q), name + codecs.SCALE_SUFFIX: scales}, deq


def _x(anchor, local, residual, i):
    x = pseudograd.delta(anchor[i], local[i])
    return x + residual[i] if residual else x


def _encode(codec, block, anchor, local, residual):
    """(payload, decoded payload, finite) per tensor, over lists of arrays (so fragments of
    the same shapes share one compiled computation); payload entries keyed "", ".__scale"."""
    payload, decoded, finite = [], [], []
    for i in range(len(local)):
        x = _x(anchor, local, residual, i)
        finite.append(jnp.all(jnp.isfinite(x)))
        entries, deq = _encode_tensor("", x, codec, block)
        payload.append(entries)
        decoded.append(deq)
    return payload, decoded, finite


def _residual(anchor, local, residual, decoded):
    """(x - decoded payload, a copy of local). A computation of its own, on the decoded
    payload as a materialized input: fused with the dequantization, XLA contracts
    `x - q * scale` into one multiply-add (even past an optimization barrier), which rounds
    once where numpy rounds twice."""
    new_residual = [_x(anchor, local, residual, i) - decoded[i] for i in range(len(local))]
    return new_residual, [jnp.copy(v) for v in local]


class DeviceEncoder:
    """Two jitted computations (encode, then the residual and the new anchor), compiled once
    per list of tensor shapes, with and without a residual; see the module docstring."""

    def __init__(self, codec: str, block: int = codecs.DEFAULT_BLOCK):
        if codec not in codecs.CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.codec, self.block = codec, block
        self._encode = jax.jit(partial(_encode, codec, block))
        self._residual = jax.jit(_residual)

    def encode(self, anchor: dict, local: dict, residual: dict | None):
        """(payload, new residual, new anchor, finite) as device arrays, dispatched
        asynchronously (nothing waits for the device here). `residual` None: the numpy codec
        without a residual for these names (a fragment's first publish, error feedback off)."""
        names = list(local)
        args = [[anchor[n] for n in names], [local[n] for n in names]]
        res = [residual[n] for n in names] if residual else []
        payload, decoded, finite = self._encode(*args, res)
        new_residual, new_anchor = self._residual(*args, res, decoded)
        return (
            {
                n + suffix: v
                for n, entries in zip(names, payload, strict=True)
                for suffix, v in entries.items()
            },
            dict(zip(names, new_residual, strict=True)),
            dict(zip(names, new_anchor, strict=True)),
            dict(zip(names, finite, strict=True)),
        )

    def host_payload(self, payload: dict, finite: dict, shapes: dict) -> dict[str, np.ndarray]:
        """The payload on the host in codecs.encode's layout and order; ValueError (as
        codecs.encode) if a tensor had non-finite values. Blocks until the device is done."""
        finite = jax.device_get(finite)
        bad = [name for name, ok in finite.items() if not ok]
        if bad:
            raise ValueError(f"tensor {bad[0]!r} has non-finite values")
        host = jax.device_get(payload)
        out: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            out[name] = np.asarray(host[name])
            if self.codec in ("int8", "int4", "int2"):
                out[name + codecs.SCALE_SUFFIX] = np.asarray(host[name + codecs.SCALE_SUFFIX])
            if self.codec in ("int4", "int2"):
                out[name + codecs.SHAPE_SUFFIX] = np.asarray(shape, dtype=np.int32)
        return out
