"""Large payloads written with O_DIRECT on a local file system (training/store/local.py).

A file:// store writes a merge's broadcast update (hundreds of MB) into a new file every
merge. Written buffered, it goes through fresh page-cache pages, and where new pages are slow
to come by (the CI box: a VM whose host takes freed memory back) that costs 0.83 s for 262 MB
against 0.19 s written direct (docs/BENCHMARKS.md "Merge at the real size"). `write_file`
copies the parts into a page-aligned stretch (an anonymous mmap of DIRECT_STRETCH bytes) and
writes each full stretch straight to the device, the last one padded to DIRECT_ALIGN and the
file cut back to its size, then fsyncs; a file system that refuses direct I/O (EINVAL at the
open or at a write: tmpfs before Linux 6.6, some FUSE and network file systems) gets False
and nothing left behind, and the caller writes the file buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Payloads of this size and more are written with O_DIRECT (`write_file`),
# through page-aligned stretches of DIRECT_STRETCH bytes; DIRECT_ALIGN: the alignment asked of
# buffers, lengths and offsets (4 KiB covers every device block size Linux direct I/O meets).
DIRECT_MIN_BYTES = 64 << 20
DIRECT_STRETCH = 8 << 20
DIRECT_ALIGN = 4096


def _write_all(fd: int, view: memoryview) -> None:
    """os.write until all of `view` is written (a direct write that stops short of the
    alignment is refused: EINVAL, so the caller writes the file buffered)."""
    while view:
        n = os.write(fd, view)
        if n % DIRECT_ALIGN and n < len(view):
            raise OSError(errno.EINVAL, "a short direct write off the alignment")
        view = view[n:]


class _DirectBuffer:
    """One page-aligned stretch (an anonymous mmap) that parts are copied into for O_DIRECT:
    `take(view)` copies what fits and says how much, `flush()` hands the stretch out (padded
    with zeros to DIRECT_ALIGN when `pad`) and starts the next; `total` counts the bytes."""

    def __enter__(self) -> _DirectBuffer:
        self._map = mmap.mmap(-1, DIRECT_STRETCH)
        self._view = memoryview(self._map)
        self.pending = 0
        self.total = 0
        return self

    def __exit__(self, *exc) -> None:
        self._view.release()
        self._map.close()

    @property
    def full(self) -> bool:
        return self.pending == DIRECT_STRETCH

    def take(self, view: memoryview) -> int:
        n = min(len(view), DIRECT_STRETCH - self.pending)
        self._view[self.pending : self.pending + n] = view[:n]
        self.pending += n
        self.total += n
        return n

    def flush(self, pad: bool = False) -> memoryview:
        n = self.pending
        if pad:
            end = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
            self._view[n:end] = bytes(end - n)
            n = end
        self.pending = 0
        return self._view[:n]


def write_file(temp: Path, parts: Sequence[Any]) -> bool:
    """Create `temp` (it must not exist) holding the concatenation of `parts`, written with
    O_DIRECT and fsynced: True; False where the file system refuses direct I/O (`temp` not
    left behind). Other OSErrors propagate (`temp` not left behind)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    ok = False
    try:
        with _DirectBuffer() as stage:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[stage.take(view) :]
                    if stage.full:
                        _write_all(fd, stage.flush())
            if stage.pending:
                _write_all(fd, stage.flush(pad=True))
            os.ftruncate(fd, stage.total)
        os.fsync(fd)
        ok = True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False  # an alignment the device wants and we do not meet: buffered
    finally:
        os.close(fd)
        if not ok:
            temp.unlink(missing_ok=True)
    return True
