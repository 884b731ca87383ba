"""Triggers: serialization round trip and event logic against a file:// store.

The syncer's triggers (`diloco_airflow.syncer`) are tested here too, on the same store."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time

import pytest
from diloco_airflow.backends import IslandSpec
from diloco_airflow.syncer import EvalTrigger, ShardTrigger
from diloco_airflow.triggers import MAX_POLL_ERRORS, IslandTrigger, PollingTrigger

from tests.helpers import new_store, publish_delta, small_config


def roundtrip(trigger):
    classpath, kwargs = trigger.serialize()
    json.dumps(kwargs)  # serializable kwargs only
    module, name = classpath.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**kwargs)


def first_event(trigger, timeout=30.0):
    async def go():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(go(), timeout))


@pytest.fixture
def estore(tmp_path):
    from diloco_airflow.store import open_experiment

    s = open_experiment(f"file://{tmp_path / 'store'}", "exp")
    return s


class FlakyTrigger(PollingTrigger):
    """Fails its first `failures` polls (the n-th with "store down n", on two lines), then
    fires; records the thread of each poll."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures, self.calls, self.threads, self.poll_s = failures, 0, set(), 0.0

    def serialize(self):
        return ("tests.test_triggers.FlakyTrigger", {"failures": self.failures})

    def poll(self):
        import threading

        self.calls += 1
        self.threads.add(threading.get_ident())
        if self.calls <= self.failures:
            raise OSError(f"store down {self.calls}\nretry later")
        return {"status": "ok"}


def test_the_polling_loop_retries_failed_polls_below_the_budget_in_a_thread():
    import threading

    t = FlakyTrigger(MAX_POLL_ERRORS - 1)
    assert first_event(t) == {"status": "ok"}
    assert t.calls == MAX_POLL_ERRORS
    assert threading.get_ident() not in t.threads  # never on the event loop


def test_the_polling_loop_fails_at_the_budget_with_the_last_error_on_one_line():
    t = FlakyTrigger(MAX_POLL_ERRORS)
    event = first_event(t)
    assert t.calls == MAX_POLL_ERRORS
    assert event == {
        "status": "error",
        "message": f"cannot poll the store: store down {MAX_POLL_ERRORS}\\nretry later",
    }


def test_an_island_trigger_that_cannot_poll_fails_retryable(tmp_path):
    t = island_trigger(tmp_path, spec_for(tmp_path, ["true"]), poll_s=0.0)
    t.backend = "no-such-backend"  # every poll raises
    event = first_event(t)
    assert event["status"] == "failed" and event["retryable"] and event["island"] == "isl-a"
    assert event["message"].startswith("cannot poll the island: unknown island backend")


def spec_for(tmp_path, command, island="isl-a"):
    return IslandSpec(
        experiment="exp",
        island=island,
        store_url=f"file://{tmp_path / 'store'}",
        command=command,
    ).to_dict()


def island_trigger(tmp_path, spec, **kw):
    kw.setdefault("poll_s", 0.1)
    return IslandTrigger(
        spec=spec, backend="local", backend_kwargs={"runs_root": str(tmp_path / "runs")}, **kw
    )


def test_island_trigger_roundtrip(tmp_path):
    t = island_trigger(tmp_path, spec_for(tmp_path, ["true"]), heartbeat_timeout_s=7)
    t2 = roundtrip(t)
    assert t2.serialize() == t.serialize()


def test_syncer_triggers_roundtrip():
    t = ShardTrigger("file:///x", "e", 1, "run-1", "run-1", ["a/00000001-f001"], 0.5, 9.0)
    assert roundtrip(t).serialize() == t.serialize()
    e = EvalTrigger("file:///x", "e", "run-1", "000-m.json", 10.0, 40.0, 2.0, 9.0)
    assert roundtrip(e).serialize() == e.serialize()


def launch(tmp_path, spec):
    from diloco_airflow.backends import get_backend

    b = get_backend("local", runs_root=str(tmp_path / "runs"))
    s = IslandSpec.from_dict(spec)
    b.launch(s, b.provision(s))
    return b, s


def test_done_marker_fires_done(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "import time; time.sleep(30)"])
    b, s = launch(tmp_path, spec)
    try:
        estore.mark_done("isl-a", {"step": 1})
        assert first_event(island_trigger(tmp_path, spec))["status"] == "done"
    finally:
        b.teardown(s, {})


def test_dead_process_fails_with_its_exit_code(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"])
    launch(tmp_path, spec)
    event = first_event(island_trigger(tmp_path, spec))  # long before any timeout (600 s)
    assert event["status"] == "failed" and event["retryable"]
    assert "exit code 3" in event["message"]


def test_exit_zero_without_done_marker_fails(tmp_path, estore):
    spec = spec_for(tmp_path, ["true"])
    launch(tmp_path, spec)  # the trigger waits while it runs, then sees it exited
    event = first_event(island_trigger(tmp_path, spec))
    assert event["status"] == "failed" and "done marker" in event["message"]


def test_stale_heartbeat_fails_as_stalled_while_process_alive(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "import time; time.sleep(30)"])
    b, s = launch(tmp_path, spec)
    try:
        launched = 1000.0  # the trigger's own clock: `check` is given "now"
        estore.write_heartbeat("isl-a", {"step": 3, "time": launched})
        t = island_trigger(tmp_path, spec, launched_at=launched, heartbeat_timeout_s=60)
        assert t.check(estore, b, s, now=launched + 60) is None  # 60 s old: not yet
        event = t.check(estore, b, s, now=launched + 61)
        assert event["status"] == "failed" and event["stalled"]
        assert "heartbeat stopped 61s ago" in event["message"]
    finally:
        b.teardown(s, {})


