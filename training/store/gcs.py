"""gs://bucket[/prefix] through google-cloud-storage, with generation preconditions (see the
class docstring and docs/STORE.md)."""

from __future__ import annotations

import base64
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

import numpy as np
import requests
import urllib3.exceptions
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc

from training.store.objectstore import (
    Chunk,
    Consume,
    CorruptObject,
    Generation,
    ObjectChanged,
    ObjectNotFound,
    ObjectStore,
    StoreConnectionError,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
    _check_limit,
    _too_large,
    is_transient,
    one_line,
    register_transient,
    retry,
    validate_key,
    validate_prefix,
)

T = TypeVar("T")


class _GenerationGone(StoreError):
    """A ranged GET of a pinned generation answered 404 (`read_buffer` says why: _changed)."""


register_transient(
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
)

_DEFAULT_TIMEOUT = (10.0, 120.0)  # (connect, read) seconds per HTTP request
_CHECK_TIMEOUT = (3.0, 5.0)
STREAM_CHUNK = 16 * 2**20  # bytes per request of a streamed (resumable) upload
RANGE_PART = 32 * 2**20
"""Bytes per ranged GET of a large object's read (`GCSStore.read_buffer`); an object of at
most one part is one GET. 32 MiB is google-cloud-storage's transfer_manager default chunk:
at a stream's ~200 MiB/s a part is ~160 ms, against tens of ms to the first byte."""
RANGE_PARALLEL = 8
"""Ranged GETs in flight per store (transfer_manager's default worker count): one stream
reaches ~200 MiB/s, parallel streams many times that (docs/BENCHMARKS.md, "Merge fetch")."""
_RANGE_READ = 2**20  # bytes per socket read of a part into the buffer
_GCS_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)


def _refuse_encoded(response: requests.Response, where: str) -> None:
    if response.headers.get("Content-Encoding", "identity") != "identity":
        raise CorruptObject(f"{where}: answered an encoded body")


def _generation(response: requests.Response, where: str, required: bool) -> int | None:
    """The generation an answer names (X-Goog-Generation), None if it names none and need not."""
    served = response.headers.get("X-Goog-Generation")
    if served is None and not required:
        return None
    if served is None or not served.isdigit():
        raise CorruptObject(f"{where}: answered generation {served!r}")
    return int(served)


def _stated_crc32c(response: requests.Response, where: str) -> str | None:
    """The crc32c an answer states for the whole object (X-Goog-Hash), as 8 hex digits."""
    for part in response.headers.get("X-Goog-Hash", "").split(","):
        name, _, value = part.strip().partition("=")
        if name == "crc32c":
            with suppress(ValueError):
                digest = base64.b64decode(value, validate=True)
                if len(digest) == 4:
                    return digest.hex()
            raise CorruptObject(f"{where}: answered crc32c {value!r}")
    return None


