"""A merge's time and memory stay bounded whatever the bucket holds (issue 8, "Resource limits").

A file:// experiment gets N junk objects (names outside the layout, markers that are garbage,
deep JSON, broken heartbeats, chaos metrics) and four 1 GiB objects (sparse files: no disk
used, but a whole read would allocate 1 GiB): a payload whose manifest declares 1 GiB, a
payload grown to 1 GiB after its commit, a 1 GiB marker and a 1 GiB heartbeat. Two merges
run next to two honest contributions; the peak of Python allocations (tracemalloc, which sees
numpy buffers and bytes) and the wall time of each are measured. The fast test plants 1,000
objects and asserts loose bounds; the slow one plants 10,000 and prints the numbers for
docs/STORE.md ("Threat model").
"""

from __future__ import annotations

import os
import time
import tracemalloc

import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.merge.merger import Merger
from training.store.safejson import dump_json

GIB = 2**30


def _sparse(path: os.PathLike, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def _plant(root, store, n_junk: int) -> dict[str, int]:
    """Write n_junk junk objects and the four 1 GiB ones straight into the store's directory
    (as a hostile island with write access would); returns counts by kind."""
    base = root / store.experiment
    counts = dict(junk_names=0, bad_markers=0, heartbeats=0, metrics=0)
    for i in range(n_junk):
        kind = i % 10
        if kind < 5:  # names outside the layout, under island a's prefix
            rel, counts["junk_names"] = f"pseudograds/a/junk-{i:06d}.json", counts["junk_names"] + 1
            data = b"{}"
        elif kind < 8:  # markers with valid names: garbage or deep JSON (quarantined)
            rel = f"pseudograds/a/{10_000 + i:08d}-f000.json"
            data = b"[" * 3000 + b"]" * 3000 if kind == 5 else os.urandom(64)
            counts["bad_markers"] += 1
        elif kind == 8:  # chaos metrics islands may write
            rel = f"metrics/chaos/{i:020d}-0123abcd.json"
            data, counts["metrics"] = b'{"a":' * 2000, counts["metrics"] + 1
        else:  # heartbeats of names outside the layout
            rel, counts["heartbeats"] = f"heartbeats/A{i}.json", counts["heartbeats"] + 1
            data = b"x"
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    # 1: a manifest declaring a 1 GiB payload (consistent otherwise); refused before any read
    payload = "pseudograds/a/00000001-f000-0123abcd.safetensors"
    _sparse(base / payload, GIB)
    manifest = dict(
        experiment=store.experiment,
        island="a",
        seq=1,
        fragment=0,
        payload=payload,
        nbytes=GIB,
        sha256="0" * 64,
        created_at=0.0,
        base_version=0,
        steps=4,
        tokens=512,
        codec="fp32",
        published_at=1.0,
    )
    (base / "pseudograds/a/00000001-f000.json").write_bytes(dump_json(manifest))
    # 2: a payload grown to 1 GiB after its commit (the manifest says 100 bytes)
    grown = "pseudograds/a/00000002-f000-0123abcd.safetensors"
    _sparse(base / grown, GIB)
    small = dict(manifest, seq=2, payload=grown, nbytes=100, published_at=2.0)
    (base / "pseudograds/a/00000002-f000.json").write_bytes(dump_json(small))
    # 3: a 1 GiB marker; 4: a 1 GiB heartbeat
    _sparse(base / "pseudograds/a/00000003-f000.json", GIB)
    _sparse(base / "heartbeats/a.json", GIB)
    return counts


def _measure(fn):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        result = fn()
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, seconds, peak


def _scenario(tmp_path, n_junk: int):
    root = tmp_path / "store"
    cfg = small_config(islands=("a", "b", "c"), outer={"method": "nesterov"})
    store = new_store(cfg, f"file://{root}")
    theta = store.load_params()
    counts = _plant(root, store, n_junk)
    for island in ("b", "c"):
        publish_delta(store, cfg, island, 0, random_delta(theta, ord(island)))
    first, t1, peak1 = _measure(lambda: Merger(cfg, store).merge_once())
    assert sorted(first.applied) == ["b/00000000-f000", "c/00000000-f000"]
    quarantined = counts["bad_markers"] + 3
    assert len(first.quarantined) == quarantined
    assert first.skipped >= counts["junk_names"] + counts["heartbeats"]
    for island in ("b", "c"):
        publish_delta(store, cfg, island, 1, random_delta(theta, 7 * ord(island)), base_version=1)
    second, t2, peak2 = _measure(lambda: Merger(cfg, store).merge_once())
    assert sorted(second.applied) == ["b/00000001-f000", "c/00000001-f000"]
    assert second.quarantined == {}
    line = (
        f"{n_junk} junk + 4 x 1 GiB: first merge {t1:.1f} s, peak {peak1 / 2**20:.1f} MiB "
        f"({len(first.quarantined)} quarantined, {first.skipped} skipped); second merge "
        f"{t2:.1f} s, peak {peak2 / 2**20:.1f} MiB"
    )
    print(line)
    return t1, peak1, t2, peak2


def test_a_merge_next_to_1000_junk_objects_and_four_1_gib_ones_stays_small(tmp_path):
    t1, peak1, t2, peak2 = _scenario(tmp_path, 1000)
    assert max(peak1, peak2) < 64 * 2**20  # a whole 1 GiB read would show here
    assert t1 < 120 and t2 < 60


@pytest.mark.slow
def test_a_merge_next_to_10000_junk_objects_and_four_1_gib_ones_stays_small(tmp_path):
    t1, peak1, t2, peak2 = _scenario(tmp_path, 10_000)
    assert max(peak1, peak2) < 128 * 2**20
    assert t1 < 600 and t2 < 300
