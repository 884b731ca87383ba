"""Pseudo-gradient codecs (fp32 / bf16 / int8 / int4 / int2) with error feedback.

Flat dicts of float32 arrays in, flat dicts of safetensors-savable arrays out. Payload layout per
tensor `name`:
- fp32: `name` float32, original shape.
- bf16: `name` bfloat16 (ml_dtypes, round-to-nearest-even), original shape. `decode` also accepts
  the same bits as uint16 (for loaders without bfloat16 support).
- int8: `name` int8 in [-127, 127], original shape; `name.__scale` float32, one per block of
  `block` elements of the flattened tensor (absmax / 127, symmetric, round-to-nearest).
- int4: `name` uint8, two 4-bit codes per byte (element 2i in the low nibble, 2i+1 in the high
  nibble; code = q + 8 for q in [-7, 7]); `name.__scale` float32 per block (absmax / 7);
  `name.__shape` int32, the original shape.
- int2: the layout of int4 with four 2-bit codes per byte and scale absmax / 1.5
  (training/codec2bit.py: levels -1.5, -0.5, 0.5, 1.5 x scale).

Error feedback: `encode` quantizes `x = delta + residual` and returns `x - decode(payload)` as the
next residual, so the quantization error is sent later instead of lost.
"""

from __future__ import annotations

import math
from typing import get_args

import ml_dtypes
import numpy as np

from training import codec2bit
from training.config import Codec

