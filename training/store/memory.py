"""memory://name: objects in a process-wide dict (tests and the virtual-clock benchmarks)."""

from __future__ import annotations

import threading

from training.store.objectstore import (
    Generation,
    ObjectNotFound,
    ObjectStore,
    _check_limit,
    _too_large,
    validate_key,
    validate_prefix,
)


class _MemoryBucket:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.counter = 0

    def next_generation(self) -> int:
        self.counter += 1
        return self.counter


_MEMORY_BUCKETS: dict[str, _MemoryBucket] = {}
_MEMORY_BUCKETS_LOCK = threading.Lock()


class MemoryStore(ObjectStore):
    """memory://name: a process-global dict per name guarded by a lock; for tests.

    Every store opened with the same name in one process shares the objects.
    """

    def __init__(self, name: str):
        name = name.strip("/")
        if not name:
            raise ValueError("invalid memory store URL: memory:// needs a name")
        self.name = name
        self.url = f"memory://{name}"
        with _MEMORY_BUCKETS_LOCK:
            self._bucket = _MEMORY_BUCKETS.setdefault(name, _MemoryBucket())

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        got = self.read_versioned(key, max_bytes)
        if got is None:
            raise ObjectNotFound(f"{self.url}/{key} not found")
        return got[0]

    def write(self, key: str, data: bytes) -> None:
        validate_key(key)
        with self._bucket.lock:
            self._bucket.objects[key] = (bytes(data), self._bucket.next_generation())

    def create(self, key: str, data: bytes) -> bool:
        return self.compare_and_swap_generation(key, data, None) is not None

    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        validate_key(key)
        _check_limit(max_bytes)
        with self._bucket.lock:
            got = self._bucket.objects.get(key)
        if got is not None and max_bytes is not None and len(got[0]) > max_bytes:
            raise _too_large(f"{self.url}/{key}", len(got[0]), max_bytes)
        return got

    def compare_and_swap_generation(
        self, key: str, data: bytes, expected: Generation | None
    ) -> Generation | None:
        validate_key(key)
        if isinstance(expected, str) and expected.isdigit():
            expected = int(expected)
        with self._bucket.lock:
            current = self._bucket.objects.get(key)
            current_generation = None if current is None else current[1]
            if current_generation != expected:
                return None
            generation = self._bucket.next_generation()
            self._bucket.objects[key] = (bytes(data), generation)
            return generation

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._bucket.lock:
            return key in self._bucket.objects

    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        validate_prefix(prefix)
        with self._bucket.lock:
            keys = [k for k in self._bucket.objects if k.startswith(prefix)]
        return sorted(k for k in keys if start_after is None or k > start_after)

    def sizes(self, prefix: str) -> dict[str, int]:
        validate_prefix(prefix)
        with self._bucket.lock:
            return {k: len(v[0]) for k, v in self._bucket.objects.items() if k.startswith(prefix)}

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._bucket.lock:
            self._bucket.objects.pop(key, None)

    def check(self) -> None:
        return None
