"""A merge's contribution payloads fetched concurrently, bounded, consumed in order.

The merge reads its contributions one by one in a fixed order (groups, islands sorted, seqs
ascending) and sums them in that order: the bits must not depend on which download ends first
(docs/ALGORITHM.md, "What the bits depend on"). `Prefetch` starts the downloads of the next
`syncer.fetch_concurrency` payloads of that order on its own threads while the merge decodes
and sums the current one, and hands them out in the same order: the arithmetic is that of a
serial read, only the waiting overlaps. At most `concurrency` payloads are in flight or held
beside the one being summed (the memory bound). Errors are raised to the merge when it asks
for that payload, as a serial read would raise them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Prefetch:
    """`get(key)` returns `load(item)` of the item with that key, loaded ahead in `order`."""

    def __init__(
        self, order: Sequence[tuple[str, Any]], load: Callable[[Any], Any], concurrency: int
    ):
        self._load = load
        self._todo = deque(order)
        self._ahead: deque[tuple[str, Future]] = deque()
        self._limit = max(1, concurrency)
        self._pool = (
            ThreadPoolExecutor(self._limit, thread_name_prefix="fetch") if self._limit > 1 else None
        )
        self._fill()

    def _fill(self) -> None:
        while self._pool is not None and self._todo and len(self._ahead) < self._limit:
            key, item = self._todo.popleft()
            self._ahead.append((key, self._pool.submit(self._load, item)))

    def get(self, key: str, item: Any) -> Any:
        """The payload of `key` (`item` loaded here if it is not ahead: out of order or
        concurrency 1). Downloads started for keys before it are dropped."""
        while self._ahead and self._ahead[0][0] != key:
            _, dropped = self._ahead.popleft()
            dropped.cancel()
        if not self._ahead:
            self._todo = deque(kv for kv in self._todo if kv[0] != key)
            self._fill()
            return self._load(item)
        _, future = self._ahead.popleft()
        try:
            return future.result()
        finally:
            self._fill()
            if not self._ahead and not self._todo:
                self.close()  # all handed out: the threads go

    def close(self, wait: bool = False) -> None:
        """Cancel what has not started; wait for downloads under way only if asked (before
        the buffers they read into are reused: training/store/buffers.py)."""
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        self._todo.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
