"""The C loops of training/codecs/native.c, compiled on first use and called through ctypes.

The loops: the codecs' encode and decode (training/codecs/kernels.py), the merge's outer
step (training/merge/outer.outer_step_) and the float64 sums of squares of its norms (numpy's
pairwise order, bit for bit: `chunk_sumsq` here, training/merge/stream.py). `library()`
returns the loaded library, or None when it cannot be had (training/store/clib.py builds,
caches and loads this C file as it does the store's: no C compiler, a failed build, an
unwritable cache, or `DILOCO_NATIVE=0`). Then the callers run their numpy code, which gives
the same bits (the C file's docstring says how; tests/test_native.py compares the two).
Nothing else changes: the payload format is training/codecs/host.py's either way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from training.store import clib

NATIVE_ENV = clib.NATIVE_ENV  # "0": never build or load the C loops (the numpy code runs)
SOURCE = Path(__file__).with_name("native.c")


def _load(path: Path):
    lib = ctypes.CDLL(str(path))
    i64, cint, cfloat, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.encode_quantized.argtypes = [cint, cfloat, i64, i64, vp, vp, cint, vp, vp, vp, cint]
    lib.encode_quantized.restype = cint
    lib.encode_bf16.argtypes = [i64, vp, vp, cint, vp, vp, cint]
    lib.encode_bf16.restype = cint
    lib.decode_quantized.argtypes = [cint, vp, vp, i64, i64, i64, vp, cint, cint]
    lib.decode_quantized.restype = cint
    lib.outer_step.argtypes = [i64, vp, vp, vp, vp, vp, cint, cint, cint, cint] + [cfloat] * 3
    lib.outer_step.restype = None
    lib.sumsq_chunks.argtypes = [vp, i64, i64, vp]
    lib.sumsq_chunks.restype = None
    lib.outer_step_sq.argtypes = lib.outer_step.argtypes + [i64, vp]
    lib.outer_step_sq.restype = None
    lib.outer_encode_sq.argtypes = lib.outer_step_sq.argtypes + [cint, cfloat, i64, vp, vp, vp]
    lib.outer_encode_sq.restype = i64
    lib.fold_sums.argtypes = [cint, vp, vp, vp, i64, i64, i64, i64, vp, vp]
    lib.fold_sums.restype = None
    lib.fold_outer_encode_sq.argtypes = (
        [i64, i64, cint, vp, vp, vp, i64, vp, vp, vp, vp, cint, cint, cint, cint]
        + [cfloat] * 3
        + [i64, vp, cint, cfloat, i64, vp, vp, vp]
    )
    lib.fold_outer_encode_sq.restype = i64
    lib.codes_sumsq.argtypes = [cint, vp, vp, i64, i64, i64, i64, cint, vp]
    lib.codes_sumsq.restype = i64
    lib.fold_votes.argtypes = [cint, vp, vp, vp, i64, i64, i64, i64, vp, cint, vp]
    lib.fold_votes.restype = None
    return lib


def library():
    """The loaded C library, or None (see the module docstring); decided once per process."""
    return _library()


_library = clib.Library(SOURCE, _load)


def fits(*arrays: np.ndarray | None) -> bool:
    """Every array given is C-contiguous with the dtype the C loops assume for it: float32,
    or one byte (codes), or uint16 (bfloat16 bits); None (an absent input) fits."""
    return all(
        a is None
        or (a.flags.c_contiguous and (a.dtype == np.float32 or a.dtype.itemsize in (1, 2)))
        for a in arrays
    )


def fits_float32(*arrays: np.ndarray | None) -> bool:
    """Every array given is a C-contiguous float32 array (or None: absent)."""
    return all(a is None or a.dtype == np.float32 for a in arrays) and fits(*arrays)


def address(a: np.ndarray | None) -> int | None:
    """The address of a contiguous array's first element (None: NULL); callers add byte
    offsets to it."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise ValueError("native codecs need contiguous arrays")
    return a.ctypes.data


def chunk_sumsq(x: np.ndarray, step: int) -> np.ndarray | None:
    """Per chunk of `step` elements of the flat float32 array `x` (the last one shorter), the
    float64 sum of its squares as numpy's np.add.reduce(np.square(chunk, dtype=np.float64))
    gives it, bit for bit; None when the C loops are not loaded or `x` does not fit them."""
    lib = library()
    if lib is None or not fits_float32(x):
        return None
    sums = np.empty(-(-x.size // step), np.float64)
    base = address(x)

    def run(s: int, e: int, k0: int) -> None:
        lib.sumsq_chunks(base + 4 * s, e - s, step, sums.ctypes.data + 8 * k0)

    over_chunks(x.size, step, run)
    return sums


# Threads over chunks: the C loops release the GIL (ctypes), so a tensor's chunks split into
# `threads` contiguous ranges run at once. Every result is per element or per chunk, each range
# writes its own, and sums are added in chunk order by the caller: the same bits whatever the
# thread count (tests/test_native.py). Set by the merge from `syncer.threads`.
_pool: list = [1, None]  # [threads, executor or None]


def set_threads(threads: int) -> None:
    """Run the chunked C loops on `threads` threads (1: in the calling thread)."""
    threads = max(1, int(threads))
    if threads != _pool[0]:
        if _pool[1] is not None:
            _pool[1].shutdown(wait=True)
        _pool[:] = [threads, None]


def over_chunks(n: int, step: int, run: Callable[[int, int, int], None]) -> None:
    """run(s, e, k0) for contiguous ranges [s, e) of whole `step`-element chunks covering
    [0, n) (k0: the index of the range's first chunk), on `threads()` threads."""
    chunks = -(-n // step)
    parts = min(_pool[0], chunks)
    if parts <= 1:
        if n:
            run(0, n, 0)
        return
    bounds = [chunks * i // parts for i in range(parts + 1)]
    spans = [
        (b * step, min(n, e * step), b) for b, e in zip(bounds, bounds[1:], strict=False) if e > b
    ]
    if _pool[1] is None:
        _pool[1] = ThreadPoolExecutor(_pool[0], thread_name_prefix="diloco-chunks")
    for future in [_pool[1].submit(run, *span) for span in spans]:
        future.result()
