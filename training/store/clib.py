"""The library's C files, compiled on first use with the system C compiler and loaded through
ctypes: the store's CRC-32C (training/store/crc.c) and the codecs' and merge's loops
(training/codecs/native.c). Here, in the store, because the store is the lowest role that has
one (tests/test_layers.py): the codecs import it from here.

A `Library` returns the loaded library, or None when it cannot be had: no C compiler (`$CC`,
else `cc`), a failed build, an unwritable cache, or `DILOCO_NATIVE=0`. Then its callers run
their Python code, which gives the same result (each C file's top comment says how).

The shared object is cached in `$XDG_CACHE_HOME/diloco`, else `~/.cache/diloco`, under a name
made of the C file's name and the hash of the source, the flags and the compiler, so an edit,
another compiler or another CPU builds anew (it is built for this CPU's vector units,
-march=native, where the compiler knows the flag: the key holds the compiler's expansion of
it, so a cache shared by machines of different CPUs never loads a foreign build); it is
written to a temporary name and renamed into place (processes building at once each finish
with a whole file).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("diloco.native")

NATIVE_ENV = "DILOCO_NATIVE"  # "0": never build or load the C files (the Python code runs)
FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=c99")
NATIVE = ("-march=native",)  # this CPU's vector units: about 3x the speed of plain x86-64


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diloco"


def _target(cc: str, flags: tuple[str, ...]) -> str:
    """What `cc flags` compiles for, in the compiler's words (-march=native expanded to the
    CPU's own features), for the cache key."""
    done = subprocess.run(
        [cc, *flags, "-E", "-v", "-x", "c", os.devnull],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stderr if done.returncode == 0 else ""


def build(source: Path) -> Path | None:
    """The shared object of the C file `source` (cached, or compiled now: -march=native where
    the compiler knows it, else without), or None (no compiler, a failed build)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        log.info("no C compiler (%s): %s is not built, its Python fallback runs", cc, source.name)
        return None
    text = source.read_bytes()
    for flags in (FLAGS + NATIVE, FLAGS):
        target = _target(cc, flags)
        if not target:
            continue  # e.g. -march=native unknown to this compiler
        key = hashlib.sha256(text + repr((flags, target, cc)).encode()).hexdigest()[:16]
        path = _cache_dir() / f"{source.stem}-{key}.so"
        if path.exists() or compile_to(cc, flags, source, path):
            return path
    return None


def compile_to(cc: str, flags: tuple[str, ...], source: Path, path: Path) -> bool:
    """Compile `source` with `cc flags` into `path` (whole or not at all); False: it failed."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            log.warning("building %s failed:\n%s", source.name, done.stderr[-2000:])
            return False
        os.replace(tmp, path)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class Library:
    """The C file `source` built and loaded by `load(path)` (which opens the shared object and
    declares its functions' types) on the first call, once per process; None when it cannot
    be had (the module docstring)."""

    def __init__(self, source: Path, load: Callable[[Path], ctypes.CDLL]):
        self.source = source
        self._load = load
        self._lock = threading.Lock()
        self._loaded: list = []  # [library or None] once decided

    def __call__(self) -> ctypes.CDLL | None:
        if self._loaded:
            return self._loaded[0]
        with self._lock:
            if not self._loaded:
                lib = None
                if os.environ.get(NATIVE_ENV, "1") != "0":
                    try:
                        path = build(self.source)
                        lib = self._load(path) if path is not None else None
                    except (OSError, subprocess.SubprocessError) as err:
                        log.warning(
                            "%s unavailable (%s): its Python fallback runs", self.source.name, err
                        )
                self._loaded.append(lib)
        return self._loaded[0]
