"""Streaming reads of a prepared corpus (`diloco prepare`): token windows fetched on demand.

    corpus = open_prepared("gs://b/corpus/", eval_fraction=0.05)   # reads index.json only
    loader = StreamingLoader(shard_tokens(corpus.train, 0, 4), 8, 128, seed=0)
    x, y = loader.next_batch()

`LazyTokens` is a virtual 1-D token array over the shards: `len`, step-1 slices (a view, no
read) and integer-array indexing (the ranged reads of exactly the tokens asked for). The split
rule is the in-memory path's for token arrays (`_load_arrays`): each shard's last
`round(tokens * eval_fraction)` tokens are held out, so `corpus.train` / `corpus.eval` are the
same streams `load_corpus(".../tokens/")` builds in memory, and `BatchLoader` (cursor included)
gives the same batches token for token. Local files are read with `os.pread` on open file
descriptors, other URLs with fsspec ranged reads (`cat_ranges`, concurrent for gcsfs). Plain
reads rather than `mmap`: a mapped file's touched pages count in the island's RSS and grow with
the part of the corpus visited, while pread's buffers are freed after each batch (the kernel's
page cache still serves repeats).

`StreamingLoader` is `BatchLoader` with read-ahead: a background thread fetches the next
`read_ahead` batches while the current one trains. The memory it holds is at most
`read_ahead + 1` batches of `batch_size * (seq_len + 1)` int32 tokens plus the per-shard offsets and
the epoch's window permutation (4-8 bytes per window) - independent of the corpus size in
bytes read; `bytes_held` / `peak_bytes_held` count it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
from dataclasses import dataclass

import fsspec
import numpy as np

from training.data.batches import BatchLoader, Corpus, fingerprint

INDEX = "index.json"
FORMAT = "diloco-prepared-corpus"
MAX_INDEX_BYTES = 64 << 20
_WIRE = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def read_index(url: str) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    """(filesystem, root, index) of the prepared corpus at `url`; a clear error if it is not one."""
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    path = f"{root}/{INDEX}"
    if not fs.exists(path):
        raise ValueError(
            f"{url}: no {INDEX} (not a prepared corpus, or `diloco prepare` unfinished)"
        )
    with fs.open(path, "rb") as f:
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise ValueError(f"{url}: {INDEX} is over {MAX_INDEX_BYTES} bytes")
    try:
        index = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{url}: {INDEX} is not JSON: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{url}: {INDEX} is not a {FORMAT} index")
    if index.get("dtype") not in _WIRE:
        raise ValueError(
            f"{url}: {INDEX} dtype must be uint16 or uint32, got {index.get('dtype')!r}"
        )
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise ValueError(f"{url}: {INDEX} lists no shards")
    for s in shards:
        name, n = (s.get("shard"), s.get("tokens")) if isinstance(s, dict) else (None, None)
        bad_name = not isinstance(name, str) or ".." in name or not name.startswith("tokens/")
        if bad_name or not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{url}: {INDEX} has a malformed shard entry {s!r}")
    return fs, root, index


class _Reader:
    """Ranged reads of whole-file byte ranges: pread for local files, fsspec otherwise."""

    def __init__(self, fs: fsspec.AbstractFileSystem, paths: list[str]):
        self.fs = fs
        self.paths = paths
        self.local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def _fd(self, i: int) -> int:
        with self._lock:
            if i not in self._fds:
                self._fds[i] = os.open(self.paths[i], os.O_RDONLY)
            return self._fds[i]

    def read(self, ranges: list[tuple[int, int, int]]) -> list[bytes]:
        """Bytes of each (file number, start, end)."""
        if self.local:
            out = []
            for i, lo, hi in ranges:
                data = os.pread(self._fd(i), hi - lo, lo)
                if len(data) != hi - lo:
                    raise ValueError(f"{self.paths[i]}: short read at {lo} (file truncated?)")
                out.append(data)
            return out
        out = self.fs.cat_ranges(
            [self.paths[i] for i, _, _ in ranges],
            [lo for _, lo, _ in ranges],
            [hi for _, _, hi in ranges],
        )
        for (i, lo, hi), data in zip(ranges, out, strict=True):
            if isinstance(data, Exception) or len(data) != hi - lo:
                raise ValueError(f"{self.paths[i]}: short or failed read at {lo}: {data!r:.200}")
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class LazyTokens:
    """A read-on-demand 1-D token array: the concatenation of (file, first token, count) pieces."""

    def __init__(self, reader: _Reader, wire: np.dtype, pieces: list[tuple[int, int, int]]):
        self.reader = reader
        self.wire = wire
        self.dtype = wire.newbyteorder("=")
        self.pieces = [p for p in pieces if p[2] > 0]
        self._ends = np.cumsum([n for _, _, n in self.pieces], dtype=np.int64)
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _view(self, lo: int, hi: int) -> LazyTokens:
        pieces, start = [], 0
        for (f, first, _n), end in zip(self.pieces, self._ends.tolist(), strict=True):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                pieces.append((f, first + a - start, b - a))
            start = end
        return LazyTokens(self.reader, self.wire, pieces)

    def _runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(file, byte start, byte end) pieces of virtual tokens [lo, hi)."""
        k = int(np.searchsorted(self._ends, lo, side="right"))
        out, size = [], self.wire.itemsize
        while lo < hi:
            f, first, n = self.pieces[k]
            start = int(self._ends[k]) - n
            take = min(hi, start + n) - lo
            off = first + lo - start
            out.append((f, off * size, (off + take) * size))
            lo += take
            k += 1
        return out

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) as a new array."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"token range [{lo}, {hi}) outside 0..{len(self)}")
        runs = self._runs(lo, hi)
        data = b"".join(self.reader.read(runs)) if runs else b""
        self.bytes_read += len(data)
        return np.frombuffer(data, dtype=self.wire).astype(self.dtype)

    def gather(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Rows tokens[s : s + width] for each s in `starts`, one ranged read per row piece."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + width > len(self)):
            raise IndexError(f"window outside 0..{len(self)}")
        runs = []
        for s in starts.tolist():
            runs += self._runs(s, s + width)
        data = b"".join(self.reader.read(runs)) if runs else b""
        self.bytes_read += len(data)
        flat = np.frombuffer(data, dtype=self.wire).astype(self.dtype)
        return flat.reshape(len(starts), width)

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("LazyTokens slices must have step 1")
            return self._view(lo, max(lo, hi))
        idx = np.asarray(key)
        if idx.ndim == 2 and idx.shape[1] > 0 and idx.size:
            width = idx.shape[1]
            rows = idx[:, :1] + np.arange(width)
            if np.array_equal(rows, idx):  # contiguous windows (BatchLoader / eval_batches)
                return self.gather(idx[:, 0], width)
        if idx.dtype.kind in "iu":
            flat = idx.reshape(-1)
            out = np.empty(flat.size, dtype=self.dtype)
            for j, t in enumerate(flat.tolist()):
                out[j] = self.read(t, t + 1)[0]
            return out.reshape(idx.shape)
        raise TypeError(f"unsupported LazyTokens index {type(key).__name__}")

    def __array__(self, dtype=None, copy=None):
        arr = self.read(0, len(self))
        return arr if dtype is None else arr.astype(dtype)


def is_prepared(url: str) -> bool:
    """Whether `url` is a directory holding a prepared corpus's index.json."""
    try:
        fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
        return fs.isfile(f"{root}/{INDEX}")
    except (OSError, ValueError):
        return False


def open_prepared(
    url: str, eval_fraction: float = 0.05, vocab_size: int | None = None, tokenizer_sha256=None
) -> Corpus:
    """The prepared corpus at `url` as a `Corpus` of `LazyTokens` (reads index.json only).

    The train/eval split and the fingerprint are those of `load_corpus(url + "/tokens/")`.
    Tokens are checked against `vocab_size` through the index's tokenizer (a larger one is a
    one-line error), and against `tokenizer_sha256` when given (shards of another tokenizer).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    fs, root, index = read_index(url)
    size = _vocab(index)
    if vocab_size is not None and size > vocab_size:
        raise ValueError(
            f"{url}: prepared with a {size}-token vocabulary > vocab_size {vocab_size}"
        )
    sha = (index.get("tokenizer") or {}).get("sha256")
    if tokenizer_sha256 is not None and sha != tokenizer_sha256:
        raise ValueError(
            f"{url}: prepared with tokenizer {str(sha)[:12]}, the experiment's is "
            f"{tokenizer_sha256[:12]} (prepare it again with the experiment's tokenizer)"
        )
    wire = _WIRE[index["dtype"]]
    shards = index["shards"]
    paths = [f"{root}/{s['shard']}" for s in shards]
    reader = _Reader(fs, paths)
    train, held = [], []
    for i, s in enumerate(shards):
        n = s["tokens"]
        cut = n - int(round(n * eval_fraction))
        train.append((i, 0, cut))
        held.append((i, cut, n - cut))
    train_tokens = LazyTokens(reader, wire, train)
    eval_tokens = LazyTokens(reader, wire, held)
    return Corpus(
        train=train_tokens,
        eval=eval_tokens,
        vocab_size=vocab_size if vocab_size is not None else size,
        source=url,
        fingerprint=fingerprint(train_tokens),
        train_documents=len(shards),
        eval_documents=len(shards) if len(eval_tokens) else 0,
    )


def _vocab(index: dict) -> int:
    tok = index.get("tokenizer")
    size = tok.get("vocab_size") if isinstance(tok, dict) else None
    if not isinstance(size, int) or size < 1:
        raise ValueError("prepared index has no tokenizer vocab_size; pass vocab_size")
    return size


@dataclass
class _Pending:
    epoch: int
    position: int
    future: cf.Future


class StreamingLoader(BatchLoader):
    """`BatchLoader` over `LazyTokens` with `read_ahead` batches fetched in the background.

    Same batches and cursor as `BatchLoader`; `bytes_held` counts the token bytes held in
    fetched batches, int32 (the one handed out last included), `peak_bytes_held` its maximum.
    """

    def __init__(self, tokens, batch_size, seq_len, seed, cursor=None, read_ahead: int = 2):
        super().__init__(tokens, batch_size, seq_len, seed, cursor)
        if read_ahead < 0:
            raise ValueError(f"read_ahead must be >= 0, got {read_ahead}")
        self.read_ahead = read_ahead
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="data-read-ahead")
        self._queue: list[_Pending] = []
        self._orders: dict = {}
        self._held = 0
        self._held_lock = threading.Lock()
        self._last = 0
        self.peak_bytes_held = 0
        self._next = (self.epoch, self.position)

    @property
    def bytes_held(self) -> int:
        return self._held

    def _advance(self, epoch: int, position: int) -> tuple[int, int]:
        return (epoch + 1, 0) if position >= self.batches_per_epoch else (epoch, position)

    def _fetch(self, epoch: int, position: int):
        if self._orders.get("epoch") != epoch:  # only this thread touches _orders
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {"epoch": epoch, "order": rng.permutation(self.num_windows)}
        order = self._orders["order"]
        windows = order[position * self.batch_size : (position + 1) * self.batch_size]
        rows = self.tokens.gather(windows * self.seq_len, self.seq_len + 1).astype(np.int32)
        with self._held_lock:
            self._held += rows.nbytes
            self.peak_bytes_held = max(self.peak_bytes_held, self._held)
        return rows

    def _fill(self, depth: int) -> None:
        while len(self._queue) < depth:
            epoch, position = self._advance(*self._next)
            self._queue.append(
                _Pending(epoch, position, self._pool.submit(self._fetch, epoch, position))
            )
            self._next = (epoch, position + 1)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        with self._held_lock:
            self._held -= self._last
            self._last = 0
        self._fill(max(1, self.read_ahead))
        pending = self._queue.pop(0)
        rows = pending.future.result()
        self.epoch, self.position = pending.epoch, pending.position + 1
        self._last = rows.nbytes
        self._fill(self.read_ahead)
        return rows[:, :-1], rows[:, 1:]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
