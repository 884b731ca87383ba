"""Garbage collection: ExperimentStore.plan_gc / collect_garbage and the maintenance wrapper."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from diloco_airflow import retention

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from training.store.experiment import ExperimentStore
from training.store.objectstore import ObjectNotFound
from training.store.registry import open_store

HEADS = {0: 8, 1: 7}
KEEP_LAST = 3
COLLECTED = {0: [1, 4, 5], 1: [3, 4]}  # what the fixture's plan collects, per fragment
IN_FLIGHT = "fragments/f001/v00000008-0123abcd"


def _params(fragment: int, version: int) -> dict[str, np.ndarray]:
    return {f"f{fragment}/w": np.full((4, 4), version, np.float32)}


def _version(directory: str) -> tuple[int, int]:
    match = re.fullmatch(r"fragments/f(\d{3})/v(\d{8})-[0-9a-f]{8}", directory)
    return int(match[1]), int(match[2])


@pytest.fixture(params=BACKENDS)
def exp(request, tmp_path) -> ExperimentStore:
    """Two fragments: f0 at versions 0..8, f1 at 0..7; each version v > 0 of fragment p applies
    a/{v-1}-f{p} and b/{v-1}-f{p}. A lost race on f0 (an orphan directory of version 3); f1's
    version 8 in flight (payload only); an orphan payload; b's heartbeat based on [2, 1]; a's
    checkpoints at steps 10, 20 (based on [4, 3]; left unpruned) and 30, the latest, based on
    [3, 2]."""
    store = ExperimentStore(open_backend(request.param, request, tmp_path), "gc")
    store.write_config({"name": "gc", "fragments": {"count": 2}})
    stale = None
    for p, last in HEADS.items():
        head = store.publish_fragment(p, 0, _params(p, 0), {}, expected=None)
        for v in range(1, last + 1):
            ids = [
                store.publish_pseudograd(i, v - 1, p, {"d": np.ones(3, np.float32)}, {}).id
                for i in ("a", "b")
            ]
            stale = head if (p, v) == (0, 3) else stale
            head = store.publish_fragment(p, v, _params(p, v), {}, applied=ids, expected=head)
    assert store.publish_fragment(0, 3, _params(0, -1), {}, expected=stale) is None  # lost race
    store.store.write(f"gc/{IN_FLIGHT}/params.safetensors", b"in flight")
    store.store.write("gc/pseudograds/a/00000007-f000-deadbeef.safetensors", b"orphan")
    store.write_heartbeat("b", {"base_version": [2, 1], "time": 0.0})
    store.prune_checkpoints = lambda *_: 0  # a's process died before it pruned
    for step in (10, 20, 30):
        base = [3, 2] if step == 30 else [4, 3]
        store.save_checkpoint("a", step, {"x": np.zeros(2, np.float32)}, {"base_version": base})
    return store


def _keys(store: ExperimentStore) -> list[str]:
    return store.store.list("gc/")


def _merged_outside_the_window() -> list[str]:
    """f0's window is 6..8 (seqs 0..4 merged before it), f1's is 5..7 (seqs 0..3)."""
    last = {p: HEADS[p] - KEEP_LAST for p in HEADS}
    return sorted(f"{i}/{s:08d}-f{p:03d}" for p in HEADS for i in "ab" for s in range(last[p]))


def test_plan_protects_per_fragment_head_window_first_and_every_base(exp):
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    assert (plan.heads, plan.protected) == (HEADS, {0: [0, 2, 3, 6, 7, 8], 1: [0, 1, 2, 5, 6, 7]})


def test_plan_collects_the_unprotected_versions_of_each_fragment(exp):
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    assert [_version(d) for d in plan.versions] == [(p, v) for p in HEADS for v in COLLECTED[p]]


def test_plan_collects_lost_races_but_not_a_version_in_flight(exp):
    (orphan,) = exp.plan_gc(keep_last=KEEP_LAST).orphan_dirs
    assert _version(orphan) == (0, 3) and orphan != exp.find_version(0, 3).dir


def test_plan_collects_merged_pseudograds_outside_their_fragments_window(exp):
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    # a/00000004-f000 (applied in f0's v5) goes; a/00000004-f001 (in f1's v5) stays
    assert plan.pseudograds == _merged_outside_the_window()


def test_plan_collects_orphan_payloads_and_old_checkpoints(exp):
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    assert plan.orphan_payloads == ["pseudograds/a/00000007-f000-deadbeef.safetensors"]
    assert [d.split("/c")[1][:10] for d in plan.checkpoints] == ["0000000010", "0000000020"]


def test_plan_protects_the_best_snapshot(exp):
    dirs = [exp.find_version(0, 1).dir, exp.find_version(1, 3).dir]
    exp.offer_best({"loss": 1.0, "versions": [1, 3], "dirs": dirs})
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    assert [_version(d) for d in plan.versions] == [(0, 4), (0, 5), (1, 4)]


def test_plan_protects_the_final_snapshot(exp):
    # FINAL names f0 v4 and f1 v3: they leave COLLECTED's list (f0: 1, 4, 5; f1: 3, 4)
    dirs = [exp.find_version(0, 4).dir, exp.find_version(1, 3).dir]
    assert exp.record_final({"loss": 1.0, "versions": [4, 3], "dirs": dirs})
    plan = exp.plan_gc(keep_last=KEEP_LAST)
    assert [_version(d) for d in plan.versions] == [(0, 1), (0, 5), (1, 4)]


def test_final_is_written_once(exp):
    dirs = [exp.find_version(0, 4).dir, exp.find_version(1, 3).dir]
    assert exp.record_final({"loss": 1.0, "versions": [4, 3], "dirs": dirs})
    assert not exp.record_final({"loss": 0.5, "versions": [4, 3], "dirs": dirs})
    assert exp.final()["loss"] == 1.0


def test_dry_run_deletes_nothing_and_reports_json(exp):
    before = _keys(exp)
    report = retention.collect(exp, keep_last=KEEP_LAST, dry_run=True)
    assert report["dry_run"] and report["deleted"] == {}
    assert json.loads(json.dumps(report)) == report and report["heads"] == {"0": 8, "1": 7}
    assert [_version(d) for d in report["versions"]] == [(0, 1), (0, 4), (0, 5), (1, 3), (1, 4)]
    assert _keys(exp) == before


def test_collect_deletes_only_unreferenced(exp):
    applied_before = exp.applied()
    report = retention.collect(exp, keep_last=KEEP_LAST, dry_run=False)
    assert report["deleted"] == {
        "versions": 5,
        "orphan_dirs": 1,
        "pseudograds": 18,
        "orphan_payloads": 1,
        "checkpoints": 2,
    }
    assert json.loads(json.dumps(report)) == report
    # every chain and its applied lists stay readable; collected versions say so on load
    for p, head in HEADS.items():
        assert [m["version"] for m in exp.list_fragment_versions(p)] == list(range(head + 1))
        for v in range(head + 1):
            pointer = exp.find_version(p, v)
            if v in COLLECTED[p]:
                with pytest.raises(ObjectNotFound, match="garbage-collected"):
                    exp.load_fragment(pointer)
            else:
                assert float(exp.load_fragment(pointer).params[f"f{p}/w"][0, 0]) == v
    v3 = exp.find_version(0, 3).dir  # the lost race's directory of version 3 is gone
    dirs = {k.rsplit("/", 1)[0] for k in _keys(exp) if "/fragments/f000/v00000003-" in k}
    assert dirs == {f"gc/{v3}"}
    assert exp.store.exists(f"gc/{IN_FLIGHT}/params.safetensors")  # a newer version in flight
    # the ledger is untouched: a deleted pseudo-gradient stays applied (a replay is never merged)
    assert exp.applied() == applied_before and exp.is_applied("a/00000000-f000")
    remaining = {r.id for r in exp.list_pseudograds()}
    assert remaining == set(applied_before) - set(_merged_outside_the_window())
    assert not [k for k in _keys(exp) if "deadbeef" in k]
    # checkpoints: only the latest is left, and it loads
    assert [k.split("/")[3][:11] for k in _keys(exp) if k.startswith("gc/checkpoints/a/c")] == [
        "c0000000030",
        "c0000000030",
    ]
    assert exp.load_checkpoint("a")[1]["step"] == 30


def test_collect_again_deletes_only_a_replayed_pseudograd_then_nothing(exp):
    retention.collect(exp, keep_last=KEEP_LAST, dry_run=False)
    exp.publish_pseudograd("a", 0, 0, {"d": np.ones(3, np.float32)}, {})  # a replay, merged
    again = retention.collect(exp, keep_last=KEEP_LAST, dry_run=False)
    assert again["pseudograds"] == ["a/00000000-f000"]
    assert sum(again["deleted"].values()) == again["deleted"]["pseudograds"] == 1
    assert exp.plan_gc(keep_last=KEEP_LAST).empty


def test_delete_pseudograd_refuses_an_unmerged_one_and_repeats(exp):
    unmerged = exp.publish_pseudograd("a", 100, 0, {"d": np.ones(3, np.float32)}, {})
    with pytest.raises(ValueError, match="not merged"):
        exp.delete_pseudograd(unmerged)
    assert exp.delete_pseudograd("a/00000000-f001") == 2  # marker + payload
    assert exp.delete_pseudograd("a/00000000-f001") == 0


def test_plan_on_an_experiment_without_versions(tmp_path):
    store = ExperimentStore(open_store(f"file://{tmp_path}/s"), "gc")
    store.write_config({"fragments": {"count": 2}})
    plan = store.plan_gc()
    assert plan.empty and plan.heads == {} and plan.protected == {}
    with pytest.raises(ValueError):
        store.plan_gc(keep_last=0)


def test_collect_all_reports_errors_per_experiment(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/s"
    good = ExperimentStore(open_store(url), "good")
    good.write_config({})
    good.publish_fragment(0, 0, _params(0, 0), {}, expected=None)
    monkeypatch.setenv("DILOCO_GC_DRY_RUN", "1")
    out = retention.collect_all(
        [{"store_url": url, "experiment": "good"}, {"store_url": "nope://x", "experiment": "bad"}]
    )
    assert out[0]["experiment"] == "good" and out[0]["dry_run"] is True
    assert out[1]["experiment"] == "bad" and "error" in out[1]
    assert json.loads(json.dumps(out)) == out
