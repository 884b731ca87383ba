"""Object stores behind one small interface: local files, GCS, memory; with conditional writes.

Keys are relative '/'-separated paths under the store root (see `validate_key`). Every backend
gives: whole-object reads and writes (a reader sees the old or the new object, never a partial
one), create-only writes, compare-and-swap on an opaque generation, fresh (never cached) recursive
listings, and retries of transient errors (`retry`). docs/STORE.md shows how the experiment
layout builds on this. This module is the interface, errors, keys and retries; the backends are
training/store/local.py, memory.py and gcs.py, and `training.store.registry.open_store` picks one
by URL (the registry sits outside the interface, so no backend import cycles back here).
"""

from __future__ import annotations

import errno
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Chunk = bytes | bytearray | memoryview
"""One piece of a streamed write."""
Consume = Callable[[memoryview], None]
"""What `read_buffer` hands consecutive pieces of the buffer to, in order, as they arrive."""
Generation = int | str
"""Opaque token naming one version of one object: compare it, pass it back to compare_and_swap."""


class StoreError(Exception):
    """Base of all store errors; messages are one line."""


class ObjectNotFound(StoreError):
    """The object does not exist."""


class StoreUnreachable(StoreError):
    """The store cannot be used at all: bad bucket, missing credentials, connection refused."""


class StoreConnectionError(StoreUnreachable):
    """The store's endpoint did not answer (connection refused, timeout): maybe transient, unlike
    the other `StoreUnreachable` causes (no such bucket, no permission, no credentials)."""


class TransientStoreError(StoreError):
    """A transient failure that persisted through every retry; trying again later may work."""


class CorruptObject(StoreError):
    """An object exists but its content is invalid (bad JSON or safetensors, wrong checksum)."""


class ObjectTooLarge(CorruptObject):
    """An object is larger than its reader's `max_bytes`; refused without reading it whole."""


class ObjectChanged(CorruptObject):
    """An object read in parts was replaced (a new generation) before its last part arrived:
    nothing of it is returned, never bytes stitched from two generations."""


def _too_large(where: str, size: int | None, max_bytes: int) -> ObjectTooLarge:
    got = "more than" if size is None else f"{size} bytes,"
    return ObjectTooLarge(f"{where} is {got} over the {max_bytes}-byte limit of its reader")


def _check_limit(max_bytes: int | None) -> None:
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
    ):
        raise ValueError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")


# ---------------------------------------------------------------------------------------------
# Keys


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative key, else raise ValueError.

    Rejected: empty keys, absolute keys, backslashes, control characters, empty segments
    ('a//b', trailing '/'), and segments starting with '.' ('.', '..', '.hidden': reserved for
    store internals such as temp files and generation sidecars). So no key can address anything
    outside the root.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid key {key!r}: empty")
    if key.startswith("/"):
        raise ValueError(f"invalid key {key!r}: absolute")
    if "\\" in key:
        raise ValueError(f"invalid key {key!r}: contains a backslash")
    if any(ord(c) < 0x20 or c == "\x7f" for c in key):
        raise ValueError(f"invalid key {key!r}: contains a control character")
    for segment in key.split("/"):
        if not segment:
            raise ValueError(f"invalid key {key!r}: empty path segment")
        if segment in (".", ".."):
            raise ValueError(f"invalid key {key!r}: contains a {segment!r} segment")
        if segment.startswith("."):
            raise ValueError(f"invalid key {key!r}: segments starting with '.' are reserved")
    return key


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it is "" or a valid key, optionally ending in '/'; else ValueError."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


# ---------------------------------------------------------------------------------------------
# Retries

_TRANSIENT_TYPES: list[type[BaseException]] = [TransientStoreError, ConnectionError, TimeoutError]


