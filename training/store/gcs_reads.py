"""The read path of gs:// (`GCSStore`'s reads, a mixin): a small object in one lean GET straight
into its buffer, a large one as concurrent ranged GETs pinned to one generation, crc32c checked
as the bytes arrive (docs/STORE.md, "Large reads")."""

from __future__ import annotations

import base64
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

import numpy as np
import requests
from google.api_core import exceptions as gexc

from training.store.objectstore import (
    Consume,
    CorruptObject,
    ObjectChanged,
    ObjectNotFound,
    StoreError,
    _check_limit,
    _too_large,
    is_transient,
)

RANGE_PART = 32 * 2**20
"""Bytes per ranged GET of a large object's read (`GCSStore.read_buffer`); an object of at
most one part is one GET. 32 MiB is google-cloud-storage's transfer_manager default chunk:
at a stream's ~200 MiB/s a part is ~160 ms, against tens of ms to the first byte."""
RANGE_PARALLEL = 8
"""Ranged GETs in flight per store (transfer_manager's default worker count): one stream
reaches ~200 MiB/s, parallel streams many times that (docs/BENCHMARKS.md, "Merge fetch")."""
_RANGE_READ = 2**20  # bytes per socket read of a part into the buffer


class _GenerationGone(StoreError):
    """A ranged GET of a pinned generation answered 404 (`read_buffer` says why: _changed)."""


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


class GCSReads:
    """`read`, `read_buffer` and their helpers, for `GCSStore` (training/store/gcs.py), whose
    `_run`, `_client`, `_name`, `_where`, `bucket`, `timeout`, `part_bytes`,
    `parallel_parts` and `_credentials_lock` they use."""

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
        into: Callable[[int], memoryview] | None = None,
    ) -> memoryview:
        """The object in one new buffer (or `into(size)`, read in parts). Under a limit of at most one part it is one GET, as
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
        # large numpy buffers: huge-page backed
        buf = memoryview(np.empty(size, np.uint8)) if into is None else into(size)
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
