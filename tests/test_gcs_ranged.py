"""Large reads on gs:// (fake-gcs-server): ranged GETs into one buffer, one generation.

Each store here reads in parts of PART = 1 MiB, 4 in flight; the object is SIZE = 5.5 MiB, so
a read is ceil(5.5) = 6 ranged GETs (5 whole parts and half of one).
"""

from __future__ import annotations

import hashlib
import threading
import uuid

import numpy as np
import pytest
import requests

from tests.gcs_fixture import BUCKET, gcs_bucket, ignore_range  # noqa: F401
from training.store.gcs import GCSStore
from training.store.objectstore import (
    CorruptObject,
    ObjectChanged,
    ObjectNotFound,
    ObjectTooLarge,
)

pytestmark = pytest.mark.integration

PART = 2**20
SIZE = 5 * PART + PART // 2  # 5,767,168 bytes: ceil(SIZE / PART) = 6 parts
KEY = "f/params.safetensors"


@pytest.fixture
def store(gcs_bucket):  # noqa: F811
    return GCSStore(BUCKET, f"ranged-{uuid.uuid4().hex[:12]}", part_bytes=PART, parallel_parts=4)


@pytest.fixture
def payload(store) -> bytes:
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    store.write(KEY, data)
    return data


class Parts:
    """Wraps the store's one-attempt ranged GET: counts them, may act before one."""

    def __init__(self, store: GCSStore, before=None):
        self.real = store._read_part
        self.starts: list[int] = []
        self.before = before
        self.lock = threading.Lock()
        store._read_part = self

    def __call__(self, key, generation, view, start, size):
        with self.lock:
            self.starts.append(start)
            n = len(self.starts)
        if self.before is not None:
            self.before(n, start)
        return self.real(key, generation, view, start, size)


def test_ranged_read_returns_the_bytes_written(store, payload):
    got = store.read_buffer(KEY, max_bytes=SIZE)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()


def test_ranged_read_is_one_get_per_part(store, payload):
    parts = Parts(store)
    store.read_buffer(KEY, max_bytes=SIZE)
    # parts start at 0, 1, 2, 3, 4 and 5 MiB: ceil(5.5 MiB / 1 MiB) = 6 GETs
    assert sorted(parts.starts) == [i * PART for i in range(6)]


def test_read_under_a_one_part_limit_is_one_whole_get(store):
    store.write("small", b"x" * 1000)
    parts = Parts(store)
    assert bytes(store.read_buffer("small", max_bytes=PART)) == b"x" * 1000
    assert parts.starts == []  # the one GET of `_read_whole` (tests/test_gcs_small.py), no part


def test_ranged_read_without_limit_of_a_small_object_is_one_part(store):
    store.write("small", b"x" * 1000)
    parts = Parts(store)
    assert bytes(store.read_buffer("small")) == b"x" * 1000
    assert parts.starts == [0]


def test_ranged_read_without_limit_of_an_empty_object_is_no_part(store):
    store.write("empty", b"")
    parts = Parts(store)
    assert bytes(store.read_buffer("empty")) == b""
    assert parts.starts == []  # 0 bytes: ceil(0 / PART) = 0 GETs


def test_a_part_failing_once_is_retried_alone(store, payload):
    def fail_third_part_once(n, start):
        if start == 2 * PART and not failed:
            failed.append(start)
            raise requests.ConnectionError("injected: connection reset")

    failed: list[int] = []
    parts = Parts(store, fail_third_part_once)
    got = store.read_buffer(KEY, max_bytes=SIZE)
    assert bytes(got) == payload
    # 6 parts + 1 retry of the part at 2 MiB: 7 GETs, 2 of them at 2 MiB
    assert sorted(parts.starts) == sorted([i * PART for i in range(6)] + [2 * PART])


def test_object_replaced_mid_read_raises_object_changed(store, payload):
    def replace_before_first_part(n, start):
        if n == 1:
            store.write(KEY, b"y" * SIZE)

    Parts(store, replace_before_first_part)
    with pytest.raises(ObjectChanged, match="changed while being read"):
        store.read_buffer(KEY, max_bytes=SIZE)


def test_object_deleted_mid_read_raises_object_not_found(store, payload):
    def delete_before_first_part(n, start):
        if n == 1:
            store.delete(KEY)

    Parts(store, delete_before_first_part)
    with pytest.raises(ObjectNotFound, match="deleted while being read"):
        store.read_buffer(KEY, max_bytes=SIZE)


def test_a_range_answered_with_the_whole_object_is_refused(store, payload, monkeypatch):
    """A server that ignores Range answers 200 with all SIZE bytes: not the part asked for."""
    ignore_range(monkeypatch)
    with pytest.raises(CorruptObject, match="answered HTTP 200"):
        store.read_buffer(KEY, max_bytes=SIZE)


def test_object_over_max_bytes_is_refused_before_any_part(store, payload):
    parts = Parts(store)
    with pytest.raises(ObjectTooLarge, match=f"{SIZE} bytes, over the {SIZE - 1}-byte limit"):
        store.read_buffer(KEY, max_bytes=SIZE - 1)
    assert parts.starts == []


def test_consume_gets_the_parts_in_order(store, payload):
    pieces: list[bytes] = []
    got = store.read_buffer(KEY, max_bytes=SIZE, consume=lambda v: pieces.append(bytes(v)))
    # 5 parts of 1 MiB, then the last half part, in order, together the object
    assert [len(p) for p in pieces] == [PART] * 5 + [PART // 2]
    assert b"".join(pieces) == bytes(got) == payload


def test_read_only_buffer_when_not_writable(store, payload):
    assert store.read_buffer(KEY, max_bytes=SIZE, writable=False).readonly


def test_verified_tensors_read_in_parts_check_their_crc32c(store):
    from training.store.experiment import ExperimentStore
    from training.store.tensors import checksum, encode_tensors

    # 1.5M float32 = 6,000,000 bytes (+ a header of tens of bytes) = 5.7 MiB: 6 parts
    tensors = {"w": np.arange(1_500_000, dtype=np.float32)}
    data = encode_tensors(tensors)
    store.write("exp/p.safetensors", data)
    exp = ExperimentStore(store, "exp")
    crc = checksum([data])
    got = exp.read_verified_tensors("p.safetensors", ("crc32c", crc), len(data), "test")
    assert np.array_equal(got["w"], tensors["w"])
    wrong = f"{int(crc, 16) ^ 1:08x}"
    with pytest.raises(CorruptObject, match="fails its crc32c checksum"):
        exp.read_verified_tensors("p.safetensors", ("crc32c", wrong), len(data), "test")


def test_fetch_bench_large_rows_time_whole_and_ranged_reads(gcs_bucket):  # noqa: F811
    from training.bench.fetch import large_rows

    rows = large_rows(gcs_bucket, 3.0, [1.0], [1, 2], repeats=1)
    # the whole GET, 1 MiB parts 1 and 2 at a time, the last with the crc32c after the read;
    # each read's crc32c was checked
    assert [(r["mode"], r["part_mb"], r["parallel"]) for r in rows] == [
        ("whole GET", None, 1),
        ("ranged", 1.0, 1),
        ("ranged", 1.0, 2),
        ("ranged, crc after", 1.0, 2),
    ]