def register_transient(*types: type[BaseException]) -> None:
    """Add a backend's transient error types (the GCS backend registers its client's 429/5xx,
    connection and timeout errors when it is imported): `is_transient` stays one rule."""
    _TRANSIENT_TYPES.extend(t for t in types if t not in _TRANSIENT_TYPES)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: 429/500/502/503/504, connection errors, timeouts, EAGAIN."""
    if isinstance(exc, tuple(_TRANSIENT_TYPES)):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def retry(
    fn: Callable[[], T],
    attempts: int = 5,
    base: float = 0.2,
    cap: float = 5.0,
    *,
    transient: Callable[[BaseException], bool] = is_transient,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call `fn()`; retry transient errors with exponential backoff and full jitter.

    Attempt i (from 0) that fails transiently sleeps uniform(0, min(cap, base * 2**i)) seconds.
    Non-transient errors propagate at once, unchanged. When every attempt failed transiently,
    raises TransientStoreError chained to the last error. `fn` must be safe to repeat.
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if not transient(exc):
                raise
            if attempt == attempts - 1:
                raise TransientStoreError(
                    f"gave up after {attempts} attempts: {one_line(exc)}"
                ) from exc
            delay = random.uniform(0.0, min(cap, base * 2**attempt))
            log.info("transient store error (attempt %d/%d): %s", attempt + 1, attempts, exc)
            sleep(delay)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Interface


class ObjectStore(ABC):
    """A flat namespace of immutable-per-version objects under a root URL.

    Contract shared by every backend:
    - `read`/`write` move whole objects; readers see the old or the new object, never a partial one.
    - `read` and `read_versioned` take `max_bytes`: an object larger than that raises
      ObjectTooLarge, having read at most max_bytes + 1 of its bytes (none where the backend
      knows the size first), so no reader holds more memory than it asked for.
    - `create` and `compare_and_swap` are atomic: of two racing writers at most one succeeds.
    - `list` is fresh (reflects every completed write and delete) and sorted.
    - Generations are opaque; every successful write/create/CAS gives the object a new one, and a
      generation is never reused for the same key (not even after delete and re-create).
    """

    url: str

    @abstractmethod
    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; ObjectNotFound if absent, ObjectTooLarge over `max_bytes`."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Create or overwrite the object."""

    def write_parts(self, key: str, parts: Sequence[Any]) -> None:
        """`write` of the concatenation of `parts` (bytes-like objects); a backend that can
        stream them (file://) never builds the whole object in memory."""
        self.write(key, b"".join(memoryview(p).cast("B") for p in parts))

    def read_buffer(
        self,
        key: str,
        max_bytes: int | None = None,
        writable: bool = True,
        consume: Consume | None = None,
        into: Callable[[int], memoryview] | None = None,
    ) -> memoryview:
        """`read` into a buffer, writable if asked: arrays decoded from it without a copy are
        then writable (file:// reads straight into a writable buffer; gs:// reads a small
        object in one GET and a large one in parallel ranges straight into one buffer; other
        backends copy the bytes once for a writable one, never for a read-only one).

        `consume`, if given, is called with consecutive pieces of the returned buffer, in
        order, covering it exactly once, before this returns: a checksum over them overlaps
        the rest of the download where the backend reads in parts (gs://), and is one call
        with the whole buffer elsewhere. If the read raises, what was consumed is void.

        `into(n)`, if given, returns the writable buffer of n bytes to read into (a pool:
        training/store/buffers.py) where the backend reads into a buffer of its own (file://,
        gs:// in parts); elsewhere it is not used."""
        data = self.read(key, max_bytes)
        view = memoryview(bytearray(data)) if writable else memoryview(data)
        if consume is not None:
            consume(view)
        return view

    def write_stream(self, key: str, chunks: Callable[[], Iterable[Chunk]]) -> None:
        """Create or overwrite the object with the concatenation of `chunks()`, streamed: the
        backend never holds the whole object (LocalStore writes a temp file chunk by chunk,
        GCSStore a resumable upload; this default joins them, for backends that hold whole
        objects anyway). `chunks` is a factory: a retried attempt calls it again and streams
        from the start, so the object is all of one attempt's bytes or absent/unchanged, as
        with `write`. The chunks may be any bytes-like objects (memoryviews of arrays)."""
        self.write(key, b"".join(bytes(c) for c in chunks()))

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write only if the key is absent (atomic). True if written, False if it already existed.

        After a retried attempt whose first try may have landed, an existing object with exactly
        `data` counts as created (True): the content is there either way.
        """

    @abstractmethod
    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        """The object's bytes and generation (consistent with each other), or None if absent;
        ObjectTooLarge over `max_bytes`."""

    @abstractmethod
    def compare_and_swap_generation(
        self, key: str, data: bytes, expected: Generation | None
    ) -> Generation | None:
        """Write `data` only if the object's generation is `expected` (None: the key must be
        absent). Returns the new generation, or None if the precondition failed."""

    def compare_and_swap(self, key: str, data: bytes, expected: Generation | None) -> bool:
        """Write `data` only if the generation is `expected` (None: absent). True if written.

        Of several writers racing from the same `expected`, exactly one gets True.
        """
        return self.compare_and_swap_generation(key, data, expected) is not None

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    @abstractmethod
    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        """Keys starting with `prefix` (a plain string prefix, recursive), sorted; never cached.

        `start_after` (a full key): only keys sorting after it. On GCS this is a server-side
        `start_offset`, so a poller that remembers where it stopped never re-lists the history.
        """

    def sizes(self, prefix: str) -> dict[str, int]:
        """Key -> size in bytes of every object under `prefix` (as `list`). This default
        reads each object; the backends answer from their listing or file metadata."""
        return {k: len(self.read(k)) for k in self.list(prefix)}

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing object is fine."""

    @abstractmethod
    def check(self) -> None:
        """Fast reachability / credentials check; raises StoreUnreachable with the reason."""

    def remove_empty_dir(self, prefix: str) -> bool:
        """Drop what directory `prefix` (ending in '/') leaves once its objects are deleted,
        for a directory whose name is never used again (a checkpoint's, a version's: random
        suffixes). Stores without directories have nothing to drop: False."""
        return False

    def drop_abandoned_writes(self, prefix: str) -> int:
        """Remove what writers that died left under directory `prefix` (ending in '/'): the
        temp files of writes that never committed, then the subdirectories that leaves empty.
        Only for a prefix nobody is writing under now (the caller's promise: an island at its
        start, for its own checkpoints). Stores whose writes appear whole or not at all (GCS,
        memory) leave nothing behind: 0. Returns the temp files removed."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
