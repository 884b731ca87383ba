"""Object stores behind one small interface: local files, GCS, memory; with conditional writes.

Keys are relative '/'-separated paths under the store root (see `validate_key`). Every backend
gives: whole-object reads and writes (a reader sees the old or the new object, never a partial
one), create-only writes, compare-and-swap on an opaque generation, fresh (never cached) recursive
listings, and retries of transient errors (`retry`). docs/STORE.md shows how the experiment
layout builds on this.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import requests
import urllib3.exceptions
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc

log = logging.getLogger(__name__)

T = TypeVar("T")
Generation = int | str
"""Opaque token naming one version of one object: compare it, pass it back to compare_and_swap."""


class StoreError(Exception):
    """Base of all store errors; messages are one line."""


class ObjectNotFound(StoreError):
    """The object does not exist."""


class StoreUnreachable(StoreError):
    """The store cannot be used at all: bad bucket, missing credentials, connection refused."""


class TransientStoreError(StoreError):
    """A transient failure that persisted through every retry; trying again later may work."""


class CorruptObject(StoreError):
    """An object exists but its content is invalid (bad JSON or safetensors, wrong checksum)."""


class ObjectTooLarge(CorruptObject):
    """An object is larger than its reader's `max_bytes`; refused without reading it whole."""


def _too_large(where: str, size: int | None, max_bytes: int) -> ObjectTooLarge:
    got = "more than" if size is None else f"{size} bytes,"
    return ObjectTooLarge(f"{where} is {got} over the {max_bytes}-byte limit of its reader")


def _check_limit(max_bytes: int | None) -> None:
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
    ):
        raise ValueError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")


# ---------------------------------------------------------------------------------------------
# Keys


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative key, else raise ValueError.

    Rejected: empty keys, absolute keys, backslashes, control characters, empty segments
    ('a//b', trailing '/'), and segments starting with '.' ('.', '..', '.hidden': reserved for
    store internals such as temp files and generation sidecars). So no key can address anything
    outside the root.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid key {key!r}: empty")
    if key.startswith("/"):
        raise ValueError(f"invalid key {key!r}: absolute")
    if "\\" in key:
        raise ValueError(f"invalid key {key!r}: contains a backslash")
    if any(ord(c) < 0x20 or c == "\x7f" for c in key):
        raise ValueError(f"invalid key {key!r}: contains a control character")
    for segment in key.split("/"):
        if not segment:
            raise ValueError(f"invalid key {key!r}: empty path segment")
        if segment in (".", ".."):
            raise ValueError(f"invalid key {key!r}: contains a {segment!r} segment")
        if segment.startswith("."):
            raise ValueError(f"invalid key {key!r}: segments starting with '.' are reserved")
    return key


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it is "" or a valid key, optionally ending in '/'; else ValueError."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


