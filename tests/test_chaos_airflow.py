"""Chaos mode on the Airflow side (no Airflow running): the merge task's kill, the kill monkey
task, a stalled island's wait task stopping it, and SIGTERM not marking an island done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import new_store, publish_delta, small_config
from training.island.process import Island
from training.store.experiment import ExperimentStore

_MERGE_TASK = """
import sys
from diloco_airflow.experiment_end import merge_experiments
print(merge_experiments([{"store_url": sys.argv[1], "experiment": "chaos-op"}]))
"""


def _file_store(tmp_path, cfg) -> tuple[str, ExperimentStore]:
    url = f"file://{tmp_path}/store"
    return url, new_store(cfg, url)


def _delta(store) -> dict[str, np.ndarray]:
    params = store.load_params()
    return {k: np.full(v.shape, 1e-3, np.float32) for k, v in params.items()}


@pytest.mark.integration
def test_merge_task_is_killed_mid_write_once_and_its_retry_repairs_the_ledger(tmp_path):
    from diloco_airflow.experiment_end import merge_experiments

    # no grace floor: the one-shot merge task applies a's publish at once (b comes later)
    cfg = small_config(
        "chaos-op", chaos={"kill_merge_at": "global.after-cas"}, outer={"grace_min_steps": 0.0}
    )
    url, store = _file_store(tmp_path, cfg)
    publish_delta(store, cfg, "a", 0, _delta(store))
    env = dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_FAULTS="")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "plugins")])
    cmd = [sys.executable, "-c", _MERGE_TASK, url]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr[-2000:]  # the task process, killed mid-write
    assert store.head(0).version == 1 and not store.applied()  # swapped, ledger not written
    # the retry (here: in this process) is not armed again, repairs the ledger and merges on
    publish_delta(store, cfg, "b", 0, _delta(store))
    os.environ.pop("DILOCO_FAULTS", None)
    [out] = merge_experiments([{"store_url": url, "experiment": cfg.name}])
    assert out["versions"] == [2] and out["applied"] == 1
    assert store.applied() == {"a/00000000-f000": 1, "b/00000000-f000": 2}
    assert [e["event"] for e in store.read_metrics("chaos")] == ["merge_kill"]
    assert "DILOCO_FAULTS" not in os.environ


def _island_entry(tmp_path, cfg, name: str, command: list[str]) -> dict:
    """The entry dict of a local island running `command` (as XCom hands it to the tasks)."""
    from diloco_airflow.backends import IslandSpec
    from diloco_airflow.island_entry import IslandEntry

    spec = IslandSpec(experiment=cfg.name, island=name, store_url=cfg.store_url, command=command)
    return IslandEntry(
        name=name,
        experiment=cfg.name,
        store_url=cfg.store_url,
        backend="local",
        backend_kwargs={"runs_root": str(tmp_path / "runs")},
        label=f"{name} (local)",
        heartbeat_s=cfg.heartbeat_s,
        spec=spec,
    ).to_dict()


def _backend_and_spec(entry: dict):
    from diloco_airflow.island_entry import IslandEntry

    e = IslandEntry.of(entry)
    return e.make_backend(), e.spec


def _launch(entry: dict) -> None:
    from diloco_airflow import island_tasks

    island_tasks.launch_island(entry, island_tasks.provision_island(entry))


def test_chaos_monkey_task_kills_running_islands_and_records_each_kill(tmp_path):
    from diloco_airflow import chaos_monkey as ops
    from diloco_airflow.island_tasks import teardown_island

    url = f"file://{tmp_path}/store"
    cfg = small_config(
        "chaos-monkey",
        store_url=url,
        chaos={"kill_mtbi_s": 0.3, "max_kills": 2, "seed": 3},
    )
    store = new_store(cfg, url)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    entries = [_island_entry(tmp_path, cfg, n, sleeper) for n in ("a", "b")]
    for e in entries:
        _launch(e)
    try:
        islands = {"local": entries, "gke": [], "shards": [0]}  # as init_experiment returns
        out = ops.run_chaos_monkey(islands, url, cfg.name, poll_s=0.1)
        assert len(out["kills"]) == 2
        events = [e for e in store.read_metrics("chaos") if e["event"] == "kill"]
        assert sorted(e["n"] for e in events) == [1, 2]
        from diloco_airflow.backends import ResourceState

        states = {}
        for e in entries:
            backend, spec = _backend_and_spec(e)
            states[e["name"]] = backend.status(spec, {})
        killed = {e["island"] for e in events}
        for name in killed:
            assert states[name].state == ResourceState.FAILED, states[name]
        # a retried monkey task counts the kills already made: max_kills is per experiment
        assert ops.run_chaos_monkey({"local": entries}, url, cfg.name)["kills"] == []
    finally:
        for e in entries:
            teardown_island(e)


def test_chaos_monkey_is_a_noop_without_kill_mtbi_and_stops_when_islands_are_done(tmp_path):
    from diloco_airflow import chaos_monkey as ops

    url = f"file://{tmp_path}/store"
    cfg = small_config("chaos-idle", store_url=url)
    new_store(cfg, url)
    assert ops.run_chaos_monkey({"local": []}, url, cfg.name) == {"kills": []}

    cfg2 = small_config("chaos-done", store_url=url, chaos={"kill_mtbi_s": 600.0})
    store = new_store(cfg2, url)
    entries = [_island_entry(tmp_path, cfg2, n, ["true"]) for n in ("a", "b")]
    for n in ("a", "b"):
        store.mark_done(n, {})
    # only "every island is done" can stop it at its first poll (the first kill is due in
    # minutes, the idle stop after an hour): a broken done check hangs until the test's timeout
    out = ops.run_chaos_monkey({"local": entries}, url, cfg2.name, poll_s=0.1, idle_s=3600)
    assert out["kills"] == []


def test_stalled_island_is_stopped_by_its_wait_task_so_the_retry_relaunches_it(tmp_path):
    from diloco_airflow.backends import ResourceState
    from diloco_airflow.island_tasks import IslandWaitOperator

    url = f"file://{tmp_path}/store"
    cfg = small_config("chaos-wait", store_url=url)
    new_store(cfg, url)
    entry = _island_entry(tmp_path, cfg, "a", [sys.executable, "-c", "import time; time.sleep(60)"])
    _launch(entry)
    op = IslandWaitOperator(task_id="wait", island=entry)
    backend, spec = _backend_and_spec(entry)
    assert backend.status(spec, {}).state == ResourceState.RUNNING
    event = {
        "status": "failed",
        "island": "a",
        "message": "heartbeat stopped 30s ago (process alive)",
        "retryable": True,
        "stalled": True,
    }
    with pytest.raises(RuntimeError, match="heartbeat stopped"):
        op.execute_complete({}, event)
    assert backend.status(spec, {}).state != ResourceState.RUNNING  # the retry relaunches it


def test_sigterm_checkpoints_but_does_not_mark_the_island_done():
    cfg = small_config("chaos-term")
    store = new_store(cfg)
    isl = Island(cfg, "a", store)
    step = isl.step

    def step_then_sigterm():  # a real SIGTERM to this process after the second step
        out = step()
        if isl.step_count == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    isl.step = step_then_sigterm
    isl.run()
    assert isl._stop  # the island's handler caught it
    assert "a" not in store.done()
    assert store.load_checkpoint("a") is not None
    store.request_stop("a")
    isl = Island(cfg, "a", store)
    isl.run()
    assert "a" in store.done()
