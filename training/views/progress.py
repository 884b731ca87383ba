"""A progress line on stderr for long CLI commands, only where a person watches (a TTY).

    with Progress("report", total=3) as bar:
        bar.step("reading the store")   # [1/3] report: reading the store  0.4s
        ...

Redrawn in place (carriage return); erased when done, so the command's own output stays clean.
Nothing is written when the stream is not a TTY (pipes, logs, tests): no new dependency, no
noise in CI.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A one-line progress display: `step(label)` moves to the next of `total` steps."""

    def __init__(self, title: str, total: int, stream: TextIO | None = None, width: int = 20):
        self.title, self.total, self.width = title, max(1, total), width
        self.stream = sys.stderr if stream is None else stream
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self.started, self.shown = 0, time.monotonic(), 0

    def line(self, label: str) -> str:
        """The text of the line after `self.done` of `self.total` steps."""
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        return f"[{bar}] {self.done}/{self.total} {self.title}: {label}  {elapsed:.0f}s"

    def step(self, label: str) -> None:
        self.done = min(self.total, self.done + 1)
        self._draw(self.line(label))

    def _draw(self, text: str) -> None:
        if not self.on:
            return
        pad = max(0, self.shown - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self.shown = len(text)

    def close(self) -> None:
        if self.on and self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
        self.shown = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
