"""Small reads on gs:// (fake-gcs-server): one GET, straight into one buffer.

An object of at most one part (`part_bytes`, 32 MiB by default) under a limit of at most one
part is one GET of bytes [0, max_bytes] (training/store/gcs.py, `_read_whole`). Requests are
counted at `requests.Session.request`, which every HTTP request of the client goes through
(metadata requests included). The object here is SIZE = 2.5 MiB: read from the socket 1 MiB at
a time, that is pieces of 1, 1 and 0.5 MiB.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import requests
import urllib3.exceptions

from tests.gcs_fixture import BUCKET, gcs_bucket, ignore_range  # noqa: F401
from training.store.gcs import GCSStore
from training.store.objectstore import (
    CorruptObject,
    ObjectChanged,
    ObjectNotFound,
    ObjectTooLarge,
)

pytestmark = pytest.mark.integration

MIB = 2**20
SIZE = 2 * MIB + MIB // 2  # 2,621,440 bytes, under one 32 MiB part
LIMIT = 4 * MIB
KEY = "f/contribution.safetensors"


@pytest.fixture
def store(gcs_bucket):  # noqa: F811
    return GCSStore(BUCKET, f"small-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def payload(store) -> bytes:
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    store.write(KEY, data)
    return data


class Requests:
    """Counts the client's HTTP requests (their Range headers); `answer` may act on one."""

    def __init__(self, monkeypatch, answer=None):
        self.ranges: list[str | None] = []
        real = requests.Session.request
        outer = self

        def request(self, method, url, **kwargs):
            outer.ranges.append((kwargs.get("headers") or {}).get("Range"))
            if answer is not None:
                return answer(len(outer.ranges), lambda: real(self, method, url, **kwargs))
            return real(self, method, url, **kwargs)

        monkeypatch.setattr(requests.Session, "request", request)


def test_small_read_returns_the_bytes_written(store, payload):
    assert bytes(store.read_buffer(KEY, max_bytes=LIMIT)) == payload


def test_small_read_is_one_request_of_max_bytes_plus_one(store, payload, monkeypatch):
    sent = Requests(monkeypatch)
    store.read_buffer(KEY, max_bytes=LIMIT)
    # one GET of bytes 0..LIMIT (4,194,305 bytes at most), no metadata request
    assert sent.ranges == [f"bytes=0-{LIMIT}"]


def test_read_versioned_is_one_request(store, payload, monkeypatch):
    sent = Requests(monkeypatch)
    store.read_versioned(KEY, max_bytes=LIMIT)
    # the generation comes from the answer's X-Goog-Generation, not a second request
    assert len(sent.ranges) == 1


def test_consume_gets_the_bytes_as_they_arrive(store, payload):
    pieces: list[int] = []
    store.read_buffer(KEY, max_bytes=LIMIT, consume=lambda v: pieces.append(len(v)))
    # 2.5 MiB read from the socket 1 MiB at a time: 1 MiB, 1 MiB, 0.5 MiB
    assert pieces == [MIB, MIB, MIB // 2]


def test_object_over_max_bytes_is_refused_with_its_size(store, payload):
    # the size comes from the answer's Content-Range "bytes 0-(SIZE - 2)/SIZE"
    with pytest.raises(ObjectTooLarge, match=f"is {SIZE} bytes, over the {SIZE - 1}-byte limit"):
        store.read_buffer(KEY, max_bytes=SIZE - 1)


def test_whole_answer_over_max_bytes_is_refused(store, payload, monkeypatch):
    """A server that ignores Range answers 200 with all SIZE bytes: its length is over."""
    ignore_range(monkeypatch)
    with pytest.raises(ObjectTooLarge, match=f"is {SIZE} bytes, over the {SIZE - 1}-byte limit"):
        store.read_buffer(KEY, max_bytes=SIZE - 1)


def test_empty_object_is_one_request(store, monkeypatch):
    store.write("empty", b"")
    sent = Requests(monkeypatch)
    got = store.read_buffer("empty", max_bytes=10)
    # byte 0 of an empty object answers 416 with its generation: b"", nothing else asked
    assert (bytes(got), len(sent.ranges)) == (b"", 1)


def test_missing_object_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound):
        store.read_buffer("missing", max_bytes=10)


def test_a_failed_request_is_retried_once(store, payload, monkeypatch):
    def fail_first(n, send):
        if n == 1:
            raise requests.ConnectionError("injected: connection refused")
        return send()

    sent = Requests(monkeypatch, fail_first)
    got = store.read_buffer(KEY, max_bytes=LIMIT)
    # the failed GET and its retry: 2 requests, the same range, the exact bytes
    assert (bytes(got), sent.ranges) == (payload, [f"bytes=0-{LIMIT}"] * 2)


def _break_after_first_read(response):
    """The body of `response` fails (connection reset) after its first 1 MiB read."""
    real_read = response.raw.read
    reads = []

    def read(*args, **kwargs):
        reads.append(1)
        if len(reads) == 2:
            raise urllib3.exceptions.ProtocolError("injected: connection reset")
        return real_read(*args, **kwargs)

    response.raw.read = read
    return response


def test_a_body_broken_off_is_resumed_as_one_range(store, payload, monkeypatch):
    def break_first(n, send):
        return _break_after_first_read(send()) if n == 1 else send()

    sent = Requests(monkeypatch, break_first)
    pieces: list[bytes] = []
    got = store.read_buffer(KEY, max_bytes=LIMIT, consume=lambda v: pieces.append(bytes(v)))
    # 1 MiB arrived, then the rest (bytes 1 MiB .. SIZE - 1) as one ranged GET; every byte
    # consumed once, in order
    assert (sent.ranges[1], b"".join(pieces), bytes(got)) == (
        f"bytes={MIB}-{SIZE - 1}",
        payload,
        payload,
    )


def test_object_replaced_before_the_resumed_range_raises_object_changed(
    store, payload, monkeypatch
):
    def break_then_replace(n, send):
        if n == 1:
            response = _break_after_first_read(send())
            store.write(KEY, b"y" * SIZE)  # a new generation before the rest is asked for
            return response
        return send()

    Requests(monkeypatch, break_then_replace)
    with pytest.raises(ObjectChanged, match="changed while being read"):
        store.read_buffer(KEY, max_bytes=LIMIT)


def test_unlimited_read_checks_the_stated_crc32c(store, payload, monkeypatch):
    def state_a_wrong_crc32c(n, send):
        response = send()
        response.headers["X-Goog-Hash"] = "crc32c=AAAAAA=="  # crc32c 0, not the payload's
        return response

    Requests(monkeypatch, state_a_wrong_crc32c)
    with pytest.raises(CorruptObject, match="fail the crc32c 00000000 stated"):
        store.read(KEY)
