"""The merge's streaming arithmetic: votes read chunk by chunk, never decoded whole.

A vote (one island's contribution to a fragment) is read through `Vote.chunk(name, s, e, out)`:
elements [s, e) of tensor `name`, flattened, as float32. A `PayloadVote` decodes them from the
payload's codes straight into a cache-sized scratch buffer (training/codecs.decode_chunk); a
`DenseVote` holds float32 arrays (an island whose several pending contributions are summed
into one vote). So a merge touches each contribution's bytes twice (its norm, then its fold
into the accumulator) and never holds a decoded copy of it.

`sq_norms` computes a vote's squared norms (all tensors, and the RDA body) in one pass and
checks finiteness on the way; `Combiner` (training/merge/combine.py) folds a vote with them.
Chunks come from `codecs.chunk_spans` (about 512 KiB of float32: within a core's L2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from training.codecs import host as codecs
from training.codecs import kernels, native


class Vote:
    """Float32 values of a vote, chunk by chunk (see the module docstring)."""

    def chunk(self, name: str, s: int, e: int, out: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def scaled(self, name: str, coef: np.float32) -> Callable[[int, int, np.ndarray], np.ndarray]:
        """(s, e, out) -> coef x elements [s, e) of `name`, written into `out`."""

        def read(s: int, e: int, out: np.ndarray) -> np.ndarray:
            return np.multiply(self.chunk(name, s, e, out), coef, out=out)

        return read

    def add_scaled(self, name: str, coef: np.float32) -> Callable[..., None]:
        """(s, e, acc, buf) -> acc += coef x elements [s, e) of `name`: `acc += scaled(s, e,
        buf)`, bit for bit (`buf`: scratch of at least e - s elements, where needed)."""
        scaled = self.scaled(name, coef)

        def add(s: int, e: int, acc: np.ndarray, buf: np.ndarray) -> None:
            acc += scaled(s, e, buf[: e - s])

        return add

    def chunk_sq(self, name: str, size: int, buf: np.ndarray) -> tuple[list[float], str | None]:
        """(the float64 sum of squares of each chunk of `name`, in chunk order; the error that
        stopped the pass or None): a chunk that does not decode stops it with its error, a
        non-finite sum is the caller's to judge (sq_norms)."""
        sums = []
        for s, e in codecs.chunk_spans(size):
            try:
                x = self.chunk(name, s, e, buf[: e - s])
            except ValueError as err:
                return sums, str(err)
            sums.append(sq(x))
        return sums, None

    def folder(self, name: str, coef: np.float32, first: bool) -> Callable[..., None]:
        """(s, e, acc, buf) -> acc = coef x elements [s, e) of `name` (`first`), else acc +=
        them: `scaled` and `add_scaled` bit for bit (`acc`: that chunk of the accumulator)."""
        if not first:
            return self.add_scaled(name, coef)
        scaled = self.scaled(name, coef)

        def write(s: int, e: int, acc: np.ndarray, buf: np.ndarray) -> None:
            got = scaled(s, e, acc)
            if not np.shares_memory(got, acc):
                np.copyto(acc, got)

        return write

    @property
    def nbytes(self) -> int:
        """The bytes this vote holds (its payload or arrays)."""
        return 0


