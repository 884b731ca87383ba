"""The merge's streaming arithmetic: votes read chunk by chunk, never decoded whole.

A vote (one island's contribution to a fragment) is read through `Vote.chunk(name, s, e, out)`:
elements [s, e) of tensor `name`, flattened, as float32. A `PayloadVote` decodes them from the
payload's codes straight into a cache-sized scratch buffer (training/codecs.decode_chunk); a
`DenseVote` holds float32 arrays (an island whose several pending contributions are summed
into one vote). So a merge touches each contribution's bytes twice (its norm, then its fold
into the accumulator) and never holds a decoded copy of it.

`sq_norms` computes a vote's squared norms (all tensors, and the RDA body) in one pass and
checks finiteness on the way; `Combiner` (training/merge/rules.py) folds a vote with them.
Chunks come from `codecs.chunk_spans` (about 512 KiB of float32: within a core's L2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from training.codecs import host as codecs


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


class DenseVote(Vote):
    """Float32 tensors, read as views (`owned`: arrays made by add_votes, summed in place)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], owned: bool = False):
        self.flat = {n: v.reshape(-1) for n, v in tensors.items()}
        self.owned = owned

    def chunk(self, name: str, s: int, e: int, out: np.ndarray) -> np.ndarray:
        return self.flat[name][s:e]


def spans(shape: Sequence[int]) -> list[tuple[int, int]]:
    return codecs.chunk_spans(math.prod(shape))


def scratch() -> np.ndarray:
    """A float32 buffer of one chunk."""
    return np.empty(codecs.chunk_step(), np.float32)


def _sq(x: np.ndarray) -> float:
    """The squared norm of a float32 chunk, the same bits on every machine and thread count:
    the squares are exact in float64 (24 + 24 mantissa bits < 53; no overflow either) and
    numpy's pairwise float64 sum has a fixed order (no BLAS `sdot`, whose kernel and threads
    follow the CPU and OPENBLAS/OMP settings). docs/DESIGN.md, "What the bits depend on"."""
    return float(np.add.reduce(np.square(x, dtype=np.float64)))


def sq_norms(
    vote: Vote, shapes: Mapping[str, tuple[int, ...]], body: Sequence[str], buf: np.ndarray
) -> tuple[float, float]:
    """(squared norm of all tensors, of the `body` tensors) of `vote`, in one pass; ValueError
    "non-finite values in NAME" at the first NaN or infinity (or invalid code, from decoding)."""
    body_set = set(body)
    total = body_sq = 0.0
    for n, shape in shapes.items():
        sq = 0.0
        for s, e in spans(shape):
            x = vote.chunk(n, s, e, buf[: e - s])
            d = _sq(x)
            if not math.isfinite(d):  # NaN or infinity in x (float64 squares cannot overflow)
                raise ValueError(f"non-finite values in {n}")
            sq += d
        total += sq
        if n in body_set:
            body_sq += sq
    return total, body_sq


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
    total = 0.0
    for n in tensors if names is None else names:
        flat = tensors[n].reshape(-1)
        for s, e in codecs.chunk_spans(flat.size):
            total += _sq(flat[s:e])
    return math.sqrt(total)
