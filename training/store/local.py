"""file:// and plain paths: objects as files, conditional writes with flock and a generation
counter (see the class docstring and docs/STORE.md)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from training.store.objectstore import (
    Chunk,
    Consume,
    CorruptObject,
    Generation,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    StoreUnreachable,
    _check_limit,
    _too_large,
    retry,
    validate_key,
    validate_prefix,
)

T = TypeVar("T")

_GENERATION_WIDTH = 20
_EVENT_WORD = "tfevents"


def _hidden(name: str) -> str:
    """The stem of the hidden files of object `name` (its generation sidecar, its temp files):
    `.NAME`; for a name holding "tfevents", `..NAME` with that word written "tf%65vents" (and
    "%" written "%25" first). TensorBoard reads every file whose name holds "tfevents" as an
    event file (a sidecar's counter read as a record length is a BadLengthCrc warning, a temp
    file a half-written copy): no hidden file is named so. One to one: percent-escaping is
    reversible, and ordinary stems never start with ".." (no key segment starts with ".")."""
    if _EVENT_WORD not in name:
        return f".{name}"
    return ".." + name.replace("%", "%25").replace(_EVENT_WORD, "tf%65vents")


class LocalStore(ObjectStore):
    """Objects as files under a root directory (file:// URLs and plain paths).

    - write: temp file in the same directory, fsync, os.replace (atomic), fsync of the directory.
    - create: temp file, then os.link(temp, final), which fails if final exists; temp unlinked.
    - generations: each object `dir/name` has a hidden sidecar `dir/.name.gen` holding a fixed-width
      decimal counter (`dir/..name.gen`, escaped, for a name holding "tfevents": `_hidden`).
      The sidecar is also the lock: every mutation holds `flock(LOCK_EX)` on it,
      bumps the counter (fsync) and then replaces the object; `read_versioned` holds `LOCK_SH`.
      A crash between the two steps leaves the counter ahead of the file, which only makes a
      pending compare-and-swap fail (safe). A file without sidecar (put there by hand) has
      generation 0. Sidecars survive delete so generations never repeat.
    Safe across threads and processes on one machine (flock); not meant for NFS.
    Hidden names (starting with '.') are never listed and cannot be keys.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.url = f"file://{self.root}"

    # paths ---------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    @staticmethod
    def _generation_path(path: Path) -> Path:
        return path.with_name(f"{_hidden(path.name)}.gen")

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    # helpers -------------------------------------------------------------------------------
    def _run(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run `fn` with retries; map OSError to StoreError subclasses with one-line messages."""
        try:
            return retry(fn)
        except StoreError:
            raise
        except PermissionError as exc:
            raise StoreUnreachable(f"{op} {self._where(key)}: permission denied") from exc
        except (NotADirectoryError, IsADirectoryError, FileExistsError) as exc:
            raise StoreError(
                f"{op} {self._where(key)}: a file and a directory collide on this path"
            ) from exc
        except OSError as exc:
            raise StoreError(f"{op} {self._where(key)}: {exc.strerror or exc}") from exc

    @staticmethod
    def _write_temp(path: Path, data: bytes | Iterable[Chunk]) -> Path:
        """A fsynced temp file next to `path` holding `data` (bytes, or chunks written one by
        one as they come)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f"{_hidden(path.name)}.tmp-{uuid.uuid4().hex}")
        parts = [data] if isinstance(data, bytes | bytearray | memoryview) else data
        try:
            with open(temp, "xb", buffering=0) as f:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[f.write(view) :]
                os.fsync(f.fileno())
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return temp

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextmanager
    def _locked_generation(self, path: Path) -> Iterator[int]:
        """Hold LOCK_EX on the sidecar; yields its fd (see _read_counter / _write_counter)."""
        fd = os.open(self._generation_path(path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _read_counter(fd: int) -> int:
        raw = os.pread(fd, _GENERATION_WIDTH + 1, 0).strip()
        if not raw:
            return 0
        if not raw.isdigit():
            raise CorruptObject(f"generation sidecar holds {raw[:40]!r}, not a counter")
        return int(raw)

    @staticmethod
    def _write_counter(fd: int, value: int) -> None:
        os.pwrite(fd, f"{value:0{_GENERATION_WIDTH}d}\n".encode(), 0)
        os.fsync(fd)

    @staticmethod
    def _as_int(expected: Generation) -> int:
        if isinstance(expected, int) and not isinstance(expected, bool):
            return expected
        if isinstance(expected, str) and expected.isdigit():
            return int(expected)
        raise ValueError(f"invalid generation {expected!r} for a local store")

    def _open_regular(self, key: str, path: Path, buffering: int = -1) -> BinaryIO:
        """`path` opened for reading, once the open file (fstat) is a regular file; a FIFO, a
        device or a socket at an object's name is CorruptObject, refused before a read that
        would wait for a writer forever or never end. Opened non-blocking (a FIFO's open
        returns at once), then blocking again for the read."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptObject(f"{self._where(key)} is not a regular file")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb", buffering)
        except BaseException:
            os.close(fd)
            raise

    def _read_file(self, key: str, path: Path, max_bytes: int | None) -> bytes:
        """The file's bytes; the size is checked on the open file (fstat) before reading, and
        at most max_bytes + 1 bytes are read (a file replaced meanwhile is another inode); a
        file that is not regular is refused (`_open_regular`)."""
        with self._open_regular(key, path) as f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is None:
                return f.read()
            if size > max_bytes:
                raise _too_large(self._where(key), size, max_bytes)
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise _too_large(self._where(key), None, max_bytes)
        return data

    # operations ----------------------------------------------------------------------------
    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        _check_limit(max_bytes)

        def attempt() -> bytes:
            try:
                return self._read_file(key, path, max_bytes)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise ObjectNotFound(f"{self._where(key)} not found") from None

        return self._run("read", key, attempt)

    def write(self, key: str, data: bytes) -> None:
        self._replace_with(key, lambda: data)

    def write_stream(self, key: str, chunks: Callable[[], Iterable[Chunk]]) -> None:
        self._replace_with(key, chunks)

    def write_parts(self, key: str, parts: Sequence[Any]) -> None:
        parts = list(parts)
        self._replace_with(key, lambda: parts)

    def _replace_with(self, key: str, data: Callable[[], bytes | Iterable[Chunk]]) -> None:
        """Write `data()` (fresh on every attempt) to a temp file, then replace the object."""
        path = self._path(key)

        def attempt() -> None:
            temp = self._write_temp(path, data())
            try:
                with self._locked_generation(path) as fd:
                    self._write_counter(fd, self._read_counter(fd) + 1)
                    os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
            self._fsync_dir(path.parent)

        self._run("write", key, attempt)

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)

        def attempt() -> bool:
            if path.exists():
                return False
            temp = self._write_temp(path, data)
            try:
                with self._locked_generation(path) as fd:
                    if path.exists():
                        return False
                    self._write_counter(fd, self._read_counter(fd) + 1)
                    try:
                        os.link(temp, path)
                    except FileExistsError:
                        return False
                    except OSError as exc:
                        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                            raise
                        os.replace(temp, path)  # no hard links here; the lock keeps it atomic
            finally:
                temp.unlink(missing_ok=True)
            self._fsync_dir(path.parent)
            return True

        return self._run("create", key, attempt)

    def read_buffer(
        self,
        key: str,
        max_bytes: int | None = None,
        writable: bool = True,
        consume: Consume | None = None,
        into: Callable[[int], memoryview] | None = None,
    ) -> memoryview:
        """The file read straight into a new writable buffer (one copy from the page cache,
        whether or not `writable` is asked), or into `into(size + 1)`; the size is checked on
        the open file first, as in `read`."""
        path = self._path(key)
        _check_limit(max_bytes)

        def attempt() -> memoryview:
            try:
                with self._open_regular(key, path, buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    if max_bytes is not None and size > max_bytes:
                        raise _too_large(self._where(key), size, max_bytes)
                    # numpy's large allocations are huge-page backed: ~2x faster to fill
                    buf = (
                        memoryview(np.empty(size + 1, np.uint8)) if into is None else into(size + 1)
                    )
                    got = 0
                    while got <= size:
                        n = f.readinto(buf[got:])
                        if not n:
                            break
                        got += n
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise ObjectNotFound(f"{self._where(key)} not found") from None
            if got > size:  # the file grew after the fstat: never hold more than asked
                if max_bytes is not None and got > max_bytes:
                    raise _too_large(self._where(key), None, max_bytes)
                return memoryview(bytearray(self._read_file(key, path, max_bytes)))
            return buf[:got]

        view = self._run("read", key, attempt)
        if consume is not None:
            consume(view)
        return view

    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        path = self._path(key)
        _check_limit(max_bytes)

        def attempt() -> tuple[bytes, Generation] | None:
            try:
                # non-blocking: a FIFO put at a sidecar is refused (pread: ESPIPE), not waited on
                fd = os.open(self._generation_path(path), os.O_RDONLY | os.O_NONBLOCK)
            except (FileNotFoundError, NotADirectoryError):
                try:
                    return self._read_file(key, path, max_bytes), 0
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                generation = self._read_counter(fd)
                try:
                    return self._read_file(key, path, max_bytes), generation
                except (FileNotFoundError, IsADirectoryError):
                    return None
            finally:
                os.close(fd)

        return self._run("read", key, attempt)

    def compare_and_swap_generation(
        self, key: str, data: bytes, expected: Generation | None
    ) -> Generation | None:
        path = self._path(key)
        wanted = None if expected is None else self._as_int(expected)

        def attempt() -> Generation | None:
            temp = self._write_temp(path, data)
            try:
                with self._locked_generation(path) as fd:
                    counter = self._read_counter(fd)
                    current = counter if path.is_file() else None
                    if current != wanted:
                        return None
                    self._write_counter(fd, counter + 1)
                    os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
            self._fsync_dir(path.parent)
            return counter + 1

        return self._run("compare_and_swap", key, attempt)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        validate_prefix(prefix)
        directory, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*directory.split("/")) if directory else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            relative = Path(dirpath).relative_to(self.root).as_posix()
            base = "" if relative == "." else relative + "/"
            dirnames[:] = [
                d
                for d in dirnames
                if not d.startswith(".")
                and ((base + d + "/").startswith(prefix) or prefix.startswith(base + d + "/"))
            ]
            keys.extend(
                base + name
                for name in filenames
                if not name.startswith(".") and (base + name).startswith(prefix)
            )
        return sorted(k for k in keys if start_after is None or k > start_after)

    def sizes(self, prefix: str) -> dict[str, int]:
        out = {}
        for key in self.list(prefix):
            with suppress(FileNotFoundError):  # deleted since the listing
                out[key] = self._path(key).stat().st_size
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)

        def attempt() -> None:
            if not path.exists() and not self._generation_path(path).exists():
                return
            with self._locked_generation(path) as fd:
                if not path.is_file():
                    return
                self._write_counter(fd, self._read_counter(fd) + 1)
                path.unlink()

        self._run("delete", key, attempt)

    def remove_empty_dir(self, prefix: str) -> bool:
        """Remove directory `prefix` when it holds no object any more: the generation sidecars
        its deleted objects left, then the directory. Only for a name never used again (the
        caller's promise, `ObjectStore.remove_empty_dir`): a sidecar is what keeps the
        generation of an object created again at the same key new. False when anything else
        is in it (an object, a writer's temp file) or it is gone."""
        directory = self.root.joinpath(*validate_prefix(prefix).strip("/").split("/"))
        try:
            entries = list(directory.iterdir())
            if any(not (e.name.startswith(".") and e.name.endswith(".gen")) for e in entries):
                return False
            for e in entries:
                e.unlink(missing_ok=True)
            directory.rmdir()
        except OSError:  # gone, or a writer came in: leave it
            return False
        return True

    def drop_abandoned_writes(self, prefix: str) -> int:
        """The temp files (`.NAME.tmp-*`, `_write_temp`) under directory `prefix`, then its
        subdirectories left with no object (`remove_empty_dir`), deepest first."""
        top = self.root.joinpath(*validate_prefix(prefix).strip("/").split("/"))
        removed, directories = 0, []
        for dirpath, _, filenames in os.walk(top):
            for name in filenames:
                if name.startswith(".") and ".tmp-" in name:
                    Path(dirpath, name).unlink(missing_ok=True)
                    removed += 1
            if Path(dirpath) != top:
                directories.append(Path(dirpath))
        for directory in sorted(directories, key=lambda d: -len(d.parts)):
            self.remove_empty_dir(directory.relative_to(self.root).as_posix() + "/")
        return removed

    def check(self) -> None:
        existing = self.root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise StoreUnreachable(f"{self.url}: {existing} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StoreUnreachable(f"{self.url}: {existing} is not writable")