class PayloadVote(Vote):
    """A checked payload (codecs.tensor_codes per tensor), decoded on demand."""

    def __init__(self, codes: Mapping[str, codecs.TensorCodes]):
        self.codes = dict(codes)

    def chunk(self, name: str, s: int, e: int, out: np.ndarray) -> np.ndarray:
        return codecs.decode_chunk(self.codes[name], s, e, out)

    def scaled(self, name: str, coef: np.float32) -> Callable[[int, int, np.ndarray], np.ndarray]:
        """Quantized codes decode with coef folded into their block scales (one multiply per
        element: codes x (scale x coef), rounded once), without re-checking the codes (the
        norm pass did)."""
        codes = self.codes[name]
        if codes.scales is None:
            return super().scaled(name, coef)
        folded = codes._replace(scales=codes.scales * coef)
        return lambda s, e, out: codecs.decode_chunk(folded, s, e, out, check=False)

    def add_scaled(self, name: str, coef: np.float32) -> Callable[..., None]:
        """Quantized codes: decoded and added into `acc` in one pass (the folded scales of
        `scaled`), no scratch."""
        codes = self.codes[name]
        if codes.scales is None:
            return super().add_scaled(name, coef)
        folded = codes._replace(scales=codes.scales * coef)

        def add(s: int, e: int, acc: np.ndarray, buf: np.ndarray) -> None:
            codecs.decode_chunk(folded, s, e, acc, check=False, accumulate=True)

        return add

    def chunk_sq(self, name: str, size: int, buf: np.ndarray) -> tuple[list[float], str | None]:
        """Quantized codes: the norm from the codes, never decoded (codecs.codes_sq: per block
        the exact sum of the codes' squares times the scale squared; the norm of the values
        the codes stand for, before each is rounded to float32), checked as decoding does."""
        codes = self.codes[name]
        if codes.scales is None:
            return super().chunk_sq(name, size, buf)
        return codecs.codes_sq(codes)

    def quantized(self, name: str, coef: np.float32):
        """(kind, codes, scales x coef) of `name` for kernels.fold_votes, or None (not a
        quantized codec)."""
        codes = self.codes[name]
        if codes.scales is None or codes.block != codecs.DEFAULT_BLOCK:
            return None
        return codes.codec, codes.data, codes.scales * coef

    @property
    def nbytes(self) -> int:
        return sum(
            c.data.nbytes + (0 if c.scales is None else c.scales.nbytes)
            for c in self.codes.values()
        )


