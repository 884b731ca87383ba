"""The codecs' arithmetic, vectorized: cache-sized chunks, preallocated outputs, no temporaries.

training/codecs/host.py owns the payload layout and the checks; this module only computes, and
produces exactly the bits of the reference implementation (tests/test_codec_golden.py):
- quantization (int8, int4, int2) per block of `block` elements of the flattened tensor; the
  last, partial block is padded with zeros in a small scratch copy;
- `encode_*` read `delta` (+ `residual`) once, chunk by chunk, and write the payload and the
  new residual (x - decode(payload)) in the same pass while the chunk is in cache;
- `decode_*` write each float32 element once (int4 codes unpacked with 16-bit shifts, int2
  through a 256-entry table of the levels per byte).
A chunk is CHUNK elements (a multiple of 4 blocks, so packed bytes never straddle chunks).
Where training/codecs/native.py could build its C loops (one pass per chunk instead of about
seven numpy passes: 3-4x faster encodes), a chunk goes through them; the numpy code below is
the fallback and the definition (the C file gives the same bits: tests/test_native.py).

Past 500 lines on purpose: it mirrors training/codecs/native.c loop for loop (encode, decode,
the norms from the codes, the folds of votes, and the inputs of its fused merge pass:
`Fused`, `Folded`), so that each C loop has its numpy definition or its caller in one file to
read beside it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import ml_dtypes
import numpy as np

from training.codecs import native
from training.codecs.int2 import HALF_RANGE

CHUNK = 1 << 17  # elements per chunk: 512 KiB of float32, within a core's L2


def _chunk_blocks(block: int) -> int:
    return max(4, (CHUNK // block) // 4 * 4)


class NonFinite(ValueError):
    """The input holds NaN or infinity."""


def _blocks(x: np.ndarray, block: int, pad: np.ndarray) -> np.ndarray:
    """x as (blocks, block); a partial last block goes through the zero-padded `pad`."""
    m = x.size
    if m % block == 0:
        return x.reshape(-1, block)
    nb = -(-m // block)
    buf = pad[: nb * block]
    buf[m:] = 0
    buf[:m] = x
    return buf.reshape(nb, block)


def _source(a: np.ndarray, b: np.ndarray | None, op: int, s: int, e: int, xbuf: np.ndarray):
    """a[s:e] + b[s:e] (op 1) or a[s:e] - b[s:e] (op -1) in `xbuf`, or the view a[s:e]."""
    if b is None:
        return a[s:e]
    out = xbuf[: e - s]
    (np.add if op > 0 else np.subtract)(a[s:e], b[s:e], out=out)
    return out


_KIND = {"int8": 8, "int4": 4, "int2": 2}
_PER = {"int8": 1, "int4": 2, "int2": 4}
_CODE_LEVELS = {"int8": 127, "int4": 7, "int2": 0}  # the codes' range (int2: every code valid)


def _quantized_outputs(
    n: int, block: int, kind: str, alloc: Callable[[int], memoryview] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """New (codes, scales) arrays for n elements, or views of `alloc(nbytes)` buffers (a
    pool's, reused from one merge to the next: training/store/buffers.py)."""
    dtype = np.int8 if kind == "int8" else np.uint8
    size, blocks = -(-n // _PER[kind]), -(-n // block)
    if alloc is None:
        return np.empty(size, dtype), np.empty(blocks, np.float32)
    data = np.frombuffer(alloc(size), dtype)
    return data, np.frombuffer(alloc(4 * blocks), np.float32)


def encode_quantized(
    delta: np.ndarray, residual: np.ndarray | None, levels: float, block: int, kind: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data, scales, new residual) of flat float32 `delta` (+ `residual`) in `kind`:
    "int8" (int8 codes in [-levels, levels]), "int4" (uint8, two codes q + 8 per byte, low
    nibble first), "int2" (uint8, four codes 0..3 per byte, levels -1.5..1.5). NonFinite if
    any input element is NaN or infinite (a block's absmax is then not finite)."""
    data, scales = _quantized_outputs(delta.size, block, kind)
    new_residual = np.empty(delta.size, np.float32)
    _quantize(kind, levels, block, delta, residual, 1, data, scales, new_residual, 0)
    return data, scales, new_residual


def encode_quantized_step(
    target: np.ndarray,
    base: np.ndarray,
    levels: float,
    block: int,
    kind: str,
    alloc: Callable[[int], memoryview] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(data, scales) of `target - base` (flat float32) as encode_quantized, and `base` +=
    its decoded values, in place: the broadcast's update and new shadow in one pass (the
    shadow's add is decode's values, bit for bit). NonFinite as above (then `base` is partly
    updated: the caller discards it)."""
    data, scales = _quantized_outputs(target.size, block, kind, alloc)
    _quantize(kind, levels, block, target, base, -1, data, scales, base, 1)
    return data, scales


class Fused(NamedTuple):
    """What a pass that writes an encode step's target writes for one tensor as it goes
    (native.c `outer_encode_sq`): the quantized codec (its `levels`, `block`), the flat
    float32 base it adds the decoded values to (the new shadow) and the codes and scales it
    fills."""

    codec: str
    levels: float
    block: int
    base: np.ndarray
    data: np.ndarray
    scales: np.ndarray

    @property
    def kind(self) -> int:
        """The codec as native.c names it (8, 4, 2)."""
        return _KIND[self.codec]

    @property
    def per(self) -> int:
        """Codes per byte."""
        return _PER[self.codec]


def fused_step(
    target: np.ndarray,
    base: np.ndarray,
    levels: float,
    block: int,
    kind: str,
    alloc: Callable[[int], memoryview] | None = None,
) -> Fused | None:
    """The outputs of encode_quantized_step(target, base, ...) for a pass that writes `target`
    chunk by chunk (chunk_step(block) elements) to encode each chunk as it is written, or None
    where the C loop cannot take it (then encode_quantized_step does it after)."""
    if block % 4 or native.library() is None or not native.fits_float32(target, base):
        return None
    data, scales = _quantized_outputs(target.size, block, kind, alloc)
    if not (native.fits(data) and native.fits_float32(scales)):
        return None
    return Fused(kind, float(levels), block, base, data, scales)


def encode_rest(fused: Fused, target: np.ndarray, s: int, e: int) -> None:
    """Encode elements [s, e) of a fused tensor (flat `target`) that its pass left: s the start
    of the chunk native.c `outer_encode_sq` refused, e the end of that pass's range (a chunk
    end or the tensor's). encode_quantized_step's arithmetic on them, numpy where C refuses:
    the same bits. NonFinite as there."""
    per, block = fused.per, fused.block
    _quantize(
        fused.codec,
        fused.levels,
        block,
        target[s:e],
        fused.base[s:e],
        -1,
        fused.data[s // per : -(-e // per)],
        fused.scales[s // block : -(-e // block)],
        fused.base[s:e],
        1,
    )


def _quantize(kind, levels, block, a, b, op, data, scales, out, sink) -> None:
    """Codes and scales of x = a (op b) into data/scales; out = x - decoded (sink 0) or
    out += decoded (sink 1), chunk by chunk: the C loop where it loaded (training/
    native.py) and accepts the chunk, else numpy. On NonFinite `out` is partly
    written."""
    n = a.size
    step = chunk_step(block)
    per = _PER[kind]
    # the C loop packs block by block: every block must start on a byte (block % 4 == 0)
    usable = block % 4 == 0 and native.fits_float32(a, b, scales, out) and native.fits(data)
    lib = native.library() if usable else None
    scratch: dict[str, np.ndarray] = {}
    if lib is not None:
        pa, pb, pd, ps, po = (native.address(v) for v in (a, b, data, scales, out))
    lv = np.float32(levels)
    for s in range(0, n, step):
        e = min(n, s + step)
        if lib is not None:
            status = lib.encode_quantized(
                _KIND[kind],
                levels,
                e - s,
                block,
                pa + 4 * s,
                None if pb is None else pb + 4 * s,
                op if pb is not None else 0,
                pd + s // per,
                ps + 4 * (s // block),
                po + 4 * s,
                sink,
            )
            if status == 0:
                continue
            if status == 1:
                raise NonFinite("non-finite values")
            # else levels / absmax overflowed in a block (or no scratch): numpy redoes the chunk
        if not scratch:
            m = min(step, -(-n // block) * block)
            scratch = dict(
                x=np.empty(min(step, n), np.float32),
                pad=np.empty(m, np.float32),
                q=np.empty(m, np.float32),
                u=np.empty(m, np.uint32),
            )
        _quantize_chunk(kind, lv, block, a, b, op, data, scales, out, sink, s, e, scratch)


def _quantize_chunk(kind, lv, block, a, b, op, data, scales, out, sink, s, e, scratch) -> None:
    x = _source(a, b, op, s, e, scratch["x"])
    blocks = _blocks(x, block, scratch["pad"])
    k = blocks.shape[0]
    b0 = s // block
    q = scratch["q"][: k * block].reshape(k, block)
    # |x| as bits (sign cleared): for floats >= 0 the integer order is the float order,
    # and a NaN's bits are above infinity's, so the row max is the absmax, NaN included
    bits = scratch["u"][: k * block].reshape(k, block)
    np.bitwise_and(blocks.view(np.uint32), np.uint32(0x7FFFFFFF), out=bits)
    absmax = bits.max(axis=1).view(np.float32)
    if not np.isfinite(absmax).all():
        raise NonFinite("non-finite values")
    sc = scales[b0 : b0 + k]
    np.divide(absmax, lv, out=sc)
    if kind == "int2":
        safe = np.where(sc > 0, sc, np.float32(1))
        np.divide(blocks, safe[:, None], out=q)
        q += np.float32(2.0)
        np.floor(q, out=q)
        np.clip(q, 0, 3, out=q)
    else:
        positive = absmax > 0
        inv = np.where(positive, lv / np.where(positive, absmax, 1), 0).astype(np.float32)
        np.multiply(blocks, inv[:, None], out=q)
        np.rint(q, out=q)
        if not np.isfinite(inv).all():
            # |x * inv| <= levels (1 + 2 eps) rounds to at most `levels`: the clip matters
            # only where levels / absmax overflowed (absmax below ~1e-36)
            np.clip(q, -lv, lv, out=q)
    flat = q.reshape(-1)
    m = e - s
    _pack(kind, flat, m, data, s)
    if kind == "int2":
        flat -= np.float32(HALF_RANGE)
    np.multiply(q, sc[:, None], out=q)
    if sink:
        out[s:e] += flat[:m]
    else:
        np.subtract(x, flat[:m], out=out[s:e])


def _pack(kind: str, q: np.ndarray, m: int, data: np.ndarray, s: int) -> None:
    """Store the chunk's m codes (floats holding exact integers) into `data` from element s.
    A partial last byte gets the reference's pad codes: 8 (q = 0) for int4, 0 for int2."""
    if kind == "int8":
        data[s : s + m] = q[:m]
        return
    per, shift, offset = (2, 16, 8) if kind == "int4" else (4, 4, 0)
    full = m // per
    out = data[s // per :]
    if full:
        groups = q[: full * per].reshape(full, per)
        acc = groups[:, per - 1] + np.float32(offset)
        for j in range(per - 2, -1, -1):
            acc *= np.float32(shift)
            acc += groups[:, j]
            if offset:
                acc += np.float32(offset)
        out[:full] = acc
    if m % per:
        codes = [int(c) + offset for c in q[full * per : m]]
        codes += [8 if kind == "int4" else 0] * (per - len(codes))
        out[full] = sum(c << (j * (4 if kind == "int4" else 2)) for j, c in enumerate(codes))


def _unpack4(packed: np.ndarray) -> np.ndarray:
    """int8 codes q (nibble - 8), two per byte, low nibble first: each byte widened to 16
    bits, its high nibble moved to the high byte (little-endian: the second code)."""
    wide = packed.astype("<u2")  # little-endian storage, whatever the host
    wide |= wide << 4
    wide &= 0x0F0F
    codes = wide.view(np.int8)
    codes -= np.int8(8)
    return codes


def _tables() -> dict[str, np.ndarray]:
    """Per byte, int2: its four levels (code - 1.5) as float32."""
    byte = np.arange(256)
    quad = np.stack([((byte >> sh) & 3) - HALF_RANGE for sh in (0, 2, 4, 6)], axis=1)
    return {"int2": quad.astype(np.float32)}


_LUT = _tables()


def _scale_into(codes: np.ndarray, scales: np.ndarray, b0: int, block: int, out: np.ndarray):
    """out = codes x the scale of their block (blocks counted from b0); codes may be out."""
    m = out.size
    full = m // block * block
    if full:
        np.multiply(
            codes[:full].reshape(-1, block),
            scales[b0 : b0 + full // block, None],
            out=out[:full].reshape(-1, block),
        )
    if full < m:
        np.multiply(codes[full:m], scales[b0 + full // block], out=out[full:])


def chunk_step(block: int) -> int:
    """Elements per chunk for blocks of `block`: chunk starts are block- and byte-aligned."""
    return _chunk_blocks(block) * block


def decode_range(
    kind: str,
    data: np.ndarray,
    scales: np.ndarray,
    s: int,
    e: int,
    block: int,
    out: np.ndarray,
    levels: int = 127,
    accumulate: bool = False,
) -> np.ndarray:
    """Elements [s, e) of a quantized tensor, decoded into `out` (float32, e - s elements,
    contiguous), or added to it (`accumulate`: out += decoded, rounded as that numpy add);
    s is a multiple of chunk_step(block). ValueError if a code there is outside [-levels,
    levels] (int8: -128; int4: nibble 0; int2 has no invalid code); levels 0: no check."""
    lib = native.library()
    if (
        lib is not None
        and levels in (0, _CODE_LEVELS[kind])  # the C loop checks exactly those
        and out.dtype == np.float32
        and scales.dtype == np.float32
        and data.itemsize == 1
        and out.flags.c_contiguous
        and scales.flags.c_contiguous
        and data.flags.c_contiguous
    ):
        status = lib.decode_quantized(
            _KIND[kind],
            data.ctypes.data,
            scales.ctypes.data,
            s,
            e,
            block,
            out.ctypes.data,
            int(accumulate),
            int(bool(levels)),
        )
        if status:
            raise ValueError(f"codes outside [-{levels}, {levels}]")
        return out
    per = _PER[kind]
    lo, hi = s // per, -(-e // per)
    if kind == "int8":
        codes = data[s:e]
    elif kind == "int4":
        codes = _unpack4(data[lo:hi])[: e - s]
    else:
        codes = np.empty((hi - lo, 4), np.float32)
        np.take(_LUT["int2"], data[lo:hi], axis=0, out=codes)
        codes = codes.reshape(-1)[: e - s]
    if levels and kind != "int2" and codes.size and codes.min() < -levels:
        raise ValueError(f"codes outside [-{levels}, {levels}]")
    if accumulate:
        values = np.empty(e - s, np.float32)
        _scale_into(codes, scales, s // block, block, values)
        out += values
    else:
        _scale_into(codes, scales, s // block, block, out)
    return out


def codes_sumsq(
    kind: str,
    data: np.ndarray,
    scales: np.ndarray,
    n: int,
    block: int,
    step: int,
    check: bool,
) -> tuple[np.ndarray, int]:
    """(per chunk of `step` elements, the squared norm of a quantized tensor's n values from
    its codes, never decoded; the chunks done: fewer than the tensor holds when that chunk has
    an invalid code and `check`). Per block the exact integer sum of its codes' squares Q
    (int2: of (2 code - 3)^2, then Q / 4), times its scale squared in float64; a block whose
    scale x levels overflows float32 gives +inf; each chunk's terms added in numpy's pairwise
    order. The C loop (native.c `codes_sumsq`) and this numpy code give the same bits."""
    chunks = -(-n // step)
    sums = np.empty(chunks, np.float64)
    lib = native.library()
    if (
        lib is not None
        and step % chunk_step(block) == 0
        and data.itemsize == 1
        and data.flags.c_contiguous
        and native.fits_float32(scales)
    ):
        parts = []

        def run(s: int, e: int, k0: int) -> None:
            got = lib.codes_sumsq(
                _KIND[kind],
                data.ctypes.data,
                scales.ctypes.data,
                s,
                e,
                block,
                step,
                int(check),
                sums.ctypes.data + 8 * k0,
            )
            parts.append((k0, got, -(-(e - s) // step)))

        native.over_chunks(n, step, run)
        done = 0
        for _k0, got, want in sorted(parts):
            if got < 0:
                raise MemoryError("codes_sumsq: no memory for one chunk's block terms")
            done += got
            if got < want:
                break
        return sums, done
    per, levels = _PER[kind], np.float32(_CODE_LEVELS[kind] or HALF_RANGE)
    for k, c in enumerate(range(0, n, step)):
        ce = min(n, c + step)
        raw = data[c // per : -(-ce // per)].view(np.uint8)
        if kind == "int8":
            codes = raw.view(np.int8).astype(np.int64)
        elif kind == "int4":
            codes = np.stack([raw & 15, raw >> 4], axis=1).reshape(-1).astype(np.int64) - 8
        else:
            codes = np.stack([(raw >> (2 * j)) & 3 for j in range(4)], axis=1).reshape(-1)
            codes = 2 * codes.astype(np.int64) - 3
        codes = codes[: ce - c]
        if check and kind != "int2" and codes.size and codes.min() < -_CODE_LEVELS[kind]:
            return sums, k
        q = np.zeros(-(-codes.size // block) * block, np.int64)
        q[: codes.size] = codes * codes
        q = q.reshape(-1, block).sum(axis=1)
        sc = scales[c // block : c // block + q.size]
        sc64 = sc.astype(np.float64)
        qd = q.astype(np.float64) * 0.25 if kind == "int2" else q.astype(np.float64)
        terms = (sc64 * sc64) * qd
        with np.errstate(over="ignore", invalid="ignore"):
            overflow = ~np.isfinite(sc * levels) & ~np.isnan(sc)
        terms[overflow] = np.inf
        sums[k] = np.add.reduce(terms)
    return sums, chunks


def _foldable(votes: list[tuple[str, np.ndarray, np.ndarray]]) -> bool:
    """Whether native.c's fold loops take these votes (kind, codes, scales): loaded, at least
    one, one-byte contiguous codes and float32 scales."""
    return (
        native.library() is not None
        and bool(votes)
        and all(
            d.itemsize == 1 and d.flags.c_contiguous and native.fits_float32(sc)
            for _, d, sc in votes
        )
    )


def _vote_pointers(votes: list[tuple[str, np.ndarray, np.ndarray]]) -> tuple:
    """(k, kinds, codes, scales) of the votes as native.c's fold loops take them."""
    k = len(votes)
    kinds = (ctypes.c_int * k)(*(_KIND[kind] for kind, _, _ in votes))
    datas = (ctypes.c_void_p * k)(*(d.ctypes.data for _, d, _ in votes))
    scales = (ctypes.c_void_p * k)(*(sc.ctypes.data for _, _, sc in votes))
    return k, kinds, datas, scales


def fold_votes(
    votes: list[tuple[str, np.ndarray, np.ndarray]],
    n: int,
    block: int,
    step: int,
    acc: np.ndarray,
    init: bool,
    sums: np.ndarray | None,
) -> bool:
    """Quantized votes (kind, codes, coefficient-folded scales) folded into the flat float32
    `acc` chunk by chunk in one C loop (native.c `fold_votes`): the first written when `init`,
    the rest added, in order; `sums[k]` the sum of squares of acc's chunk k after. The bits of
    decode_range over the whole tensor vote after vote. False when the C loops cannot take them
    (the caller folds vote by vote)."""
    lib = native.library()
    if (
        not _foldable(votes)
        or step % chunk_step(block)
        or not native.fits_float32(acc)
        or acc.size != n
    ):
        return False
    k, kinds, datas, scales = _vote_pointers(votes)

    def run(s: int, e: int, k0: int) -> None:
        chunk_sums = None if sums is None else sums.ctypes.data + 8 * k0
        lib.fold_votes(
            k,
            kinds,
            datas,
            scales,
            s,
            e,
            block,
            step,
            acc.ctypes.data + 4 * s,
            int(init),
            chunk_sums,
        )

    native.over_chunks(n, step, run)
    return True


class Folded:
    """A tensor's update as quantized votes to fold (kind, codes, coefficient-folded scales),
    never written out: what `fold_votes(votes, n, block, step, acc, init=True)` would leave in
    `acc`, recomputed by the pass that uses it (native.c `fold_outer_encode_sq`: the outer
    step folds each stretch of votes in L1), so a merge holds no fragment-sized accumulator and
    does not write one and read it back. `usable` says whether the C loops take these votes;
    `sums` are the accumulator's per-chunk sums of squares and `dense` the accumulator itself,
    the bits of fold_votes either way."""

    def __init__(self, votes: list[tuple[str, np.ndarray, np.ndarray]], n: int, block: int):
        self.votes, self.size, self.block = votes, n, block
        self._pointers = _vote_pointers(votes)

    @staticmethod
    def usable(votes, block: int) -> bool:
        """int8 / int4 votes the fold loops take, in blocks that tile the fused loop's
        4096-element stretches."""
        return (
            block % 256 == 0 and _foldable(votes) and all(v[0] in ("int8", "int4") for v in votes)
        )

    def pointers(self) -> tuple:
        """(k, kinds, codes, scales) as native.c's fold loops take them."""
        return self._pointers

    def sums(self, step: int) -> list[float]:
        """Per chunk of `step` elements, the sum of squares of the accumulator fold_votes would
        write (native.c `fold_sums`: each chunk folded into one reused scratch)."""
        lib = native.library()
        out = np.empty(-(-self.size // step), np.float64)
        scratch: dict[int, np.ndarray] = {}

        def run(s: int, e: int, k0: int) -> None:
            buf = scratch.setdefault(k0, np.empty(step, np.float32))
            lib.fold_sums(
                *self.pointers(), s, e, self.block, step, buf.ctypes.data, out.ctypes.data + 8 * k0
            )

        native.over_chunks(self.size, step, run)
        return out.tolist()

    def dense(self) -> np.ndarray:
        """The accumulator itself, in a new array (for a step the fused loop does not take)."""
        acc = np.empty(self.size, np.float32)
        if not fold_votes(
            self.votes, self.size, self.block, chunk_step(self.block), acc, True, None
        ):
            raise ValueError("the C loops do not take these votes")
        return acc


def decode_quantized(
    data: np.ndarray, scales: np.ndarray, n: int, block: int, kind: str, levels: int = 127
) -> np.ndarray:
    """Flat float32 of n elements: codes x their block's scale (decode_range, chunk by chunk)."""
    out = np.empty(n, np.float32)
    step = chunk_step(block)
    for s in range(0, n, step):
        e = min(n, s + step)
        decode_range(kind, data, scales, s, e, block, out[s:e], levels)
    return out


def encode_bf16(delta: np.ndarray, residual: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 bfloat16 bits, round-to-nearest-even, new residual) of flat float32 `delta`
    (+ `residual`); NonFinite for NaN or infinity."""
    bits = np.empty(delta.size, np.uint16)
    new_residual = np.empty(delta.size, np.float32)
    _bf16(delta, residual, 1, bits, new_residual, 0)
    return bits, new_residual


def encode_bf16_step(target: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The bits of `target - base` as encode_bf16, and `base` += their widened values in
    place (encode_quantized_step's bf16 twin)."""
    bits = np.empty(target.size, np.uint16)
    _bf16(target, base, -1, bits, base, 1)
    return bits


def _bf16(a, b, op, bits, out, sink) -> None:
    """bits of x = a (op b); out = x - widened (sink 0) or out += widened (sink 1), chunk by
    chunk (as _quantize: the C loop where it loaded, else numpy; on NonFinite `out` is
    partly written)."""
    n = a.size
    lib = native.library() if native.fits_float32(a, b, out) and native.fits(bits) else None
    if lib is not None:
        pa, pb, pd, po = (native.address(v) for v in (a, b, bits, out))
    scratch: dict[str, np.ndarray] = {}
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        if lib is not None:
            status = lib.encode_bf16(
                e - s,
                pa + 4 * s,
                None if pb is None else pb + 4 * s,
                op if pb is not None else 0,
                pd + 2 * s,
                po + 4 * s,
                sink,
            )
            if status == 0:
                continue
            raise NonFinite("non-finite values")
        if not scratch:
            m = min(CHUNK, n)
            scratch = dict(x=np.empty(m, np.float32), u=np.empty(m, np.uint32))
            scratch["r"] = np.empty(m, np.uint32)
        x = _source(a, b, op, s, e, scratch["x"])
        if not np.isfinite(x).all():
            raise NonFinite("non-finite values")
        ub, rb = scratch["u"][: e - s], scratch["r"][: e - s]
        xu = x.view(np.uint32)
        np.right_shift(xu, 16, out=rb)
        rb &= 1
        rb += 0x7FFF
        np.add(xu, rb, out=ub)
        ub >>= 16
        bits[s:e] = ub
        ub <<= 16
        if sink:
            out[s:e] += ub.view(np.float32)
        else:
            np.subtract(x, ub.view(np.float32), out=out[s:e])


def decode_bf16(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Flat float32 of flat uint16 bfloat16 bits (exact: ml_dtypes' widening, one pass), into
    `out` if given."""
    out = np.empty(bits.size, np.float32) if out is None else out
    np.copyto(out, bits.view(ml_dtypes.bfloat16), casting="unsafe")
    return out
