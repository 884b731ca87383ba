"""CRC-32C of payloads in C (training/store/crc.c): google_crc32c.extend's value, two to five
times its speed on buffers of 1 MiB and more (three chains of the crc32 instruction at once).

`crc32c(crc, data)` is google_crc32c.extend(crc, data), or None where the C file is not loaded
(training/store/clib.py: no C compiler, a failed build, `DILOCO_NATIVE=0`) or was built
without SSE4.2 (its plain C loop is slower than google_crc32c); `Checksum`
(training/store/tensors.py) then runs google_crc32c, the same value. A call here costs about
2.5 us, so `Checksum` hands it only parts of `MIN_BYTES` or more.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from training.store import clib

SOURCE = Path(__file__).with_name("crc.c")
MIN_BYTES = 1 << 18
"""Below 128-256 KiB google_crc32c is as fast or faster (it too runs three chains on buffers in
cache, without the 2.5 us of a call here); above, its speed falls to 5-8 GB/s and this one's
stays at 12-25 (measured on the CI box, 2026-12-05: 64 KiB 15.4 against 12.6 GB/s, 256 KiB
13.6 against 21.5, 1 MiB 11.5 against 25.9; on 2 GiB of params 0.31 against 0.15 s)."""


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    u32, i64, vp = ctypes.c_uint32, ctypes.c_int64, ctypes.c_void_p
    for name in ("crc32c_extend", "crc32c_extend_portable"):
        getattr(lib, name).argtypes = [u32, vp, i64]
        getattr(lib, name).restype = u32
    lib.crc32c_hardware.argtypes = []
    lib.crc32c_hardware.restype = ctypes.c_int
    lib.crc32c_init.argtypes = []
    lib.crc32c_init.restype = None
    lib.crc32c_init()  # its tables, once, under the Library's lock (no thread races to build them)
    return lib


_library = clib.Library(SOURCE, _load)


def library() -> ctypes.CDLL | None:
    """The loaded C file, or None (the module docstring); decided once per process."""
    return _library()


def _bytes(data: Any) -> np.ndarray:
    """A uint8 view (no copy) of a bytes-like object or a C-contiguous array, read-only ones
    included."""
    view = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if not view.flags.c_contiguous:
        raise ValueError("crc32c needs a contiguous buffer")
    return view.reshape(-1).view(np.uint8)


def crc32c(crc: int, data: Any) -> int | None:
    """google_crc32c.extend(crc, data) for `data` bytes-like or a C-contiguous array (else
    ValueError), or None where the C file is not loaded or has no hardware CRC (the module
    docstring)."""
    view = _bytes(data)
    lib = library()
    if lib is None or not lib.crc32c_hardware():
        return None
    return lib.crc32c_extend(crc, view.ctypes.data, view.size)


def crc32c_portable(crc: int, data: Any) -> int | None:
    """The same value from the C file's plain C loop (what a build without SSE4.2 runs; for
    the tests), or None where the C file is not loaded."""
    view = _bytes(data)
    lib = library()
    if lib is None:
        return None
    return lib.crc32c_extend_portable(crc, view.ctypes.data, view.size)