class DenseVote(Vote):
    """Float32 tensors, read as views (`owned`: arrays made by add_votes, summed in place)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], owned: bool = False):
        self.flat = {n: v.reshape(-1) for n, v in tensors.items()}
        self.owned = owned

    def chunk(self, name: str, s: int, e: int, out: np.ndarray) -> np.ndarray:
        return self.flat[name][s:e]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.flat.values())


def spans(shape: Sequence[int]) -> list[tuple[int, int]]:
    return codecs.chunk_spans(math.prod(shape))


def scratch() -> np.ndarray:
    """A float32 buffer of one chunk."""
    return np.empty(codecs.chunk_step(), np.float32)


class Arena:
    """A merge's fragment-sized float32 memory, kept from merge to merge: the accumulators
    (`tensors`: views of one flat array, grown only when a larger fragment asks) and a
    one-chunk scratch. A fresh array of a fragment's size costs its page faults on every merge
    (about 1 s per 2 GiB here: docs/BENCHMARKS.md, "Merge at the real size"); the arena pays
    them once. What `tensors` returned is overwritten by the next call: one merge at a time."""

    def __init__(self) -> None:
        self._flat = np.empty(0, np.float32)
        self.scratch = scratch()

    def tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        total = sum(math.prod(s) for s in shapes.values())
        if self._flat.size < total:
            self._flat = np.empty(0, np.float32)  # the old one let go before the new is made
            self._flat = np.empty(total, np.float32)
        out, at = {}, 0
        for n, s in shapes.items():
            size = math.prod(s)
            out[n] = self._flat[at : at + size].reshape(s)
            at += size
        return out


def sq(x: np.ndarray) -> float:
    """The squared norm of a float32 chunk, the same bits on every machine and thread count:
    the squares are exact in float64 (24 + 24 mantissa bits < 53; no overflow either) and
    numpy's pairwise float64 sum has a fixed order (no BLAS `sdot`, whose kernel and threads
    follow the CPU and OPENBLAS/OMP settings). docs/ALGORITHM.md, "What the bits depend on"."""
    sums = native.chunk_sumsq(x, max(x.size, 1)) if x.ndim == 1 else None
    if sums is not None:  # the C loop, numpy's pairwise order bit for bit
        return float(sums[0]) if sums.size else 0.0
    return float(np.add.reduce(np.square(x, dtype=np.float64)))


def sq_norms(
    vote: Vote, shapes: Mapping[str, tuple[int, ...]], body: Sequence[str], buf: np.ndarray
) -> tuple[float, float]:
    """(squared norm of all tensors, of the `body` tensors) of `vote`, in one pass; ValueError
    "non-finite values in NAME" at the first NaN or infinity (or invalid code, from decoding)."""
    body_set = set(body)
    total = body_sq = 0.0
    for n, shape in shapes.items():
        tensor_sq = 0.0
        sums, error = vote.chunk_sq(n, math.prod(shape), buf)
        for d in sums:
            if not math.isfinite(d):  # NaN or infinity in x (float64 squares cannot overflow)
                raise ValueError(f"non-finite values in {n}")
            tensor_sq += d
        if error is not None:
            raise ValueError(error)
        total += tensor_sq
        if n in body_set:
            body_sq += tensor_sq
    return total, body_sq


def fold_votes(
    votes: Sequence[tuple[Vote, np.float32]],
    name: str,
    acc: np.ndarray,
    init: bool,
    buf: np.ndarray,
    sums: bool,
) -> list[float] | None:
    """acc (tensor `name`, flat) = the votes' coef x values folded in order, the first written
    when `init` (else added), the rest added: chunk by chunk, every vote into a chunk while it
    is in cache (one C loop when every vote is quantized: kernels.fold_votes), element by
    element the operations of folding one vote after another. `sums`: returns the sums of
    squares of acc's chunks after (`sq`)."""
    step = codecs.chunk_step()
    chunks = -(-acc.size // step)
    quantized = [
        v.quantized(name, coef) if isinstance(v, PayloadVote) else None for v, coef in votes
    ]
    if all(q is not None for q in quantized):
        out = np.empty(chunks, np.float64) if sums else None
        if kernels.fold_votes(quantized, acc.size, codecs.DEFAULT_BLOCK, step, acc, init, out):
            return None if out is None else out.tolist()
    folders = [v.folder(name, coef, init and i == 0) for i, (v, coef) in enumerate(votes)]
    terms = [] if sums else None
    for s, e in codecs.chunk_spans(acc.size):
        for fold in folders:
            fold(s, e, acc[s:e], buf)
        if terms is not None:
            terms.append(sq(acc[s:e]))
    return terms


def folded(votes: Sequence[tuple[Vote, np.float32]], name: str, size: int) -> kernels.Folded | None:
    """Tensor `name` of the votes' coef x values as a kernels.Folded (what `fold_votes` with
    `init` writes, recomputed where the outer step uses it, never stored), or None where the
    C loops do not take them (a vote not quantized, another block size, no C loops)."""
    quantized = [
        v.quantized(name, coef) if isinstance(v, PayloadVote) else None for v, coef in votes
    ]
    if any(q is None for q in quantized):
        return None
    if not kernels.Folded.usable(quantized, codecs.DEFAULT_BLOCK):
        return None
    return kernels.Folded(quantized, size, codecs.DEFAULT_BLOCK)


def add_votes(
    current: Vote, new: Vote, shapes: Mapping[str, tuple[int, ...]], buf: np.ndarray
) -> DenseVote:
    """current + new, element-wise in float32 (as `a += b`): in place when `current` is a sum
    this function made, else into new arrays."""
    if isinstance(current, DenseVote) and current.owned:
        out = current
    else:
        out = DenseVote({n: np.empty(s, np.float32) for n, s in shapes.items()}, owned=True)
        for n, shape in shapes.items():
            for s, e in spans(shape):
                target = out.flat[n][s:e]
                got = current.chunk(n, s, e, target)
                if got is not target:
                    np.copyto(target, got)
    for n, shape in shapes.items():
        for s, e in spans(shape):
            out.flat[n][s:e] += new.chunk(n, s, e, buf[: e - s])
    return out


def norm_of(tensors: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> float:
    """The float norm of `tensors` (or of `names` among them), by chunked float32 dots."""
    return math.sqrt(sq_total(chunk_sq_of(tensors, names)))


def chunk_sq_of(
    tensors: Mapping[str, np.ndarray], names: Sequence[str] | None = None
) -> dict[str, list[float]]:
    """Per tensor (of `names`, else all, in that order), the float64 sums of squares of its
    chunks (codecs.chunk_spans) in chunk order: what `norm_of` adds up (`sq_total`)."""
    out = {}
    for n in tensors if names is None else names:
        flat = tensors[n].reshape(-1)
        sums = native.chunk_sumsq(flat, codecs.chunk_step())
        if sums is None:
            out[n] = [sq(flat[s:e]) for s, e in codecs.chunk_spans(flat.size)]
        else:
            out[n] = sums.tolist()
    return out


def sq_total(sums: Mapping[str, Sequence[float]], names: Sequence[str] | None = None) -> float:
    """The squared norm from per-chunk sums (`chunk_sq_of`, or carried from the pass that wrote
    the tensors), added one by one in tensor then chunk order: the same float whichever pass
    made the terms."""
    total = 0.0
    for n in sums if names is None else names:
        for d in sums[n]:
            total += d
    return total
