"""The scavenge DAG's tasks without a running Airflow (plugins/diloco_airflow/scavenge.py): a
real file store, real local processes, the fake Cloud TPU API. Each test drives one path:
window closed -> clean leave; SIGTERM (local reclaim) -> no retry; spot preemption on
tpu_vm -> no retry; a stopped experiment -> nothing joins."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from airflow.sdk.exceptions import AirflowSkipException
from diloco_airflow import scavenge as ops
from diloco_airflow.backends import ResourceState
from diloco_airflow.island_entry import IslandEntry
from diloco_airflow.island_tasks import teardown_island

from tests.fake_tpu_api import FakeTpuApi
from tests.helpers import new_store, small_config
from training.config import scavenge as rules
from training.config.experiment import parse_config
from training.views.status import collect_status

# a stand-in island: beats once, leaves (done marker) on its stop marker, exits without one on
# SIGTERM (capacity taken back), like training/island/process.py
FAKE_ISLAND = """
import signal, sys, time
from training.store.experiment import ExperimentStore
from training.store.registry import open_store
url, exp, name = sys.argv[1:4]
gone = []
signal.signal(signal.SIGTERM, lambda *a: gone.append(1))
es = ExperimentStore(open_store(url), exp)
es.write_heartbeat(name, {"time": time.time(), "step": 0})
while not gone:
    if es.stop_requested(name):
        es.mark_done(name, {"step": 1})
        break
    time.sleep(0.05)
