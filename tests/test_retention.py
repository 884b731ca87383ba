"""Garbage collection: ExperimentStore.plan_gc / collect_garbage and the maintenance wrapper."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_airflow import retention

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from training.store.experiment import ExperimentStore
from training.store.objectstore import ObjectNotFound

HEAD = 8
KEEP_LAST = 3


def _params(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 4), version, np.float32)}


@pytest.fixture(params=BACKENDS)
def exp(request, tmp_path) -> ExperimentStore:
    """Versions 0..8, each (but 0) applying one pseudo-gradient of `a` and one of `b`; a lost
    race (an orphan directory of version 3); an orphan payload; b's heartbeat based on version
    2; a's checkpoints at steps 10, 20, 30, the latest based on version 3."""
    store = ExperimentStore(open_backend(request.param, request, tmp_path), "gc")
    store.write_config({"name": "gc"})
    head = store.publish_global(0, _params(0), {}, expected=None)
    stale = None
    for v in range(1, HEAD + 1):
        ids = []
        for island in ("a", "b"):
            ref = store.publish_pseudograd(
                island, v - 1, 0, {"d": np.ones(3, np.float32)}, {"base_version": v - 1}
            )
            ids.append(ref.id)
        if v == 3:
            stale = head
        head = store.publish_global(v, _params(v), {}, applied=ids, expected=head)
    assert store.publish_global(3, _params(-1), {}, expected=stale) is None  # lost race
    store.store.write("gc/pseudograds/a/00000007-f000-deadbeef.safetensors", b"orphan")
    store.write_heartbeat("b", {"base_version": 2, "time": 0.0})
    for step in (10, 20, 30):
        store.save_checkpoint(
            "a", step, {"x": np.zeros(2, np.float32)}, {"base_version": [3], "seq": step}
        )
    return store


def _keys(store: ExperimentStore) -> list[str]:
    return store.store.list("gc/")


def test_plan_keeps_head_window_first_and_every_base(exp):
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    assert plan.head == HEAD
    assert plan.protected == [0, 2, 3, 6, 7, 8]
    assert plan.versions == [1, 4, 5]
    assert len(plan.orphan_dirs) == 1 and plan.orphan_dirs[0].startswith("global/v00000003-")
    # merged in versions 1..5 (outside the window 6..8): seq 0..4 of both islands
    assert plan.pseudograds == [f"{i}/{s:08d}-f000" for i in ("a", "b") for s in range(5)]
    assert plan.orphan_payloads == ["pseudograds/a/00000007-f000-deadbeef.safetensors"]
    assert [d.split("/c")[1][:10] for d in plan.checkpoints] == ["0000000010", "0000000020"]


def test_dry_run_deletes_nothing(exp):
    before = _keys(exp)
    report = retention.collect(exp, keep_last=KEEP_LAST, dry_run=True)
    assert report["dry_run"] and report["deleted"] == {}
    assert report["versions"] == [1, 4, 5]
    assert _keys(exp) == before


def test_collect_deletes_only_unreferenced(exp):
    applied_before = exp.applied()
    report = retention.collect(exp, keep_last=KEEP_LAST, dry_run=False)
    assert report["deleted"] == {
        "versions": 3,
        "orphan_dirs": 1,
        "pseudograds": 10,
        "orphan_payloads": 1,
        "checkpoints": 2,
    }
    # HEAD's chain and its applied lists stay readable; collected versions say so on load
    versions = exp.list_global_versions()
    assert [m["version"] for m in versions] == list(range(HEAD + 1))
    for v in range(HEAD + 1):
        pointer = exp.find_version(v)
        if v in (1, 4, 5):
            with pytest.raises(ObjectNotFound, match="garbage-collected"):
                exp.load_global(pointer)
        else:
            assert float(exp.load_global(pointer).params["w"][0, 0]) == v
    v3 = exp.find_version(3).dir  # the lost race's directory of version 3 is gone
    assert {k.rsplit("/", 1)[0] for k in _keys(exp) if "/global/v00000003-" in k} == {f"gc/{v3}"}
    # the ledger is untouched: a deleted pseudo-gradient stays applied, a replay is not pending
    assert exp.applied() == applied_before
    remaining = {r.id for r in exp.list_pseudograds()}
    assert remaining == {f"{i}/{s:08d}-f000" for i in ("a", "b") for s in range(5, HEAD)}
    assert not [k for k in _keys(exp) if "deadbeef" in k]
    exp.publish_pseudograd("a", 0, 0, {"d": np.ones(3, np.float32)}, {"base_version": 0})
    from diloco_airflow.hooks import pending_pseudograds

    assert pending_pseudograds(exp) == []
    # checkpoints: only the latest is left, and it loads
    assert [k.split("/")[3][:11] for k in _keys(exp) if k.startswith("gc/checkpoints/a/c")] == [
        "c0000000030",
        "c0000000030",
    ]
    assert exp.load_checkpoint("a")[1]["step"] == 30
    # a second run deletes only the replayed (already merged) pseudo-gradient, a third nothing
    again = retention.collect(exp, keep_last=KEEP_LAST, dry_run=False)
    assert again["pseudograds"] == ["a/00000000-f000"]
    assert sum(again["deleted"].values()) == again["deleted"]["pseudograds"] == 1
    assert exp.plan_gc(keep_last=KEEP_LAST).empty


def test_helpers_refuse_head_referenced_and_unmerged(exp):
    with pytest.raises(ValueError, match="HEAD or protected"):
        exp.delete_global_version(HEAD)
    with pytest.raises(ValueError, match="still referenced"):
        exp.delete_global_version(2)  # b's heartbeat bases on it
    with pytest.raises(ValueError, match="still referenced"):
        exp.delete_global_version(3)  # a's latest checkpoint bases on it
    with pytest.raises(ValueError, match="HEAD or protected"):
        exp.delete_global_version(1, protected={1})
    with pytest.raises(ObjectNotFound):
        exp.delete_global_version(HEAD + 5)
    assert exp.delete_global_version(1) is True
    assert exp.delete_global_version(1) is False  # nothing left: a repeat is fine
    unmerged = exp.publish_pseudograd("a", 100, 0, {"d": np.ones(3, np.float32)}, {})
    with pytest.raises(ValueError, match="not merged"):
        exp.delete_pseudograd(unmerged)
    assert exp.delete_pseudograd("a/00000000-f000") == 2  # marker + payload
    assert exp.delete_pseudograd("a/00000000-f000") == 0


def test_plan_on_an_empty_experiment(tmp_path):
    from training.store.objectstore import open_store

    store = ExperimentStore(open_store(f"file://{tmp_path}/s"), "gc")
    plan = store.plan_gc()
    assert plan.empty and plan.head is None
    with pytest.raises(ValueError):
        store.plan_gc(keep_last=0)


def test_collect_all_reports_errors_per_experiment(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/s"
    from training.store.objectstore import open_store

    good = ExperimentStore(open_store(url), "good")
    good.publish_global(0, _params(0), {}, expected=None)
    monkeypatch.setenv("DILOCO_GC_DRY_RUN", "1")
    out = retention.collect_all(
        [{"store_url": url, "experiment": "good"}, {"store_url": "nope://x", "experiment": "bad"}]
    )
    assert out[0]["experiment"] == "good" and out[0]["dry_run"] is True
    assert out[1]["experiment"] == "bad" and "error" in out[1]
