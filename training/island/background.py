"""A FIFO of jobs run by one background thread, or inline: the island's store I/O off its steps.

The island hands its uploads (pseudo-gradients, heartbeats, budget and stop checks) to one
`Background` and its checkpoint writes to another. Jobs of one `Background` run one at a time
in submission order, so a pseudo-gradient's marker is never committed before an earlier one's
of the same island. With `threaded=False` every job runs inside `submit` (the in-process
simulators and most tests: deterministic, and errors raise where they happen). A job that
fails in the thread is re-raised by the next `submit`, `check` or `drain` in the island's own
thread: a failure is never lost, only reported a little later.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Background:
    def __init__(self, name: str, threaded: bool):
        self.name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None
        self._last: Future | None = None
        self._error: BaseException | None = None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` after every job submitted before; returns its future."""
        self.check()
        if self._pool is None:
            future: Future = Future()
            future.set_result(fn(*args))  # raises here, in the caller's thread
        else:
            future = self._pool.submit(fn, *args)
            future.add_done_callback(self._note)
        self._last = future
        return future

    def _note(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None and self._error is None:
            self._error = future.exception()

    def check(self) -> None:
        """Re-raise the first error of a job that ran in the thread."""
        if self._error is not None:
            raise self._error

    def last(self) -> Future | None:
        """The future of the last job submitted (done when every job before it is)."""
        return self._last

    def drain(self) -> None:
        """Wait for every submitted job; re-raise the first error."""
        if self._last is not None:
            self._last.exception()  # waits
        self.check()

    def close(self) -> None:
        """Stop the thread after the jobs already submitted."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
