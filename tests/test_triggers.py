"""Triggers: serialization round trip and event logic against a file:// store."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time

import pytest
from diloco_airflow.backends import IslandSpec
from diloco_airflow.triggers import IslandTrigger, PendingPseudogradTrigger


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
    from diloco_airflow.hooks import open_experiment

    s = open_experiment(f"file://{tmp_path / 'store'}", "exp")
    return s


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


def test_pending_trigger_roundtrip():
    t = PendingPseudogradTrigger([{"store_url": "file:///x", "experiment": "e"}], 1, 2)
    assert roundtrip(t).serialize() == t.serialize()


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


def test_dead_process_fails_fast(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"])
    launch(tmp_path, spec)
    t0 = time.monotonic()
    event = first_event(island_trigger(tmp_path, spec))
    assert event["status"] == "failed" and event["retryable"]
    assert "exit code 3" in event["message"]
    assert time.monotonic() - t0 < 10


def test_exit_zero_without_done_marker_fails(tmp_path, estore):
    spec = spec_for(tmp_path, ["true"])
    launch(tmp_path, spec)
    time.sleep(0.5)
    event = first_event(island_trigger(tmp_path, spec))
    assert event["status"] == "failed" and "done marker" in event["message"]


def test_stale_heartbeat_fails_while_process_alive(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "import time; time.sleep(30)"])
    b, s = launch(tmp_path, spec)
    try:
        launched = time.time()
        estore.write_heartbeat("isl-a", {"step": 3, "time": launched})
        t = island_trigger(tmp_path, spec, launched_at=launched, heartbeat_timeout_s=0.5)
        event = first_event(t)
        assert event["status"] == "failed" and "heartbeat stopped" in event["message"]
    finally:
        b.teardown(s, {})


def test_no_heartbeat_after_startup_timeout_fails(tmp_path, estore):
    spec = spec_for(tmp_path, [sys.executable, "-c", "import time; time.sleep(30)"])
    b, s = launch(tmp_path, spec)
    try:
        t = island_trigger(tmp_path, spec, launched_at=time.time(), startup_timeout_s=0.3)
        assert "no heartbeat" in first_event(t)["message"]
    finally:
        b.teardown(s, {})


def test_pending_trigger_idle_then_pending(tmp_path, estore, monkeypatch):
    exps = [{"store_url": f"file://{tmp_path / 'store'}", "experiment": "exp"}]
    idle = PendingPseudogradTrigger(exps, poll_s=0.05, idle_timeout_s=0.2)
    assert first_event(idle) == {"status": "idle"}
    from diloco_airflow import hooks

    monkeypatch.setattr(hooks, "pending_pseudograds", lambda estore: ["isl-a/00000001-f000"])
    event = first_event(PendingPseudogradTrigger(exps, poll_s=0.05, idle_timeout_s=5))
    assert event["status"] == "pending"
    assert event["experiments"][0]["experiment"] == "exp"


def test_pending_trigger_with_nothing_registered_goes_idle():
    assert first_event(PendingPseudogradTrigger([], poll_s=0.05, idle_timeout_s=0.1)) == {
        "status": "idle"
    }