def _fill(
    response: requests.Response,
    view: memoryview,
    where: str,
    arrived: Callable[[int, int], None] | None = None,
) -> None:
    """Exactly len(view) bytes of `response`'s body into `view`, read from the socket
    _RANGE_READ at a time, `arrived(a, b)` after bytes [a, b) are in: a short body is a
    (transient) ConnectionError, a longer one CorruptObject."""
    filled = 0
    while filled < len(view):
        chunk = response.raw.read(min(_RANGE_READ, len(view) - filled), decode_content=False)
        if not chunk:
            raise ConnectionError(f"{where}: the answer ended after {filled} bytes")
        view[filled : filled + len(chunk)] = chunk
        if arrived is not None:
            arrived(filled, filled + len(chunk))
        filled += len(chunk)
    if response.raw.read(1, decode_content=False):
        raise CorruptObject(f"{where}: the answer runs past {len(view)} bytes")


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
    - `read_buffer` of an object larger than one part (`part_bytes`) reads it as ranged GETs,
      `parallel_parts` in flight per store, straight into one buffer, every range pinned to
      the generation its size was read with; a small read is one GET straight into one
      buffer (`_read_whole`), on the same helpers (docs/STORE.md, "Large reads").
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        timeout: tuple[float, float] = _DEFAULT_TIMEOUT,
        part_bytes: int = RANGE_PART,
        parallel_parts: int = RANGE_PARALLEL,
    ):
        if not bucket or "/" in bucket or bucket != bucket.lower():
            raise ValueError(f"invalid GCS bucket name {bucket!r}")
        if part_bytes < 1 or parallel_parts < 1:
            raise ValueError(
                f"part_bytes and parallel_parts must be >= 1: {part_bytes}, {parallel_parts}"
            )
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
        self.part_bytes = part_bytes
        self.parallel_parts = parallel_parts
        self._parts: ThreadPoolExecutor | None = None  # ranged GETs (read_buffer)
        self._parts_pid = 0

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
        """The bytes and their generation, or None if absent: `_read_whole`, then one copy
        into bytes (`read`, `read_versioned`: JSON records and other small objects)."""
        got = self._read_whole(key, max_bytes)
        return None if got is None else (got[0].tobytes(), got[1])

    def _read_whole(
        self, key: str, max_bytes: int | None, consume: Consume | None = None
    ) -> tuple[np.ndarray, int] | None:
        """The object in one new buffer and its generation, or None if absent: one GET.

        With `max_bytes`, of bytes [0, max_bytes]: at most max_bytes + 1 bytes are asked
        for, and the answer's object size (its Content-Range, or its length if it is the
        whole object) over max_bytes is refused before its body is read. Its bytes go
        straight into the buffer as they arrive, and to `consume` in order. The GET is
        retried (`retry`) until an answer's head is accepted; if that answer's body then
        breaks off, the rest is one ranged GET of the generation it named (`_part`), so
        `consume` never sees a byte twice, nor bytes of two generations. Without a limit the
        whole object is checked against the crc32c its answer states (X-Goog-Hash), as the
        library's whole download did.
        """
        where = self._where(key)
        got: list[Any] = []  # [buffer, generation, crc32c] once an answer's head is accepted
        filled = 0

        def arrived(a: int, b: int) -> None:
            nonlocal filled
            if consume is not None:
                consume(memoryview(got[0])[a:b])
            filled = b

        def attempt() -> bool:
            span = None if max_bytes is None else f"bytes=0-{max_bytes}"
            response = self._get(key, None, span)
            try:
                head = self._whole_head(response, key, max_bytes)
                if head is None:
                    return False
                crc = None if max_bytes is not None else _stated_crc32c(response, where)
                got[:] = [np.empty(head[0], np.uint8), head[1], crc]
                if response.status_code != 416:  # an empty object's answer has no body
                    try:
                        _fill(response, memoryview(got[0]), where, arrived)
                    except Exception as exc:
                        if not is_transient(exc):
                            raise
                        # the rest is read below, pinned to this answer's generation
                return True
            finally:
                response.close()

        if not self._run("read", key, attempt, not_found=ObjectNotFound):
            return None
        buf, generation, crc = got
        if filled < buf.size:
            rest = memoryview(buf)[filled:]
            try:
                self._part(key, generation, rest, filled, buf.size, threading.Event())
            except _GenerationGone:
                raise self._changed(key, generation) from None
            if consume is not None:
                consume(rest)
        if max_bytes is None and crc is not None:
            from training.store.tensors import checksum

            if checksum([buf]) != crc:
                raise CorruptObject(f"{where}: the bytes read fail the crc32c {crc} stated")
        return buf, generation

    def _whole_head(
        self, response: requests.Response, key: str, max_bytes: int | None
    ) -> tuple[int, int] | None:
        """(size, generation) from the head of `_read_whole`'s answer, None for 404; refuses
        an object over `max_bytes`, an encoded body and any answer but the object from byte 0."""
        where = self._where(key)
        status = response.status_code
        if status == 404:
            return None
        if status == 416 and max_bytes is not None:
            # byte 0 is past the end: the object is empty (RFC 9110: "bytes */0", if said)
            span = response.headers.get("Content-Range")
            if span is not None and span != "bytes */0":
                raise CorruptObject(f"{where}: answered HTTP 416 with range {span!r}")
            generation = _generation(response, where, required=False)
            if generation is None:  # the answer did not say which: ask
                size, generation = self._metadata(key)
                if size:
                    raise CorruptObject(f"{where}: answered HTTP 416 for a {size}-byte object")
            return 0, generation
        if status >= 400:
            raise gexc.from_http_response(response)
        _refuse_encoded(response, where)
        generation = _generation(response, where, required=True)
        span = response.headers.get("Content-Range")
        if status == 206 and max_bytes is not None and span is not None:
            m = re.fullmatch(r"bytes 0-(\d+)/(\d+)", span)
            if m is None:
                raise CorruptObject(f"{where}: answered range {span!r}, not from byte 0")
            last, size = int(m[1]), int(m[2])
            if size > max_bytes:
                raise _too_large(where, size, max_bytes)
            if last != size - 1:
                raise CorruptObject(f"{where}: answered range {span!r} of bytes 0-{max_bytes}")
        elif status == 200 and span is None:  # the whole object
            length = response.headers.get("Content-Length", "")
            if not length.isdigit():
                raise CorruptObject(f"{where}: whole object answered without its length")
            size = int(length)
            if max_bytes is not None and size > max_bytes:
                raise _too_large(where, size, max_bytes)
        else:
            raise CorruptObject(f"{where}: answered HTTP {status} with range {span!r}")
        return size, generation

    def _get(self, key: str, generation: int | None, span: str | None) -> requests.Response:
        """One streamed GET of the object's bytes (of `generation` if given: the request's
        `generation` parameter, so a replaced object answers 404), `span` its Range header,
        never content-encoded (Accept-Encoding: identity; the answer is checked too)."""
        client = self._client()
        blob = client.bucket(self.bucket).blob(self._name(key), generation=generation)
        # The library's own URL rule (endpoint, emulator, quoting, generation).
        url = blob._get_download_url(client)
        headers = {"Accept-Encoding": "identity"}
        if span is not None:
            headers["Range"] = span
        return client._http.get(url, headers=headers, stream=True, timeout=self.timeout)

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

    def read_buffer(
        self,
        key: str,
        max_bytes: int | None = None,
        writable: bool = True,
        consume: Consume | None = None,
    ) -> memoryview:
        """The object in one new buffer. Under a limit of at most one part it is one GET, as
        `read`. Otherwise its size and generation come first (one metadata request: over
        `max_bytes` is refused before any byte is read), then ceil(size / part_bytes) ranged
        GETs of that generation, `parallel_parts` in flight, each written into its slice of
        the buffer and retried alone; `consume` gets the slices in order as the prefix before
        them completes. A generation gone mid-read raises ObjectChanged (or ObjectNotFound
        if the object was deleted): never bytes of two generations."""
        _check_limit(max_bytes)
        if max_bytes is not None and max_bytes <= self.part_bytes:
            got = self._read_whole(key, max_bytes, consume)
            if got is None:
                raise ObjectNotFound(f"{self._where(key)} not found")
            view = memoryview(got[0])
            return view if writable else view.toreadonly()
        size, generation = self._run(
            "read", key, lambda: self._metadata(key), not_found=ObjectNotFound
        )
        if max_bytes is not None and size > max_bytes:
            raise _too_large(self._where(key), size, max_bytes)
        buf = memoryview(np.empty(size, np.uint8))  # large numpy buffers: huge-page backed
        bounds = [(a, min(a + self.part_bytes, size)) for a in range(0, size, self.part_bytes)]
        stop = threading.Event()
        pool = self._part_pool()
        futures = [
            pool.submit(self._part, key, generation, buf[a:b], a, size, stop) for a, b in bounds
        ]
        try:
            for (a, b), future in zip(bounds, futures, strict=True):
                future.result()
                if consume is not None:
                    consume(buf[a:b])
        except _GenerationGone:
            stop.set()
            raise self._changed(key, generation) from None
        finally:
            stop.set()  # after an error: parts not started yet stay unread
            for future in futures:
                future.cancel()
        return buf if writable else buf.toreadonly()

    def _part_pool(self) -> ThreadPoolExecutor:
        """The store's pool of ranged GETs: kept between reads (its threads keep their clients
        and connections), never across a fork (a child has the object, not its threads)."""
        with self._credentials_lock:
            if self._parts is None or self._parts_pid != os.getpid():
                self._parts = ThreadPoolExecutor(self.parallel_parts, thread_name_prefix="gcs-part")
                self._parts_pid = os.getpid()
            return self._parts

    def _metadata(self, key: str) -> tuple[int, int]:
        """One attempt: (size, generation) of the live object; ObjectNotFound if absent."""
        blob = (
            self._client()
            .bucket(self.bucket)
            .get_blob(self._name(key), retry=None, timeout=self.timeout)
        )
        if blob is None:
            raise ObjectNotFound(f"{self._where(key)} not found")
        size, generation = blob.size, blob.generation
        if not (isinstance(size, int) and size >= 0 and isinstance(generation, int)):
            raise CorruptObject(f"{self._where(key)}: metadata without a valid size or generation")
        return size, generation

    def _part(
        self,
        key: str,
        generation: int,
        view: memoryview,
        start: int,
        size: int,
        stop: threading.Event,
    ) -> None:
        """Bytes [start, start + len(view)) of `generation` into `view`, with retries."""
        if not stop.is_set():
            self._run("read", key, lambda: self._read_part(key, generation, view, start, size))

    def _read_part(
        self, key: str, generation: int, view: memoryview, start: int, size: int
    ) -> None:
        """One attempt, one ranged GET of `generation` (the request's `generation` parameter:
        a replaced object answers 404, never another generation's bytes). The answer must be
        exactly that range of an object of `size` bytes, of that generation; its bytes go
        into `view` as they arrive."""
        end = start + len(view) - 1
        response = self._get(key, generation, f"bytes={start}-{end}")
        try:
            if response.status_code == 404:
                raise _GenerationGone(f"{self._where(key)} generation {generation} is gone")
            if response.status_code >= 400:
                raise gexc.from_http_response(response)
            where = f"{self._where(key)} bytes {start}-{end}"
            served = _generation(response, where, required=False)
            if served is not None and served != generation:
                raise ObjectChanged(f"{where}: generation {served} served for {generation}")
            whole = start == 0 and end == size - 1 and response.status_code == 200
            ranged = f"bytes {start}-{end}/{size}"
            if not whole and (
                response.status_code != 206 or response.headers.get("Content-Range") != ranged
            ):
                raise CorruptObject(
                    f"{where}: answered HTTP {response.status_code} with range "
                    f"{response.headers.get('Content-Range')!r}, not {ranged!r}"
                )
            _refuse_encoded(response, where)
            _fill(response, view, where)
        finally:
            response.close()

    def _changed(self, key: str, generation: int) -> StoreError:
        """What a read of `generation` that met a 404 raises: ObjectNotFound (deleted),
        ObjectChanged (replaced)."""
        try:
            _, now = self._run("read", key, lambda: self._metadata(key), not_found=ObjectNotFound)
        except ObjectNotFound:
            return ObjectNotFound(f"{self._where(key)} was deleted while being read")
        if now == generation:
            return StoreError(
                f"{self._where(key)}: generation {generation} answered 404 yet exists"
            )
        return ObjectChanged(
            f"{self._where(key)} changed while being read (generation {generation}, now {now}); "
            "nothing of it is returned"
        )

    def write(self, key: str, data: bytes) -> None:
        self._run("write", key, lambda: self._upload(key, data, None))

    def write_stream(self, key: str, chunks: Callable[[], Iterable[Chunk]]) -> None:
        """A resumable upload fed chunk by chunk: at most STREAM_CHUNK bytes are buffered.
        Unconditional (streamed objects are payloads under unique names); the object appears
        only when the upload is finalized, so a failed attempt leaves nothing behind."""

        def attempt() -> None:
            blob = self._blob(key)
            with blob.open(
                "wb",
                chunk_size=STREAM_CHUNK,
                ignore_flush=True,
                content_type=self._content_type(key),
                retry=None,
                timeout=self.timeout,
            ) as f:
                for chunk in chunks():
                    f.write(chunk)

        self._run("write", key, attempt)

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

    def sizes(self, prefix: str) -> dict[str, int]:
        validate_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""

        def attempt() -> dict[str, int]:
            blobs = self._client().list_blobs(
                self.bucket, prefix=root + prefix, retry=None, timeout=self.timeout
            )
            return {
                b.name[len(root) :]: int(b.size or 0) for b in blobs if not b.name.endswith("/")
            }

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
            raise StoreConnectionError(
                f"cannot reach {self._endpoint()} for {self.url}: {one_line(exc)}"
            ) from exc
        except gexc.GoogleAPICallError as exc:
            raise StoreUnreachable(f"{self.url}: HTTP {exc.code} {exc.message}") from exc
