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
  (training/codecs/int2.py: levels -1.5, -0.5, 0.5, 1.5 x scale).

Error feedback: `encode` quantizes `x = delta + residual` and returns `x - decode(payload)` as the
next residual, so the quantization error is sent later instead of lost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple, get_args

import ml_dtypes
import numpy as np

from training.codecs import int2 as codec2bit
from training.codecs import kernels
from training.config.experiment import Codec

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


def _encode_tensor(
    name: str, x: np.ndarray, residual: np.ndarray | None, codec: str, block: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(payload tensors, new residual) of one tensor; x + residual is what is quantized."""
    shape = x.shape
    flat = x.reshape(-1)
    r = None if residual is None else residual.reshape(-1)
    try:
        if codec == "fp32":
            data = flat.copy() if r is None else flat + r
            if not np.isfinite(data).all():
                raise kernels.NonFinite
            return {name: data.reshape(shape)}, np.zeros(shape, np.float32)
        if codec == "bf16":
            bits, new = kernels.encode_bf16(flat, r)
            return {name: bits.view(ml_dtypes.bfloat16).reshape(shape)}, new.reshape(shape)
        levels = {"int2": codec2bit.HALF_RANGE}.get(codec, _LEVELS.get(codec))
        data, scales, new = kernels.encode_quantized(flat, r, levels, block, codec)
    except kernels.NonFinite:
        raise ValueError(f"tensor {name!r} has non-finite values") from None
    return _quantized_entries(name, shape, codec, data, scales), new.reshape(shape)


def _quantized_entries(name: str, shape, codec: str, data, scales) -> dict[str, np.ndarray]:
    """The payload tensors of one quantized tensor (the layout in the module docstring)."""
    if codec == "int8":
        return {name: data.reshape(shape), name + SCALE_SUFFIX: scales}
    return {
        name: data,
        name + SCALE_SUFFIX: scales,
        name + SHAPE_SUFFIX: np.asarray(shape, dtype=np.int32),
    }


def _contiguous(value) -> np.ndarray:
    """float32, C-contiguous, shape kept (np.ascontiguousarray would make 0-d arrays 1-d)."""
    x = np.asarray(value, dtype=np.float32)
    return x if x.flags.c_contiguous else x.copy(order="C")


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
        x = _contiguous(value)
        r = None
        if name in residual:
            r = _contiguous(residual[name])
            if r.shape != x.shape:
                raise ValueError(f"residual for {name!r} has shape {r.shape}, expected {x.shape}")
        encoded, new_residual[name] = _encode_tensor(name, x, r, codec, block)
        payload.update(encoded)
    return payload, new_residual


def encode_step(
    target: dict[str, np.ndarray],
    base: dict[str, np.ndarray],
    codec: str,
    block: int = DEFAULT_BLOCK,
    alloc: Callable[[int], memoryview] | None = None,
) -> dict[str, np.ndarray]:
    """The payload of `target - base` (float32, per name), bit for bit what `encode` gives
    for it, and `base[n] += decode(payload)[n]` in place, in one pass per tensor (no delta,
    residual or decoded array is made). `base` must hold writable float32 arrays of the
    targets' shapes. ValueError as `encode` for a non-finite difference (then `base` is
    partly updated: discard it). `alloc`: where a quantized payload's codes and scales go (a
    pool's buffers, reused merge after merge), else new arrays."""
    _check_codec(codec)
    payload: dict[str, np.ndarray] = {}
    for name, value in target.items():
        if ".__" in name:
            raise ValueError(f"tensor name {name!r} uses the reserved '.__' marker")
        t, b = _contiguous(value), base[name]
        if b.dtype != np.float32 or not b.flags.c_contiguous or not b.flags.writeable:
            raise ValueError(f"base {name!r} must be a writable, contiguous float32 array")
        if b.shape != t.shape:
            raise ValueError(f"base for {name!r} has shape {b.shape}, expected {t.shape}")
        tf, bf = t.reshape(-1), b.reshape(-1)
        try:
            if codec == "fp32":
                delta = np.subtract(tf, bf)
                if not np.isfinite(delta).all():
                    raise kernels.NonFinite
                bf += delta
                payload[name] = delta.reshape(t.shape)
            elif codec == "bf16":
                bits = kernels.encode_bf16_step(tf, bf)
                payload[name] = bits.view(ml_dtypes.bfloat16).reshape(t.shape)
            else:
                levels = {"int2": codec2bit.HALF_RANGE}.get(codec, _LEVELS.get(codec))
                data, scales = kernels.encode_quantized_step(tf, bf, levels, block, codec, alloc)
                payload.update(_quantized_entries(name, t.shape, codec, data, scales))
        except kernels.NonFinite:
            raise ValueError(f"tensor {name!r} has non-finite values") from None
    return payload


