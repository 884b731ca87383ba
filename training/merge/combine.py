"""The combiner: islands' votes folded into one update for a fragment, tensor by tensor, in
float32 (radial-directional averaging over the non-embedding tensors, the weighted mean for
embeddings). It never holds a decoded contribution. Quantized votes (every codec but fp32 and
bf16) are kept as their codes until the outer step, which folds them stretch by stretch in
L1 as it goes (`finish(lazy=True)`: kernels.Folded; the averaging step's norm from the same
fold into one chunk of scratch), so no fragment-sized accumulator is written; other votes,
and votes past `FOLD_BYTES` of payload, are folded into one accumulator chunk by chunk. The
same bits either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from training.codecs import host as codecs
from training.merge import stream as merge_stream
from training.protocol.fragments import is_embedding

# Votes a Combiner holds before folding them (their payloads' bytes): beyond it they are folded
# into the accumulators and let go (the same bits, one more pass over the accumulators).
FOLD_BYTES = 4 * 2**30


class Combiner:
    """Folds weighted votes into one update for a fragment, tensor by tensor, in float32.

    RDA (arXiv 2604.21428) over the non-embedding tensors taken together as one vector:
    `(sum w |v| / sum w) * unit(sum w unit(v))`; the weighted mean for embedding tensors (and
    for everything when rda=False). One accumulator per tensor; a vote (a dict of arrays, or a
    training/merge_stream.Vote read chunk by chunk) is folded in once.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        rda: bool,
        arena: merge_stream.Arena | None = None,
    ):
        self.rda = rda
        self.shapes = dict(shapes)
        # the accumulators (made when a fold first writes them: a lazy finish never does):
        # views of `arena`, reused merge after merge (no fragment-sized allocation, no page
        # faults), else new arrays
        arena = arena or merge_stream.Arena()
        self._arena, self._acc = arena, None
        self.body = [n for n in shapes if rda and not is_embedding(n)]
        self.total_weight = 0.0
        self.norm_sum = 0.0  # sum w |v_body|
        self.votes = 0
        self.scratch = arena.scratch  # one chunk, shared with the merger's reads
        # votes added but not yet folded: (vote, its coefficient per tensor), folded together
        # chunk by chunk (`_fold`) when finish() is called or they hold FOLD_BYTES of payload
        self._pending: list[tuple[merge_stream.Vote, dict[str, np.float32]]] = []
        self._pending_bytes = 0
        self._folded = 0  # votes already in the accumulators

    @property
    def acc(self) -> dict[str, np.ndarray]:
        if self._acc is None:
            self._acc = self._arena.tensors(self.shapes)
        return self._acc

    def add(self, vote: Any, weight: float, scale: float = 1.0, body_sq: float | None = None):
        """Fold one island's vote (scaled by `scale`, e.g. a clip) with `weight`; `body_sq`:
        the vote's squared body norm if already known (merge_stream.sq_norms). The fold itself
        waits for the next votes (`_fold`: one pass over the accumulators for all of them)."""
        if weight <= 0:
            raise ValueError(f"vote weight must be positive, got {weight}")
        if not isinstance(vote, merge_stream.Vote):
            vote = merge_stream.DenseVote(vote)
        if body_sq is None:
            body_sq = merge_stream.sq_norms(vote, self.shapes, self.body, self.scratch)[1]
        body_norm = math.sqrt(body_sq) * scale
        direction = np.float32(weight * scale / body_norm) if body_norm > 0 else np.float32(0)
        mean = np.float32(weight * scale)
        body = set(self.body)
        self._pending.append((vote, {n: direction if n in body else mean for n in self.shapes}))
        self._pending_bytes += vote.nbytes
        if self._pending_bytes > FOLD_BYTES:
            self._fold(sums=False)
        self.total_weight += weight
        self.norm_sum += weight * body_norm
        self.votes += 1

    def finish(self, lazy: bool = False) -> tuple[dict[str, Any], dict[str, list[np.float32]]]:
        """(accumulators, per-tensor gains): the combined update is acc[n] x gains[n]
        (outer_step_ applies them chunk by chunk; the Combiner is spent). `lazy`: where every
        vote is quantized and none was folded yet, the accumulators are kernels.Folded (the
        votes to fold, recomputed by the outer step's pass, never written: no fragment-sized
        accumulator), the body's norm from their per-chunk sums; the same bits."""
        if not self.votes:
            raise ValueError("no votes to combine")
        inv = np.float32(1.0 / self.total_weight)
        body = set(self.body)
        folded = self._lazy() if lazy else None
        if folded is not None:
            acc: dict[str, Any] = folded
            body_sq = {n: folded[n].sums(codecs.chunk_step()) for n in self.body}
            self._folded += len(self._pending)
            self._pending, self._pending_bytes = [], 0
        else:
            body_sq = self._fold(sums=bool(body))
            acc = self.acc
        gains = {n: [inv] for n in self.shapes if n not in body}
        if body:
            # the body accumulators' norm from the sums the last fold took of each chunk
            direction_norm = math.sqrt(merge_stream.sq_total(body_sq, self.body))
            target = self.norm_sum / self.total_weight
            factor = np.float32(target / direction_norm) if direction_norm > 0 else np.float32(0)
            gains.update({n: [factor] for n in self.body})
        return acc, gains

    def _lazy(self) -> dict[str, Any] | None:
        """Every tensor's pending votes as a kernels.Folded, or None (a vote already folded, or
        one the C loops do not take: then `_fold` writes the accumulators)."""
        if self._folded or not self._pending:
            return None
        out = {}
        for n, shape in self.shapes.items():
            votes = [(vote, coefs[n]) for vote, coefs in self._pending]
            got = merge_stream.folded(votes, n, math.prod(shape))
            if got is None:
                return None
            out[n] = got
        return out

    def _fold(self, sums: bool) -> dict[str, list[float]]:
        """Fold the pending votes into the accumulators, tensor by tensor, chunk by chunk, every
        vote into a chunk before the next chunk (merge_stream.fold_votes): element by element
        the operations of folding them one after another, in one pass over the accumulators;
        returns, with `sums`, the body tensors' per-chunk sums of squares after it."""
        out: dict[str, list[float]] = {}
        if self._pending:
            for n in self.shapes:
                got = merge_stream.fold_votes(
                    [(vote, coefs[n]) for vote, coefs in self._pending],
                    n,
                    self.acc[n].reshape(-1),
                    self._folded == 0,
                    self.scratch,
                    sums and n in self.body,
                )
                if got is not None:
                    out[n] = got
            self._folded += len(self._pending)
            self._pending, self._pending_bytes = [], 0
        elif sums:  # nothing pending (a fold at FOLD_BYTES took the last vote): a pass
            out = merge_stream.chunk_sq_of(self.acc, self.body)
        return out

    def result(self) -> dict[str, np.ndarray]:
        """The combined update (in place in the accumulators: the Combiner is spent)."""
        acc, gains = self.finish()
        for n, factors in gains.items():
            for f in factors:
                acc[n] *= f
        return acc