CODECS: tuple[str, ...] = get_args(Codec)  # the config's type is the one list
DEFAULT_BLOCK = 256
SCALE_SUFFIX = ".__scale"
SHAPE_SUFFIX = ".__shape"
_LEVELS = {"int8": 127, "int4": 7}


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def _num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _quantize(flat: np.ndarray, levels: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block symmetric absmax quantization to integers in [-levels, levels].

    Works on a block view of the input (only the last, partial block is padded) with one
    float32 scratch buffer, so a tensor is read about four times, not ten.
    """
    n = flat.size
    nb = _num_blocks(n, block)
    if n % block:
        padded = np.zeros(nb * block, dtype=np.float32)
        padded[:n] = flat
    else:
        padded = np.ascontiguousarray(flat, dtype=np.float32)
    blocks = padded.reshape(nb, block)
    absmax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))
    scales = (absmax / np.float32(levels)).astype(np.float32)
    inv = np.where(absmax > 0, np.float32(levels) / np.where(absmax > 0, absmax, 1), 0)
    scratch = np.multiply(blocks, inv.astype(np.float32)[:, None])
    np.rint(scratch, out=scratch)
    np.clip(scratch, -levels, levels, out=scratch)  # rounding of x * (levels / absmax)
    return scratch.astype(np.int8).reshape(-1)[:n], scales


def _dequantize(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    n = q.size
    full = (n // block) * block
    out = np.empty(n, np.float32)
    if full:
        body = out[:full].reshape(-1, block)
        np.multiply(q[:full].reshape(-1, block), scales[: full // block, None], out=body)
    if full < n:
        out[full:] = q[full:] * scales[-1]
    return out


def _pack4(q: np.ndarray) -> np.ndarray:
    codes = (q.astype(np.int16) + 8).astype(np.uint8)
    if codes.size % 2:
        codes = np.append(codes, np.uint8(8))
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def _unpack4(packed: np.ndarray, n: int) -> np.ndarray:
    codes = np.empty(packed.size * 2, dtype=np.int8)
    codes[0::2] = (packed & 0x0F).astype(np.int8)
    codes[1::2] = (packed >> 4).astype(np.int8)
    return codes[:n] - np.int8(8)


def _encode_tensor(name: str, x: np.ndarray, codec: str, block: int) -> dict[str, np.ndarray]:
    if codec == "fp32":
        return {name: x.copy()}
    if codec == "bf16":
        return {name: x.astype(ml_dtypes.bfloat16)}
    if codec == "int2":
        codes, scales = codec2bit.quantize(x.reshape(-1), block)
        return {
            name: codec2bit.pack(codes),
            name + SCALE_SUFFIX: scales,
            name + SHAPE_SUFFIX: np.asarray(x.shape, dtype=np.int32),
        }
    q, scales = _quantize(x.reshape(-1), _LEVELS[codec], block)
    if codec == "int8":
        return {name: q.reshape(x.shape), name + SCALE_SUFFIX: scales}
    return {
        name: _pack4(q),
        name + SCALE_SUFFIX: scales,
        name + SHAPE_SUFFIX: np.asarray(x.shape, dtype=np.int32),
    }


def encode(
    delta: dict[str, np.ndarray],
    codec: str,
    residual: dict[str, np.ndarray] | None = None,
    block: int = DEFAULT_BLOCK,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Compress `delta + residual`; returns (payload, new residual for the names in `delta`).

    A name missing from `residual` starts from a zero residual.
    """
    _check_codec(codec)
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    residual = residual or {}
    payload: dict[str, np.ndarray] = {}
    new_residual: dict[str, np.ndarray] = {}
    for name, value in delta.items():
        if ".__" in name:
            raise ValueError(f"tensor name {name!r} uses the reserved '.__' marker")
        x = np.asarray(value, dtype=np.float32)
        if name in residual:
            r = np.asarray(residual[name], dtype=np.float32)
            if r.shape != x.shape:
                raise ValueError(f"residual for {name!r} has shape {r.shape}, expected {x.shape}")
            x = x + r
        if not np.all(np.isfinite(x)):
            raise ValueError(f"tensor {name!r} has non-finite values")
        encoded = _encode_tensor(name, x, codec, block)
        payload.update(encoded)
        new_residual[name] = x - _decode_tensor(name, encoded, codec, block)
    return payload, new_residual


def _get(payload: dict[str, np.ndarray], key: str, dtypes: tuple, name: str) -> np.ndarray:
    if key not in payload:
        raise ValueError(f"payload for {name!r} is missing tensor {key!r}")
    arr = np.asarray(payload[key])
    if arr.dtype not in tuple(np.dtype(d) for d in dtypes):
        raise ValueError(f"payload tensor {key!r} has dtype {arr.dtype}, expected {dtypes}")
    return arr


def _shape(payload: dict[str, np.ndarray], name: str) -> tuple[int, ...]:
    shape_arr = _get(payload, name + SHAPE_SUFFIX, (np.int32,), name)
    if shape_arr.ndim != 1 or np.any(shape_arr < 0):
        raise ValueError(f"payload tensor {name + SHAPE_SUFFIX!r} is not a valid shape")
    return tuple(int(d) for d in shape_arr)


def _decode_tensor(name: str, payload: dict[str, np.ndarray], codec: str, block: int) -> np.ndarray:
    if codec == "fp32":
        return _get(payload, name, (np.float32,), name).astype(np.float32)
    if codec == "bf16":
        data = _get(payload, name, (ml_dtypes.bfloat16, np.uint16), name)
        return data.view(ml_dtypes.bfloat16).astype(np.float32)
    scales = _get(payload, name + SCALE_SUFFIX, (np.float32,), name).reshape(-1)
    if codec == "int8":
        data = _get(payload, name, (np.int8,), name)
        shape, q = data.shape, data.reshape(-1)
    elif codec == "int2":
        shape = _shape(payload, name)
        codes = codec2bit.unpack(
            _get(payload, name, (np.uint8,), name).reshape(-1), math.prod(shape)
        )
        if scales.size != _num_blocks(codes.size, block):
            raise ValueError(f"payload tensor {name + SCALE_SUFFIX!r} has {scales.size} scales")
        return codec2bit.dequantize(codes, scales, block).reshape(shape)
    else:
        shape_arr = _get(payload, name + SHAPE_SUFFIX, (np.int32,), name)
        if shape_arr.ndim != 1 or np.any(shape_arr < 0):
            raise ValueError(f"payload tensor {name + SHAPE_SUFFIX!r} is not a valid shape")
        shape = tuple(int(d) for d in shape_arr)
        n = math.prod(shape)
        packed = _get(payload, name, (np.uint8,), name).reshape(-1)
        if packed.size != -(-n // 2):
            raise ValueError(
                f"payload tensor {name!r} has {packed.size} bytes, expected {-(-n // 2)} "
                f"for shape {shape}"
            )
        q = _unpack4(packed, n)
    if scales.size != _num_blocks(q.size, block):
        raise ValueError(
            f"payload tensor {name + SCALE_SUFFIX!r} has {scales.size} scales, expected "
            f"{_num_blocks(q.size, block)} for {q.size} elements in blocks of {block}"
        )
    levels = _LEVELS[codec]
    if q.size and np.abs(q.astype(np.int16)).max() > levels:
        raise ValueError(f"payload tensor {name!r} has codes outside [-{levels}, {levels}]")
    return _dequantize(q, scales, block).reshape(shape)


def decode(
    payload: dict[str, np.ndarray], codec: str, block: int = DEFAULT_BLOCK
) -> dict[str, np.ndarray]:
    """Float32 tensors in their original shapes; `block` must match the one used to encode."""
    _check_codec(codec)
    names = [key for key in payload if ".__" not in key]
    allowed = set(names)
    if codec in ("int8", "int4", "int2"):
        allowed |= {name + SCALE_SUFFIX for name in names}
    if codec in ("int4", "int2"):
        allowed |= {name + SHAPE_SUFFIX for name in names}
    extra = sorted(set(payload) - allowed)
    if extra:
        raise ValueError(f"unexpected payload tensors for codec {codec!r}: {extra}")
    return {name: _decode_tensor(name, payload, codec, block) for name in names}


def encoded_layout(name: str, shape: tuple[int, ...], codec: str, block: int = DEFAULT_BLOCK):
    """[(tensor name, data bytes, ndim)] of the payload tensors `encode` writes for one tensor
    of `shape`: exactly what the layout in this module's docstring says."""
    _check_codec(codec)
    n = math.prod(shape)
    if codec == "fp32":
        return [(name, 4 * n, len(shape))]
    if codec == "bf16":
        return [(name, 2 * n, len(shape))]
    scales = (name + SCALE_SUFFIX, 4 * _num_blocks(n, block), 1)
    if codec == "int8":
        return [(name, n, len(shape)), scales]
    return [(name, -(-n // 2), 1), scales, (name + SHAPE_SUFFIX, 4 * len(shape), 1)]


def payload_limits(
    shapes: dict[str, tuple[int, ...]], codec: str, block: int = DEFAULT_BLOCK
) -> tuple[int, int]:
    """(max file bytes, max header bytes) of a safetensors payload that encodes tensors of
    `shapes` in `codec`: the data bytes exactly, plus `header_bound` for the header. A
    pseudo-gradient of a fragment whose manifest or object is larger is refused unread."""
    from training.store.tensors import header_bound

    entries = [
        e for name, shape in shapes.items() for e in encoded_layout(name, shape, codec, block)
    ]
    header = header_bound([(name, ndim) for name, _, ndim in entries])
    return header + sum(nbytes for _, nbytes, _ in entries), header


def payload_nbytes(payload: dict[str, np.ndarray]) -> int:
    """Total bytes of all payload tensors (data, scales and shapes)."""
    return sum(int(np.asarray(t).nbytes) for t in payload.values())


def payload_keys(names, codec: str) -> set[str]:
    """Every payload tensor name that encoding tensors `names` with `codec` produces."""
    _check_codec(codec)
    keys = set(names)
    if codec in ("int8", "int4"):
        keys |= {name + SCALE_SUFFIX for name in names}
    if codec == "int4":
        keys |= {name + SHAPE_SUFFIX for name in names}
    return keys


def decode_tensor(
    payload: dict[str, np.ndarray], name: str, codec: str, block: int = DEFAULT_BLOCK
) -> np.ndarray:
    """One float32 tensor of a payload (the streaming merge decodes one at a time)."""
    _check_codec(codec)
    return _decode_tensor(name, payload, codec, block)
