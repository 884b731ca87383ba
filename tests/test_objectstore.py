"""Object store semantics on memory://, file:// and gs:// (fake-gcs-server)."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from google.api_core import exceptions as gexc

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from training.store.gcs import GCSStore
from training.store.local import LocalStore
from training.store.memory import MemoryStore
from training.store.objectstore import (
    ObjectNotFound,
    ObjectTooLarge,
    StoreUnreachable,
    TransientStoreError,
    retry,
)
from training.store.registry import open_store

RACERS = 8


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    return open_backend(request.param, request, tmp_path)


# --- size limits on reads --------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1000])
def test_read_within_max_bytes_returns_the_whole_object(store, size):
    store.write("k", b"x" * size)
    assert store.read("k", max_bytes=size) == b"x" * size
    assert store.read_versioned("k", max_bytes=size)[0] == b"x" * size


def test_read_over_max_bytes_raises_object_too_large(store):
    store.write("k", b"x" * 1001)
    with pytest.raises(ObjectTooLarge, match="over the 1000-byte limit"):
        store.read("k", max_bytes=1000)


def test_read_versioned_over_max_bytes_raises_object_too_large(store):
    store.write("k", b"x" * 1001)
    with pytest.raises(ObjectTooLarge, match="over the 1000-byte limit"):
        store.read_versioned("k", max_bytes=1000)


def test_read_of_missing_key_with_max_bytes_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound):
        store.read("missing", max_bytes=10)
    assert store.read_versioned("missing", max_bytes=10) is None


def test_local_read_over_max_bytes_reads_nothing_of_the_file(tmp_path, monkeypatch):
    """The size is checked on the open file before any byte is read."""
    store = LocalStore(tmp_path)
    store.write("big", b"x" * 10_000)
    reads = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

    monkeypatch.setattr("builtins.open", lambda p, m="r", *a, **k: Spy(real_open(p, m, *a, **k)))
    with pytest.raises(ObjectTooLarge):
        store.read("big", max_bytes=100)
    assert reads == []


# --- basic reads and writes ------------------------------------------------------------------


def test_read_returns_what_write_wrote(store):
    store.write("a/b.bin", b"\x00payload\xff")
    assert store.read("a/b.bin") == b"\x00payload\xff"


def test_write_parts_and_read_buffer_round_trip(store):
    parts = [b"head", memoryview(b"er"), np.arange(5, dtype=np.uint8)]
    store.write_parts("a/parts", parts)
    buf = store.read_buffer("a/parts", max_bytes=11)
    assert bytes(buf) == b"header" + bytes(range(5)) and not buf.readonly
    with pytest.raises(ObjectTooLarge):
        store.read_buffer("a/parts", max_bytes=10)
    with pytest.raises(ObjectNotFound):
        store.read_buffer("a/missing")


def test_read_buffer_hands_consume_the_whole_object_in_order(store):
    store.write("a/obj", b"0123456789")
    pieces: list[bytes] = []
    buf = store.read_buffer("a/obj", max_bytes=10, consume=lambda v: pieces.append(bytes(v)))
    assert b"".join(pieces) == bytes(buf) == b"0123456789"


def test_read_of_missing_key_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound):
        store.read("missing/key")


def test_write_overwrites(store):
    store.write("k", b"old")
    store.write("k", b"new")
    assert store.read("k") == b"new"


def test_exists_reflects_write_and_delete(store):
    store.write("k", b"x")
    assert store.exists("k")
    store.delete("k")
    assert not store.exists("k")


def test_delete_of_missing_key_is_fine(store):
    store.delete("never/written")


# --- create-only and compare-and-swap ----------------------------------------------------------


def test_create_succeeds_once_and_keeps_first_content(store):
    assert store.create("marker.json", b"first") is True
    assert store.create("marker.json", b"second") is False
    assert store.read("marker.json") == b"first"


def test_read_versioned_of_missing_key_is_none(store):
    assert store.read_versioned("nothing") is None


def test_cas_from_current_generation_succeeds(store):
    store.write("head", b"v1")
    _, generation = store.read_versioned("head")
    assert store.compare_and_swap("head", b"v2", generation) is True
    assert store.read("head") == b"v2"


def test_cas_from_stale_generation_fails_and_keeps_content(store):
    store.write("head", b"v1")
    _, stale = store.read_versioned("head")
    store.write("head", b"v2")
    assert store.compare_and_swap("head", b"v3", stale) is False
    assert store.read("head") == b"v2"


def test_cas_expecting_absent_fails_when_key_exists(store):
    store.write("head", b"v1")
    assert store.compare_and_swap("head", b"v2", None) is False


def test_cas_expecting_absent_creates_missing_key(store):
    assert store.compare_and_swap("head", b"v1", None) is True
    assert store.read("head") == b"v1"


def test_cas_generation_is_the_new_read_versioned_generation(store):
    new_generation = store.compare_and_swap_generation("head", b"v1", None)
    assert store.read_versioned("head") == (b"v1", new_generation)


def test_generation_is_not_reused_after_delete_and_recreate(store):
    store.write("head", b"same")
    _, before = store.read_versioned("head")
    store.delete("head")
    store.write("head", b"same")
    assert store.compare_and_swap("head", b"next", before) is False


def test_cas_race_among_threads_has_exactly_one_winner(store):
    store.write("head", b"start")
    _, generation = store.read_versioned("head")
    barrier = threading.Barrier(RACERS)
    results: list[bool] = [False] * RACERS

    def racer(i: int) -> None:
        barrier.wait()
        results[i] = store.compare_and_swap("head", f"racer-{i}".encode(), generation)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1


# --- key validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/../b", "a\\b", "", "a/", "./a"])
def test_invalid_keys_are_rejected_before_any_write(store, key, tmp_path):
    with pytest.raises(ValueError):
        store.write(key, b"x")


def test_invalid_key_writes_nothing_outside_a_file_root(tmp_path):
    store = LocalStore(tmp_path / "root")
    with pytest.raises(ValueError):
        store.write("../escaped", b"x")
    assert not (tmp_path / "escaped").exists()


# --- listing -----------------------------------------------------------------------------------


def test_listing_sees_an_object_written_just_before(store):
    assert store.list("dir/") == []
    store.write("dir/new", b"x")
    assert store.list("dir/") == ["dir/new"]


def test_listing_no_longer_shows_a_deleted_object(store):
    store.write("dir/gone", b"x")
    store.list("dir/")
    store.delete("dir/gone")
    assert store.list("dir/") == []


def test_listing_is_recursive_sorted_and_limited_to_the_prefix(store):
    for key in ["p/b/2", "p/a", "p/b/1", "q/x", "px"]:
        store.write(key, b"x")
    assert store.list("p/") == ["p/a", "p/b/1", "p/b/2"]


def test_listing_prefix_is_a_plain_string_prefix(store):
    for key in ["island-1/a", "island-10/b", "other/c"]:
        store.write(key, b"x")
    assert store.list("island-1") == ["island-1/a", "island-10/b"]


def test_local_listing_hides_sidecar_and_temp_files(tmp_path):
    store = LocalStore(tmp_path)
    store.write("d/k", b"1")
    store.compare_and_swap("d/k", b"2", store.read_versioned("d/k")[1])
    assert store.list("") == ["d/k"]


# --- compare-and-swap across processes (file://) ---------------------------------------------


ROUNDS = 30


def _cas_racer(url: str, generations: list[int], index: int, barrier, results) -> None:
    store = open_store(url)
    for round_, generation in enumerate(generations):
        barrier.wait()
        won = store.compare_and_swap(f"head-{round_}", f"racer-{index}".encode(), generation)
        results.put((round_, index, won))


def test_cas_race_among_processes_has_exactly_one_winner(tmp_path):
    url = f"file://{tmp_path}"
    store = open_store(url)
    generations = []
    for round_ in range(ROUNDS):
        store.write(f"head-{round_}", b"start")
        generations.append(store.read_versioned(f"head-{round_}")[1])
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [
        ctx.Process(target=_cas_racer, args=(url, generations, i, barrier, results))
        for i in range(RACERS)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=30) for _ in range(RACERS * ROUNDS)]
    for p in procs:
        p.join(timeout=30)
    winners = {r: [i for r2, i, won in outcomes if r2 == r and won] for r in range(ROUNDS)}
    assert all(
        len(w) == 1 and store.read(f"head-{r}") == f"racer-{w[0]}".encode()
        for r, w in winners.items()
    ), winners


def _incrementer(url: str, times: int) -> None:
    store = open_store(url)
    for _ in range(times):
        while True:
            data, generation = store.read_versioned("counter")
            if store.compare_and_swap("counter", str(int(data) + 1).encode(), generation):
                break


def test_cas_increments_from_many_processes_lose_no_update(tmp_path):
    url = f"file://{tmp_path}"
    open_store(url).write("counter", b"0")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_incrementer, args=(url, 15)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
    assert open_store(url).read("counter") == b"60"


# --- open_store --------------------------------------------------------------------------------


def test_open_store_normalizes_plain_paths_to_file_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store("runs/x")
    assert isinstance(store, LocalStore) and store.url == f"file://{tmp_path}/runs/x"


def test_open_store_parses_gs_bucket_and_prefix():
    store = open_store("gs://my-bucket/some/prefix/")
    assert isinstance(store, GCSStore) and (store.bucket, store.prefix) == (
        "my-bucket",
        "some/prefix",
    )


def test_open_store_memory_urls_with_one_name_share_objects():
    open_store("memory://shared-name-test").write("k", b"v")
    store = open_store("memory://shared-name-test")
    assert isinstance(store, MemoryStore) and store.read("k") == b"v"


@pytest.mark.parametrize("url", ["s3://bucket/x", "file://relative/path"])
def test_open_store_rejects_unsupported_urls(url):
    with pytest.raises(ValueError):
        open_store(url)


# --- check() -----------------------------------------------------------------------------------


def test_check_passes_on_a_usable_store(store):
    store.check()


def test_check_on_unreachable_gs_endpoint_fails_after_a_short_backoff_at_most(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again once the block ends: connection refused
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    # The clients' retry loops back off through time.sleep. Count this thread's naps only: a
    # daemon thread left by an earlier test (a retry loop of its own) may sleep meanwhile, and
    # CI once counted its 18 s of backoff here.
    naps: list[float] = []
    me, real_sleep = threading.get_ident(), time.sleep

    def nap(seconds: float) -> None:
        if threading.get_ident() == me:
            naps.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", nap)
    with pytest.raises(StoreUnreachable, match="cannot reach"):
        open_store("gs://bucket/x").check()
    assert sum(naps) < 5  # at most a short backoff (counted, not waited): no retry loop


@pytest.mark.integration
@pytest.mark.usefixtures("gcs_bucket")
def test_check_on_missing_gs_bucket_raises_store_unreachable():
    with pytest.raises(StoreUnreachable, match="does not exist"):
        open_store("gs://no-such-bucket/x").check()


def test_check_on_unwritable_local_root_fails(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreUnreachable):
        LocalStore(tmp_path / "file" / "root").check()


# --- retries -----------------------------------------------------------------------------------


def test_retry_retries_a_transient_error_then_returns():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise gexc.ServiceUnavailable("try again")
        return "ok"

    assert retry(flaky, base=0.001) == "ok" and len(calls) == 2


def test_retry_does_not_retry_a_permanent_error():
    calls = []

    def forbidden():
        calls.append(1)
        raise gexc.Forbidden("no")

    with pytest.raises(gexc.Forbidden):
        retry(forbidden, base=0.001)
    assert len(calls) == 1


def test_retry_gives_up_with_transient_store_error():
    def down():
        raise requests.ConnectionError("refused")

    with pytest.raises(TransientStoreError, match="after 3 attempts"):
        retry(down, attempts=3, base=0.001)


@pytest.mark.integration
def test_gs_create_retried_after_a_lost_response_reports_created(request, tmp_path, monkeypatch):
    store = open_backend("gs", request, tmp_path)
    real_upload, calls = GCSStore._upload, []

    def upload_then_lose_response(self, key, data, match):
        calls.append(key)
        generation = real_upload(self, key, data, match)
        if len(calls) == 1:
            raise requests.ConnectionError("response lost")
        return generation

    monkeypatch.setattr(GCSStore, "_upload", upload_then_lose_response)
    assert store.create("marker.json", b"mine") is True and len(calls) == 2


def test_local_store_files_are_plain_files_under_the_root(tmp_path):
    LocalStore(tmp_path).write("exp/config.json", b"{}")
    assert Path(tmp_path / "exp" / "config.json").read_bytes() == b"{}"


def test_a_file_store_never_imports_the_google_client_libraries(tmp_path):
    """file:// users load no Google client library: the GCS backend is imported only by
    open_store("gs://...") (training/store/gcs.py)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from training.store.experiment import ExperimentStore\n"
        "from training.store.registry import open_store\n"
        f"store = ExperimentStore(open_store('file://{tmp_path}/s'), 'e')\n"
        "store.write_config({'name': 'e'})\n"
        "store.read_config()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'google'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_write_stream_stores_the_chunks_and_a_retry_streams_from_the_start(store):
    attempts = []

    def chunks():
        attempts.append(1)
        yield b"head-"
        yield memoryview(np.arange(4, dtype=np.uint8))
        if len(attempts) == 1 and not isinstance(store, MemoryStore):
            raise ConnectionError("the connection broke mid-stream")  # transient: retried
        yield b"-tail"

    store.write_stream("big/obj", chunks)
    assert store.read("big/obj") == b"head-\x00\x01\x02\x03-tail"
    assert len(attempts) == (1 if isinstance(store, MemoryStore) else 2)
