"""Read buffers kept from one merge to the next (`BufferPool`).

A merge reads each contribution's payload into memory (training/store/local.py and
gcs_reads.py `read_buffer`). A new buffer per read costs its page faults on every merge (and on
a VM that hands freed memory back to its host, the host's faults too: about 1.4 s per GiB
measured here, docs/BENCHMARKS.md "Merge at the real size"); a merger instead takes its
buffers from a pool and gives them all back when the merge is over, so that from the second
merge on its reads land in memory already mapped.

`take(n)` hands out a writable buffer of exactly n bytes, a view of the smallest free pooled
array that holds it (or of a new one); `release_all()` makes every array free again: the
caller guarantees that nothing read into them is used after (the merger releases between
merges, after its downloads have stopped).
"""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._used: list[np.ndarray] = []
        self._lock = threading.Lock()  # reads run on the merge's fetch threads

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            # by index, never by `==` (numpy compares arrays element-wise)
            fits = [i for i, a in enumerate(self._free) if a.size >= nbytes]
            if fits:
                array = self._free.pop(min(fits, key=lambda i: self._free[i].size))
            else:
                array = np.empty(max(nbytes, 1), np.uint8)
            self._used.append(array)
        return memoryview(array)[:nbytes]

    def release_all(self) -> None:
        with self._lock:
            self._free += self._used
            self._used = []

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._free + self._used)
