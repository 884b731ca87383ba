"""A loaded corpus and the batches cut from it, whatever the tokens' source: `Corpus` (train /
eval tokens and their fingerprint), island shards, resumable `BatchLoader`, fixed eval batches.

The tokens are any 1-D token array: in memory (`load_corpus`, training/data/corpus.py) or
streamed from a prepared corpus (`LazyTokens`, training/data/stream.py, whose `StreamingLoader`
is a `BatchLoader` with read-ahead).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

CURSOR_VERSION = 1
_FINGERPRINT_SPAN = 1 << 20


@dataclass(frozen=True)
class Corpus:
    """Train / eval token streams of one source."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int
    source: str
    fingerprint: str
    train_documents: int = 0
    eval_documents: int = 0


def fingerprint(tokens: np.ndarray) -> str:
    """Short sha256 of the token count and the first and last 1M tokens (dtype-independent)."""
    h = hashlib.sha256()
    h.update(f"n={len(tokens)};".encode())
    h.update(np.ascontiguousarray(tokens[:_FINGERPRINT_SPAN], dtype="<u4").tobytes())
    h.update(np.ascontiguousarray(tokens[-_FINGERPRINT_SPAN:], dtype="<u4").tobytes())
    return h.hexdigest()[:16]


def shard_tokens(train: np.ndarray, shard: int, num_shards: int) -> np.ndarray:
    """Contiguous slice `shard` of `num_shards` equal slices (the remainder is dropped)."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got shard={shard} of {num_shards}")
    size = len(train) // num_shards
    return train[shard * size : (shard + 1) * size]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


class BatchLoader:
    """Endless, resumable batches of (inputs, targets), int32 of shape (batch_size, seq_len).

    Windows of seq_len + 1 tokens start every seq_len tokens, so each token is a target once per
    epoch. Each epoch visits the windows in a permutation seeded by (seed, epoch); leftover windows
    (fewer than a batch) are skipped for that epoch. `state()` is a JSON cursor; a loader built
    with it continues with exactly the batch the original would have produced next.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        cursor: dict | None = None,
    ):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive: {batch_size}, {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        self.batches_per_epoch = self.num_windows // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"shard of {len(tokens)} tokens is too small for one batch of "
                f"{batch_size} x {seq_len + 1} tokens"
            )
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None
        if cursor is not None:
            self._restore(cursor)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _restore(self, cursor: dict) -> None:
        expected = {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
        }
        for key, value in expected.items():
            if cursor.get(key) != value:
                raise ValueError(
                    f"data cursor does not match this loader: {key}={cursor.get(key)!r}, "
                    f"expected {value!r}"
                )
        epoch, position = int(cursor["epoch"]), int(cursor["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise ValueError(f"invalid data cursor position: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position

    def state(self) -> dict:
        """JSON-serializable cursor of the next batch."""
        return {
            "version": CURSOR_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
            "tokens_seen": (self.epoch * self.batches_per_epoch + self.position)
            * self.tokens_per_batch,
        }

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.num_windows)
        return self._order

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = None
        lo = self.position * self.batch_size
        windows = self._epoch_order()[lo : lo + self.batch_size]
        self.position += 1
        return _windows(self.tokens, windows * self.seq_len, self.seq_len)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while True:
            yield self.next_batch()


def eval_batches(
    eval_tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed eval batches: up to `max_batches` batches of windows spread evenly over the eval set."""
    if batch_size < 1 or seq_len < 1 or max_batches < 1:
        raise ValueError("batch_size, seq_len and max_batches must be positive")
    num_windows = max(0, (len(eval_tokens) - 1) // seq_len)
    num_batches = min(max_batches, num_windows // batch_size)
    if num_batches == 0:
        raise ValueError(
            f"eval set of {len(eval_tokens)} tokens is too small for one batch of "
            f"{batch_size} x {seq_len + 1} tokens"
        )
    count = num_batches * batch_size
    starts = (np.arange(count) * num_windows // count) * seq_len
    return [
        _windows(eval_tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len)
        for i in range(num_batches)
    ]