"""


@pytest.fixture
def experiment(tmp_path, monkeypatch):
    """A running experiment (islands a, b; four data shards) in a file store."""
    monkeypatch.setenv("DILOCO_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.setattr("diloco_airflow.experiment_setup.register_experiment", lambda *a: None)
    url = f"file://{tmp_path}/store"
    cfg = small_config("scav-exp", store_url=url, data={"num_shards": 4})
    return cfg, new_store(cfg, url)


def _params(cfg, **extra) -> dict:
    return {"experiment": cfg.name, "store_url": cfg.store_url, "poll_s": 0.1, **extra}


def _fake_command(entry: dict) -> dict:
    spec = dict(entry["spec"], command=[sys.executable, "-c", FAKE_ISLAND])
    spec["command"] += [entry["store_url"], entry["experiment"], entry["name"]]
    return dict(entry, spec=spec)


def _trigger(win: dict, entry: dict) -> ops.ScavengeTrigger:
    e = IslandEntry.of(entry)
    return ops.ScavengeTrigger(
        closes_at=win["closes_at"],
        spec=e.spec.to_dict(),
        backend=e.backend,
        backend_kwargs=e.backend_kwargs,
        launched_at=time.time(),
    )


def _check(win, entry, estore, now):
    e = IslandEntry.of(entry)
    return _trigger(win, entry).check(estore, e.make_backend(), e.spec, now)


def _wait_state(entry: dict, state: ResourceState, timeout_s: float = 60.0) -> None:
    e = IslandEntry.of(entry)
    deadline = time.monotonic() + timeout_s
    while e.make_backend().status(e.spec, {}).state != state:
        assert time.monotonic() < deadline, f"{e.name} never became {state}"
        time.sleep(0.05)


def _wait_beat(estore, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while name not in estore.heartbeats():
        assert time.monotonic() < deadline, f"{name} never beat"
        time.sleep(0.05)


def test_a_window_joins_the_slot_and_it_leaves_cleanly_when_the_window_closes(experiment):
    cfg, estore = experiment
    plan = ops.plan_scavenge(_params(cfg, window_minutes=5.0))
    [entry] = [_fake_command(e) for e in plan["local"]]
    assert entry["name"] == "scav-0" and plan["tpu_vm"] == plan["gke"] == []
    assert [i["name"] for i in estore.read_config()["islands"]] == ["a", "b", "scav-0"]
    win = plan["window"]
    try:
        ops.join_island(entry, win, "run-1")
        _wait_beat(estore, "scav-0")
        assert _check(win, entry, estore, time.time()) is None  # running, window open
        event = _check(win, entry, estore, win["closes_at"])
        assert event == {"status": "window closed", "island": "scav-0"}
        left = ops.leave_island(entry, win, "run-1", 60, 0.05, outcome=event["status"])
    finally:
        teardown_island(entry)
    assert left == {"island": "scav-0", "reason": "window closed", "clean": True, "recorded": True}
    assert "scav-0" in estore.done() and estore.stopped_islands() == {"scav-0"}
    events = [(r["event"], r["island"]) for r in estore.read_metrics(rules.METRIC)]
    assert events == [("join", "scav-0"), ("leave", "scav-0")]
    status = collect_status(parse_config(estore.read_config()), estore)
    [row] = [i for i in status["islands"] if i["scavenged"]]
    assert (row["island"], row["state"], row["left_reason"]) == ("scav-0", "left", "window closed")


def test_the_next_window_rejoins_the_same_slot_without_a_new_shard(experiment):
    cfg, estore = experiment
    first = ops.plan_scavenge(_params(cfg))
    estore.request_stop("scav-0")
    estore.mark_done("scav-0", {"step": 1})  # what the first window left behind
    second = ops.plan_scavenge(_params(cfg))
    assert estore.read_config()["islands"][2]["shard"] == 2  # one slot, one shard
    assert first["local"][0]["name"] == second["local"][0]["name"] == "scav-0"
    entry = _fake_command(second["local"][0])
    try:
        ops.join_island(entry, second["window"], "run-2")  # clears the markers, starts it
        assert "scav-0" not in estore.done() and not estore.stop_requested("scav-0")
    finally:
        teardown_island(entry)


def test_a_local_island_told_to_go_with_sigterm_is_reclaimed_not_retried(experiment):
    cfg, estore = experiment
    plan = ops.plan_scavenge(_params(cfg))
    [entry] = [_fake_command(e) for e in plan["local"]]
    win = plan["window"]
    try:
        ops.join_island(entry, win, "run-1")
        _wait_beat(estore, "scav-0")
        e = IslandEntry.of(entry)
        record = json.loads((e.make_backend().run_dir(e.spec) / "process.json").read_text())
        os.killpg(int(record["pgid"]), signal.SIGTERM)  # the capacity is taken back
        _wait_state(entry, ResourceState.SUCCEEDED)
        assert _check(win, entry, estore, time.time()) == {
            "status": "reclaimed",
            "island": "scav-0",
        }
        left = ops.leave_island(entry, win, "run-1", timeout_s=60, poll_s=0.05)
    finally:
        teardown_island(entry)
    assert (left["reason"], left["clean"]) == ("reclaimed", False)
    assert "scav-0" in estore.stopped_islands()  # the merger counts it out


def test_a_spot_tpu_island_preempted_is_reclaimed_and_torn_down(experiment, monkeypatch):
    cfg, estore = experiment
    hardware = {
        "project": "proj",
        "zone": "us-east5-a",
        "accelerator_type": "v5p-8",
        "runtime_version": "v2-alpha-tpuv5",
    }
    with FakeTpuApi() as fake:
        monkeypatch.setenv("DILOCO_TPU_API_ENDPOINT", fake.url)
        plan = ops.plan_scavenge(_params(cfg, backend="tpu_vm", hardware=hardware))
        [entry] = plan["tpu_vm"]
        win = plan["window"]
        ops.join_island(entry, win, "run-1")
        rid = IslandEntry.of(entry).spec.resource_id
        assert fake.creates(rid)[0].body["spot"] == {}
        fake.set_state(rid, "ACTIVE")
        assert _check(win, entry, estore, time.time()) is None  # booting: no beat yet
        fake.preempt(rid)
        assert _check(win, entry, estore, time.time())["status"] == "reclaimed"
        left = ops.leave_island(entry, win, "run-1", timeout_s=5, poll_s=0.05)
        teardown_island(entry)
        assert not fake.exists(rid)
    assert (left["reason"], left["clean"], left["recorded"]) == ("reclaimed", False, True)


def test_nothing_joins_an_experiment_that_is_ending(experiment):
    cfg, estore = experiment
    estore.request_stop(None)
    with pytest.raises(AirflowSkipException, match="stop marker"):
        ops.plan_scavenge(_params(cfg))
    assert [i["name"] for i in estore.read_config()["islands"]] == ["a", "b"]


def test_a_preemptible_tpu_island_asks_for_preemptible_scheduling_and_no_guaranteed_tier():
    from diloco_airflow.backends import IslandSpec
    from diloco_airflow.backends.tpu_vm import build_queued_resource

    hw = {"accelerator_type": "v5p-8", "runtime_version": "v2", "preemptible": True}
    spec = IslandSpec(
        experiment="e", island="scav-0", store_url="gs://b", command=["x"], hardware=hw
    )
    qr = build_queued_resource(spec, project="p", zone="z")
    assert qr.tpu.node_spec[0].node.scheduling_config.preemptible
    assert "guaranteed" not in qr and "spot" not in qr


def test_a_resumed_wait_labels_its_island_before_it_returns(experiment):
    """After the trigger fires, Airflow renders map_index_template from the resumed task's
    context: the label must be there, also on the early return of a window that closed."""
    cfg, _ = experiment
    plan = ops.plan_scavenge(_params(cfg))
    [entry] = plan["local"]
    op = ops.ScavengeWaitOperator(task_id="wait", island=entry, window=plan["window"])
    context: dict = {}
    event = {"status": "window closed", "island": "scav-0"}
    assert op.execute_complete(context, event) == event
    assert context["island_label"] == "scav-0 (local)"
