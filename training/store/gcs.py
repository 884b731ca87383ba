"""gs://bucket[/prefix] through google-cloud-storage, with generation preconditions (see the
class docstring and docs/STORE.md)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

import requests
import urllib3.exceptions
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc

from training.store.gcs_reads import RANGE_PARALLEL, RANGE_PART, GCSReads
from training.store.objectstore import (
    Chunk,
    Generation,
    ObjectNotFound,
    ObjectStore,
    StoreConnectionError,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
    _check_limit,
    one_line,
    register_transient,
    retry,
    validate_key,
    validate_prefix,
)

T = TypeVar("T")


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


class GCSStore(GCSReads, ObjectStore):
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