# ---------------------------------------------------------------------------------------------
# Retries

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TransientStoreError,
    gexc.ServiceUnavailable,
    gexc.TooManyRequests,
    gexc.InternalServerError,
    gexc.BadGateway,
    gexc.GatewayTimeout,
    requests.ConnectionError,
    requests.Timeout,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    auth_exc.TransportError,
    ConnectionError,
    TimeoutError,
)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: 429/500/502/503/504, connection errors, timeouts, EAGAIN."""
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def retry(
    fn: Callable[[], T],
    attempts: int = 5,
    base: float = 0.2,
    cap: float = 5.0,
    *,
    transient: Callable[[BaseException], bool] = is_transient,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call `fn()`; retry transient errors with exponential backoff and full jitter.

    Attempt i (from 0) that fails transiently sleeps uniform(0, min(cap, base * 2**i)) seconds.
    Non-transient errors propagate at once, unchanged. When every attempt failed transiently,
    raises TransientStoreError chained to the last error. `fn` must be safe to repeat.
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if not transient(exc):
                raise
            if attempt == attempts - 1:
                raise TransientStoreError(
                    f"gave up after {attempts} attempts: {one_line(exc)}"
                ) from exc
            delay = random.uniform(0.0, min(cap, base * 2**attempt))
            log.info("transient store error (attempt %d/%d): %s", attempt + 1, attempts, exc)
            sleep(delay)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Interface


class ObjectStore(ABC):
    """A flat namespace of immutable-per-version objects under a root URL.

    Contract shared by every backend:
    - `read`/`write` move whole objects; readers see the old or the new object, never a partial one.
    - `read` and `read_versioned` take `max_bytes`: an object larger than that raises
      ObjectTooLarge, having read at most max_bytes + 1 of its bytes (none where the backend
      knows the size first), so no reader holds more memory than it asked for.
    - `create` and `compare_and_swap` are atomic: of two racing writers at most one succeeds.
    - `list` is fresh (reflects every completed write and delete) and sorted.
    - Generations are opaque; every successful write/create/CAS gives the object a new one, and a
      generation is never reused for the same key (not even after delete and re-create).
    """

    url: str

    @abstractmethod
    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; ObjectNotFound if absent, ObjectTooLarge over `max_bytes`."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Create or overwrite the object."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write only if the key is absent (atomic). True if written, False if it already existed.

        After a retried attempt whose first try may have landed, an existing object with exactly
        `data` counts as created (True): the content is there either way.
        """

    @abstractmethod
    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        """The object's bytes and generation (consistent with each other), or None if absent;
        ObjectTooLarge over `max_bytes`."""

    @abstractmethod
    def compare_and_swap_generation(
        self, key: str, data: bytes, expected: Generation | None
    ) -> Generation | None:
        """Write `data` only if the object's generation is `expected` (None: the key must be
        absent). Returns the new generation, or None if the precondition failed."""

    def compare_and_swap(self, key: str, data: bytes, expected: Generation | None) -> bool:
        """Write `data` only if the generation is `expected` (None: absent). True if written.

        Of several writers racing from the same `expected`, exactly one gets True.
        """
        return self.compare_and_swap_generation(key, data, expected) is not None

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    @abstractmethod
    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        """Keys starting with `prefix` (a plain string prefix, recursive), sorted; never cached.

        `start_after` (a full key): only keys sorting after it. On GCS this is a server-side
        `start_offset`, so a poller that remembers where it stopped never re-lists the history.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing object is fine."""

    @abstractmethod
    def check(self) -> None:
        """Fast reachability / credentials check; raises StoreUnreachable with the reason."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def open_store(url: str | os.PathLike[str]) -> ObjectStore:
    """Open "file:///abs/path", a plain path, "gs://bucket[/prefix]" or "memory://name".

    Nothing is contacted here; call `check()` to verify reachability.
    """
    text = os.fspath(url)
    if text.startswith("gs://"):
        bucket, _, prefix = text[len("gs://") :].partition("/")
        return GCSStore(bucket, prefix)
    if text.startswith("memory://"):
        return MemoryStore(text[len("memory://") :])
    if text.startswith("file://"):
        path = text[len("file://") :]
        if not path.startswith("/"):
            raise ValueError(f"invalid store URL {text!r}: file:// URLs need an absolute path")
        return LocalStore(path)
    if "://" in text:
        raise ValueError(f"unsupported store URL {text!r}: use file://, gs:// or memory://")
    return LocalStore(text)


# ---------------------------------------------------------------------------------------------
# Local files

_GENERATION_WIDTH = 20


class LocalStore(ObjectStore):
    """Objects as files under a root directory (file:// URLs and plain paths).

    - write: temp file in the same directory, fsync, os.replace (atomic), fsync of the directory.
    - create: temp file, then os.link(temp, final), which fails if final exists; temp unlinked.
    - generations: each object `dir/name` has a hidden sidecar `dir/.name.gen` holding a fixed-width
      decimal counter. The sidecar is also the lock: every mutation holds `flock(LOCK_EX)` on it,
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
        return path.with_name(f".{path.name}.gen")

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
    def _write_temp(path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
        try:
            with open(temp, "xb") as f:
                f.write(data)
                f.flush()
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

    def _read_file(self, key: str, path: Path, max_bytes: int | None) -> bytes:
        """The file's bytes; the size is checked on the open file (fstat) before reading, and
        at most max_bytes + 1 bytes are read (a file replaced meanwhile is another inode)."""
        with open(path, "rb") as f:
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
        path = self._path(key)

        def attempt() -> None:
            temp = self._write_temp(path, data)
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

    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        path = self._path(key)
        _check_limit(max_bytes)

        def attempt() -> tuple[bytes, Generation] | None:
            try:
                fd = os.open(self._generation_path(path), os.O_RDONLY)
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

    def check(self) -> None:
        existing = self.root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise StoreUnreachable(f"{self.url}: {existing} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StoreUnreachable(f"{self.url}: {existing} is not writable")


# ---------------------------------------------------------------------------------------------
# Memory


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

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._bucket.lock:
            self._bucket.objects.pop(key, None)

    def check(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# Google Cloud Storage

_DEFAULT_TIMEOUT = (10.0, 120.0)  # (connect, read) seconds per HTTP request
_CHECK_TIMEOUT = (3.0, 5.0)
_GCS_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)


def gcs_credentials() -> tuple[Any, str | None]:
    """(credentials, project) for google-cloud-storage.

    Anonymous with project "test" when STORAGE_EMULATOR_HOST is set; else Application Default
    Credentials, project from GOOGLE_CLOUD_PROJECT or ADC (object operations need none).
    Raises StoreUnreachable when no credentials are found.
    """
    project = os.environ.get("GOOGLE_CLOUD_PROJECT")
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return AnonymousCredentials(), project or "test"
    import google.auth

    try:
        credentials, default_project = google.auth.default(scopes=_GCS_SCOPES)
    except auth_exc.DefaultCredentialsError as exc:
        raise StoreUnreachable(
            "no Google Cloud credentials: run `gcloud auth application-default login` "
            "or set GOOGLE_APPLICATION_CREDENTIALS"
        ) from exc
    return credentials, project or default_project


class GCSStore(ObjectStore):
    """gs://bucket[/prefix] through google-cloud-storage (no gcsfs, so no listing cache).

    - create: upload with if_generation_match=0; CAS: if_generation_match=<generation>; a 412
      PreconditionFailed means the precondition failed (False / None). Uploads up to 8 MiB are
      single-request (multipart) uploads; keep conditional objects small: fake-gcs-server
      enforces preconditions only on those (real GCS enforces them on every upload).
    - The library's own retries are off (retry=None); `retry` here is the only retry layer, so
      a repeated conditional write is detected: when a retried create/CAS gets 412 and the
      object now holds exactly our bytes, our earlier attempt landed and it counts as a success.
    - Credentials are resolved once per store (lazily, on first use) and shared; each thread
      gets its own client built from them (a client's HTTP session is not shared by threads).
    """

    def __init__(
        self, bucket: str, prefix: str = "", timeout: tuple[float, float] = _DEFAULT_TIMEOUT
    ):
        if not bucket or "/" in bucket or bucket != bucket.lower():
            raise ValueError(f"invalid GCS bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.timeout = timeout
        self.url = f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"
        self._local = threading.local()
        self._credentials_lock = threading.Lock()
        self._credentials: tuple[Any, str | None] | None = None

    # helpers -------------------------------------------------------------------------------
    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            from google.cloud import storage

            with self._credentials_lock:
                if self._credentials is None:
                    self._credentials = gcs_credentials()
            credentials, project = self._credentials
            client = self._local.client = storage.Client(project=project, credentials=credentials)
        return client

    def _name(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, key: str):
        return self._client().bucket(self.bucket).blob(self._name(key))

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _endpoint(self) -> str:
        return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"

    @staticmethod
    def _content_type(key: str) -> str:
        return "application/json" if key.endswith(".json") else "application/octet-stream"

    def _run(
        self,
        op: str,
        key: str,
        fn: Callable[[], T],
        not_found: type[StoreError] = StoreUnreachable,
    ) -> T:
        """Run `fn` with retries and map client errors to StoreError subclasses."""
        where = self._where(key)
        try:
            return retry(fn)
        except TransientStoreError as exc:
            raise TransientStoreError(f"{op} {where}: {exc}") from exc
        except StoreError:
            raise
        except gexc.NotFound as exc:
            if not_found is ObjectNotFound:
                raise ObjectNotFound(f"{where} not found") from exc
            raise StoreUnreachable(f"{op} {where}: bucket gs://{self.bucket} not found") from exc
        except (gexc.Forbidden, gexc.Unauthorized) as exc:
            raise StoreUnreachable(f"{op} {where}: permission denied ({exc.message})") from exc
        except (auth_exc.RefreshError, auth_exc.DefaultCredentialsError) as exc:
            raise StoreUnreachable(f"{op} {where}: credentials: {one_line(exc)}") from exc
        except gexc.GoogleAPICallError as exc:
            raise StoreError(f"{op} {where}: HTTP {exc.code} {exc.message}") from exc

    def _download(self, key: str, max_bytes: int | None = None) -> tuple[bytes, int] | None:
        """One attempt: the bytes and their generation, or None if absent.

        With `max_bytes`, a ranged download of bytes [0, max_bytes]: at most max_bytes + 1
        bytes cross the network, and more than max_bytes means too large (the response's
        object size, when it has one, is checked first). An empty object answers a range
        with 416; that is b"".
        """
        blob = self._blob(key)
        try:
            if max_bytes is None:
                data = blob.download_as_bytes(retry=None, timeout=self.timeout)
            else:
                data = blob.download_as_bytes(
                    start=0, end=max_bytes, retry=None, timeout=self.timeout, checksum=None
                )
        except gexc.NotFound:
            return None
        except gexc.RequestRangeNotSatisfiable:
            blob.reload(retry=None, timeout=self.timeout)
            if blob.size:
                raise
            data = b""
        if max_bytes is not None and (len(data) > max_bytes or (blob.size or 0) > max_bytes):
            raise _too_large(self._where(key), blob.size, max_bytes)
        return data, int(blob.generation)

    def _upload(self, key: str, data: bytes, if_generation_match: int | None) -> int:
        """One attempt: upload, returns the new generation."""
        blob = self._blob(key)
        blob.upload_from_string(
            data,
            content_type=self._content_type(key),
            if_generation_match=if_generation_match,
            retry=None,
            timeout=self.timeout,
        )
        return int(blob.generation)

    # operations ----------------------------------------------------------------------------
    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        _check_limit(max_bytes)

        def attempt() -> bytes:
            got = self._download(key, max_bytes)
            if got is None:
                raise ObjectNotFound(f"{self._where(key)} not found")
            return got[0]

        return self._run("read", key, attempt, not_found=ObjectNotFound)

    def write(self, key: str, data: bytes) -> None:
        self._run("write", key, lambda: self._upload(key, data, None))

    def create(self, key: str, data: bytes) -> bool:
        return self.compare_and_swap_generation(key, data, None) is not None

    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        _check_limit(max_bytes)
        return self._run(
            "read", key, lambda: self._download(key, max_bytes), not_found=ObjectNotFound
        )

    def compare_and_swap_generation(
        self, key: str, data: bytes, expected: Generation | None
    ) -> Generation | None:
        match = 0 if expected is None else int(expected)
        attempts = 0

        def attempt() -> int | None:
            nonlocal attempts
            attempts += 1
            try:
                return self._upload(key, data, match)
            except gexc.PreconditionFailed:
                if attempts == 1:
                    return None
                # An earlier attempt may have landed before its response was lost.
                current = self._download(key)
                if current is not None and current[0] == data:
                    return current[1]
                return None

        return self._run("compare_and_swap" if expected is not None else "create", key, attempt)

    def exists(self, key: str) -> bool:
        blob = self._blob(key)
        return self._run("exists", key, lambda: blob.exists(retry=None, timeout=self.timeout))

    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        validate_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""
        offset = {} if start_after is None else {"start_offset": root + start_after}

        def attempt() -> list[str]:
            blobs = self._client().list_blobs(
                self.bucket, prefix=root + prefix, retry=None, timeout=self.timeout, **offset
            )
            # Skip "folder" placeholder objects (names ending in '/') made by the console.
            names = (b.name[len(root) :] for b in blobs if not b.name.endswith("/"))
            return sorted(k for k in names if start_after is None or k > start_after)

        return self._run("list", prefix, attempt)

    def delete(self, key: str) -> None:
        blob = self._blob(key)

        def attempt() -> None:
            with suppress(gexc.NotFound):
                blob.delete(retry=None, timeout=self.timeout)

        self._run("delete", key, attempt)

    def check(self) -> None:
        """List at most one object with short timeouts and no retries."""
        try:
            client = self._client()
            blobs = client.list_blobs(
                self.bucket,
                prefix=f"{self.prefix}/" if self.prefix else None,
                max_results=1,
                retry=None,
                timeout=_CHECK_TIMEOUT,
            )
            list(blobs)
        except StoreUnreachable:
            raise
        except gexc.NotFound as exc:
            raise StoreUnreachable(f"bucket gs://{self.bucket} does not exist") from exc
        except (gexc.Forbidden, gexc.Unauthorized) as exc:
            raise StoreUnreachable(
                f"permission denied listing {self.url} ({exc.message}); check the credentials "
                "and the IAM role (objects list/get/create/delete are needed)"
            ) from exc
        except (auth_exc.RefreshError, auth_exc.DefaultCredentialsError) as exc:
            raise StoreUnreachable(f"credentials for {self.url}: {one_line(exc)}") from exc
        except (requests.RequestException, auth_exc.TransportError, OSError) as exc:
            raise StoreUnreachable(
                f"cannot reach {self._endpoint()} for {self.url}: {one_line(exc)}"
            ) from exc
        except gexc.GoogleAPICallError as exc:
            raise StoreUnreachable(f"{self.url}: HTTP {exc.code} {exc.message}") from exc