class PendingStep:
    """`encode_step(target, base, codec, block, alloc)` of a target not yet written, for the
    pass that writes it to encode each chunk while it is in cache (the merge's outer step:
    training/merge/outer.py, native.c `outer_encode_sq`), and `payload` to encode the tensors
    that pass did not: the same payload and the same new base, bit for bit, with one pass over
    the target and the base instead of two.

    `fused(name, target)`: the outputs a fused pass fills for tensor `name`
    (kernels.Fused), or None where it cannot (not a quantized codec, the C loops not loaded, a
    layout they do not take); the pass calls `done(name)` once the tensor is encoded whole
    (`rest` encodes what follows a chunk the C loop refused). Checks as encode_step."""

    def __init__(
        self,
        base: dict[str, np.ndarray],
        codec: str,
        block: int = DEFAULT_BLOCK,
        alloc: Callable[[int], memoryview] | None = None,
    ):
        _check_codec(codec)
        self.base, self.codec, self.block, self.alloc = base, codec, block, alloc
        self._offered: dict[str, kernels.Fused] = {}
        self._done: set[str] = set()

    def fused(self, name: str, target: np.ndarray) -> kernels.Fused | None:
        if self.codec not in ("int8", "int4", "int2") or name in self._offered:
            return None
        b = self.base.get(name)
        if (
            b is None
            or ".__" in name
            or b.shape != target.shape
            or not b.flags.writeable
            or kernels.chunk_step(self.block) != chunk_step()
        ):
            return None  # encode_step judges it (and refuses what it must)
        levels = {"int2": codec2bit.HALF_RANGE}.get(self.codec, _LEVELS.get(self.codec))
        got = kernels.fused_step(
            target.reshape(-1), b.reshape(-1), levels, self.block, self.codec, self.alloc
        )
        if got is not None:
            self._offered[name] = got
        return got

    def rest(self, name: str, target: np.ndarray, s: int, e: int) -> None:
        """Encode elements [s, e) of `name` (flat `target`) the fused pass left (kernels.
        encode_rest); ValueError as encode_step for a non-finite difference."""
        try:
            kernels.encode_rest(self._offered[name], target.reshape(-1), s, e)
        except kernels.NonFinite:
            raise ValueError(f"tensor {name!r} has non-finite values") from None

    def done(self, name: str) -> None:
        self._done.add(name)

    def payload(self, target: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """encode_step(target, base, codec, block, alloc)'s payload, in its order: the tensors
        a fused pass encoded taken as they are, the others encoded now."""
        if sorted(target) != sorted(self.base):
            raise ValueError("theta and shadow name different tensors")
        payload: dict[str, np.ndarray] = {}
        for name, value in target.items():
            if name in self._done:
                f = self._offered[name]
                payload.update(_quantized_entries(name, value.shape, self.codec, f.data, f.scales))
            else:
                payload.update(
                    encode_step({name: value}, self.base, self.codec, self.block, self.alloc)
                )
        return payload


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


class TensorCodes(NamedTuple):
    """One tensor of a payload, checked against the layout and ready to decode in chunks."""

    name: str
    codec: str
    shape: tuple[int, ...]
    data: np.ndarray  # flat: float32, uint16 (bf16 bits), int8 codes or packed uint8
    scales: np.ndarray | None  # flat float32 per block (quantized codecs)
    block: int


def tensor_codes(
    payload: dict[str, np.ndarray], name: str, codec: str, block: int = DEFAULT_BLOCK
) -> TensorCodes:
    """`name` of a payload with its dtypes, sizes and scale count checked (ValueError naming
    the payload tensor); code values are checked as they are decoded (`decode_chunk`)."""
    _check_codec(codec)
    if codec in ("fp32", "bf16"):
        dtypes = (np.float32,) if codec == "fp32" else (ml_dtypes.bfloat16, np.uint16)
        data = _get(payload, name, dtypes, name)
        flat = data.reshape(-1) if codec == "fp32" else data.view(np.uint16).reshape(-1)
        return TensorCodes(name, codec, data.shape, flat, None, block)
    scales = _get(payload, name + SCALE_SUFFIX, (np.float32,), name).reshape(-1)
    if codec == "int8":
        data = _get(payload, name, (np.int8,), name)
        shape, n, packed = data.shape, data.size, data.reshape(-1)
    else:
        shape = _shape(payload, name)
        n = math.prod(shape)
        per = 2 if codec == "int4" else 4
        packed = _get(payload, name, (np.uint8,), name).reshape(-1)
        if packed.size != -(-n // per):
            if codec == "int2":
                raise ValueError(f"int2: {packed.size} bytes cannot hold {n} codes")
            raise ValueError(
                f"payload tensor {name!r} has {packed.size} bytes, expected {-(-n // per)} "
                f"for shape {shape}"
            )
    if scales.size != _num_blocks(n, block):
        raise ValueError(
            f"payload tensor {name + SCALE_SUFFIX!r} has {scales.size} scales, expected "
            f"{_num_blocks(n, block)} for {n} elements in blocks of {block}"
        )
    return TensorCodes(name, codec, tuple(shape), packed, scales, block)


def chunk_step(block: int = DEFAULT_BLOCK) -> int:
    """Elements per chunk of `chunk_spans`."""
    return kernels.chunk_step(block)


def chunk_spans(size: int, block: int = DEFAULT_BLOCK) -> list[tuple[int, int]]:
    """[(start, end)] covering `size` elements in cache-sized chunks aligned for decoding."""
    step = kernels.chunk_step(block)
    return [(s, min(size, s + step)) for s in range(0, size, step)]


def decode_chunk(
    codes: TensorCodes,
    s: int,
    e: int,
    out: np.ndarray,
    check: bool = True,
    accumulate: bool = False,
) -> np.ndarray:
    """Elements [s, e) of the flattened tensor as float32 in `out` (e - s elements), or added
    to it (`accumulate`: out += them, rounded as that add); s from `chunk_spans`. ValueError
    if a code there is not a valid level (check=False: the caller has decoded these codes
    once already)."""
    if accumulate and codes.scales is None:
        out += decode_chunk(codes, s, e, np.empty(e - s, np.float32), check)
        return out
    if codes.codec == "fp32":
        np.copyto(out, codes.data[s:e])
        return out
    if codes.codec == "bf16":
        return kernels.decode_bf16(codes.data[s:e], out)
    levels = _LEVELS.get(codes.codec, 0)
    try:
        return kernels.decode_range(
            codes.codec,
            codes.data,
            codes.scales,
            s,
            e,
            codes.block,
            out,
            levels if check else 0,
            accumulate,
        )
    except ValueError:
        raise ValueError(
            f"payload tensor {codes.name!r} has codes outside [-{levels}, {levels}]"
        ) from None


def codes_sq(codes: TensorCodes) -> tuple[list[float], str | None]:
    """A quantized tensor's squared norm terms, one per `chunk_spans` chunk, from its codes
    (kernels.codes_sumsq: exact integer sums of the codes' squares per block, times the
    block's scale squared; nothing decoded), and the invalid-code error that stopped them
    (None: all done): the merge's contribution norms (training/merge/stream.py)."""
    n = math.prod(codes.shape)
    sums, done = kernels.codes_sumsq(
        codes.codec, codes.data, codes.scales, n, codes.block, chunk_step(), check=True
    )
    if done < sums.size:
        levels = _LEVELS.get(codes.codec, 0)
        error = f"payload tensor {codes.name!r} has codes outside [-{levels}, {levels}]"
        return sums[:done].tolist(), error
    return sums.tolist(), None


def _decode_tensor(name: str, payload: dict[str, np.ndarray], codec: str, block: int) -> np.ndarray:
    codes = tensor_codes(payload, name, codec, block)
    if codec == "fp32":
        return codes.data.astype(np.float32).reshape(codes.shape)
    n = math.prod(codes.shape)
    out = np.empty(n, np.float32)
    for s, e in chunk_spans(n, block):
        decode_chunk(codes, s, e, out[s:e])
    return out.reshape(codes.shape)


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
    per = 2 if codec == "int4" else 4
    return [(name, -(-n // per), 1), scales, (name + SHAPE_SUFFIX, 4 * len(shape), 1)]


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
    if codec in ("int8", "int4", "int2"):
        keys |= {name + SCALE_SUFFIX for name in names}
    if codec in ("int4", "int2"):
        keys |= {name + SHAPE_SUFFIX for name in names}
    return keys


def checked_codes(
    payload: Mapping[str, np.ndarray],
    codec: str,
    shapes: Mapping[str, tuple[int, ...]],
    fragment: int = 0,
) -> dict[str, TensorCodes]:
    """The codes of each tensor of a payload read from the bucket (untrusted), its structure
    checked: exactly the tensors of `shapes` (the fragment's tree), no payload tensor that
    `codec` does not write, each tensor's dtypes and sizes (`tensor_codes`) and shape;
    ValueError with the reason at the first problem. Its values (finiteness, valid codes) are
    checked as they are decoded. The one check of a pseudo-gradient (the merge) and of an update
    (the broadcast)."""
    names = sorted(k for k in payload if ".__" not in k)
    if names != sorted(shapes):
        extra = sorted(set(names) - set(shapes))[:3]
        missing = sorted(set(shapes) - set(names))[:3]
        raise ValueError(f"wrong tree for fragment {fragment}: extra {extra}, missing {missing}")
    allowed = payload_keys(names, codec)
    unexpected = sorted(set(payload) - allowed)
    if unexpected:
        raise ValueError(
            f"unreadable payload: unexpected payload tensors for codec {codec!r}: {unexpected[:3]}"
        )
    flat = dict(payload)
    checked = {}
    for n in names:
        try:
            codes = tensor_codes(flat, n, codec)
        except (ValueError, KeyError) as err:
            raise ValueError(f"unreadable payload: {str(err).strip(chr(39))}") from None
        if tuple(codes.shape) != tuple(shapes[n]):
            raise ValueError(
                f"wrong shape for {n}: {tuple(codes.shape)}, expected {tuple(shapes[n])}"
            )
        checked[n] = codes
    return checked