def test_no_heartbeat_after_startup_timeout_fails_as_stalled(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "import time; time.sleep(30)"])
    b, s = launch(tmp_path, spec)
    try:
        t = island_trigger(tmp_path, spec, launched_at=1000.0, startup_timeout_s=300)
        assert t.check(estore, b, s, now=1300.0) is None
        event = t.check(estore, b, s, now=1301.0)
        assert event["stalled"] and "no heartbeat 301s after launch" in event["message"]
    finally:
        b.teardown(s, {})


@pytest.mark.parametrize("heartbeat_s", [1.0, 5.0, 20.0])
def test_the_page_calls_an_island_stalled_exactly_when_its_wait_task_stops_it(
    tmp_path, estore, heartbeat_s
):
    """One stall rule (training/protocol/stall.py): a heartbeat just under the wait task's limit
    is "running" on the page and left alone by the plugin; just over it, "stalled" on the page
    and the wait task's trigger fires its stalled event (the operator then stops the island)."""
    from diloco_airflow.backends import BackendStatus, ResourceState
    from diloco_airflow.island_entry import IslandEntry
    from diloco_airflow.island_tasks import IslandWaitOperator

    from training.protocol import stall
    from training.views import dashboard

    cfg = small_config("exp", islands=("isl-a",), heartbeat_s=heartbeat_s)
    spec = IslandSpec.from_dict(spec_for(tmp_path, ["true"]))
    entry = IslandEntry("isl-a", "exp", spec.store_url, "local", spec, cfg.heartbeat_s)
    kwargs = IslandWaitOperator(task_id="wait", island=entry.to_dict()).trigger_kwargs(entry)
    launched = 1000.0
    trigger = IslandTrigger(**{**kwargs, "launched_at": launched})
    estore.write_heartbeat("isl-a", {"step": 3, "time": launched})

    class Running:  # the backend: the island's process runs
        def status(self, spec, handle):
            return BackendStatus(ResourceState.RUNNING)

    limit = stall.wait_timeout_s(heartbeat_s)
    for age, word, stopped in ((limit - 0.01, "running", False), (limit + 0.01, "stalled", True)):
        now = launched + age
        event = trigger.check(estore, Running(), spec, now)
        [row] = dashboard.island_rows(cfg, estore.heartbeats(), {}, set(), None, now)
        assert (row["state"], bool(event and event.get("stalled"))) == (word, stopped), age


@pytest.fixture
def sharded(tmp_path):
    """A two-fragment, two-shard experiment on a file:// store: (url, store, cfg)."""
    url = f"file://{tmp_path / 'sharded'}"
    cfg = small_config("shx", fragments={"count": 2}, syncer={"shards": 2})
    return url, new_store(cfg, url), cfg


def _publish(store, cfg, fragment, seq=0):
    from training.model.runtime import fragment_names

    params = store.load_params()
    names = fragment_names(cfg)[fragment]
    delta = {n: params[n] * 0 for n in names}
    return publish_delta(store, cfg, "a", seq, delta, fragment=fragment).id


def shard_trigger(url, cfg, shard, **kw):
    kw.setdefault("poll_s", 0.05)
    return ShardTrigger(url, cfg.name, shard, owner="run-1", run_id="run-1", **kw)


def test_shard_trigger_fires_for_new_work_of_its_own_shard_only(sharded):
    url, store, cfg = sharded
    pg = _publish(store, cfg, fragment=1)
    assert shard_trigger(url, cfg, 0).poll() is None
    assert shard_trigger(url, cfg, 1, seen=[pg]).poll() is None  # left unmergeable before
    assert first_event(shard_trigger(url, cfg, 1)) == {"status": "pending", "new": 1}


def test_shard_trigger_leaves_work_to_another_runs_live_lease(sharded):
    from training.merge.syncer import ShardLease

    url, store, cfg = sharded
    _publish(store, cfg, fragment=0)
    assert ShardLease(store, 0, "run-0", 60).acquire()
    assert shard_trigger(url, cfg, 0).poll() is None
    ShardLease(store, 0, "run-0", 60).release()
    assert shard_trigger(url, cfg, 0).poll()["status"] == "pending"


def test_shard_and_eval_triggers_fire_finished_when_the_run_ends(sharded):

    url, store, cfg = sharded
    store.mark_run_ended("run-1", ["a", "b"])
    assert first_event(shard_trigger(url, cfg, 0)) == {"status": "finished"}
    ev = EvalTrigger(url, cfg.name, run_id="run-1", poll_s=0.05)
    assert first_event(ev) == {"status": "finished"}


def test_a_syncer_trigger_fires_no_earlier_than_it_settled(sharded):

    url, store, cfg = sharded
    store.mark_run_ended("run-1", ["a", "b"])
    t0 = time.time()
    assert first_event(shard_trigger(url, cfg, 0, settle_until=t0 + 0.5))["status"] == "finished"
    assert time.time() - t0 >= 0.5


def test_eval_trigger_fires_on_a_new_merge_once_not_before_passed(sharded):
    url, store, cfg = sharded
    assert EvalTrigger(url, cfg.name, run_id="r", not_before=0).poll() is None  # no merge yet
    store.append_metric("merge", {"at": time.time()})
    assert EvalTrigger(url, cfg.name, run_id="r", not_before=time.time() + 60).poll() is None
    event = first_event(EvalTrigger(url, cfg.name, run_id="r", last_eval_at=5.0, poll_s=0.05))
    assert event == {"status": "changed", "evaluated": None, "last_eval_at": 5.0}
