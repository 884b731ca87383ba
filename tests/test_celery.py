"""Production Airflow end to end: PostgreSQL, Redis, the CeleryExecutor, two Celery workers.

`devtools.celery_airflow.CeleryAirflow` starts PostgreSQL and Redis (Debian's ``postgresql`` and
``redis-server``, ordinary processes on loopback in a temporary directory), then Airflow on that
database (api-server, scheduler, dag-processor, triggerer) and two Celery workers, ``worker-1`` and
``worker-2``, separate processes whose task instances record their own hostname. The experiment
is triggered as the form does (unpause `diloco_experiment`, POST the run: two local islands, two
fragments, two syncer shards, on fake-gcs-server), and while it trains:

1. once both shards have merged, the worker running syncer shard 0's task is SIGKILLed (``kill
   -9`` of the Celery worker: its pool processes die with it); that task instance stops
   heartbeating, the scheduler fails it after ``task_instance_heartbeat_timeout`` and its retry
   runs on the other worker, and merges there;
2. meanwhile, with the islands' wait tasks deferred, the triggerer is restarted: the new
   triggerer takes their triggers over;
3. then the experiment is stopped (the page's "stop experiment": every island checkpoints and
   leaves) and the run must succeed.

Checked: before the kill, islands and syncer shards ran on both workers (task instances'
hostnames); the killed shard's tries (worker-X failed, worker-Y success); the islands' triggers
moved to the new triggerer job; nothing applied twice and nothing lost (manifests, ledger,
markers: `tests.test_e2e_chaos.check_exactly_once`), the final eval no worse than the best.

    .venv/bin/python -m pytest -m slow tests/test_celery.py -s
"""

from __future__ import annotations

import time
import uuid

import pytest

from devtools.celery_airflow import CeleryAirflow, find_program, free_port, session_members
from devtools.demo import summarize
from devtools.local_airflow import AirflowError, groups_still_alive, stop_islands
from tests.airflow_fixture import island_env
from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.helpers import small_dag_params
from tests.test_e2e_airflow import DAG, Bucket
from tests.test_e2e_chaos import check_exactly_once

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

ISLANDS = ["island-a", "island-b"]
WORKERS = ["worker-1", "worker-2"]
PHASE_TIMEOUT_S = 120.0  # the scheduler fails a lost task after 30 s without a heartbeat (+5)


@pytest.fixture
def celery_airflow(tmp_path, gcs_bucket):  # noqa: F811 - the fixture
    """A running CeleryAirflow with two workers, its islands' runs root in `runs`; on exit
    asserts that no process it or its islands started outlived it. Garbage collection only
    plans (DILOCO_GC_DRY_RUN=1): the exactly-once check reads every applied id's marker."""
    for program in ("initdb", "postgres", "redis-server"):
        try:
            find_program(program)
        except AirflowError as exc:
            pytest.skip(str(exc))
    runs = tmp_path / "islands"
    env = {**island_env(runs), "DILOCO_GC_DRY_RUN": "1"}
    af = CeleryAirflow(home=tmp_path / "airflow_home", port=free_port(), env=env, workers=2)
    af.runs = runs
    try:
        af.start()
        yield af
    finally:
        sessions = af.sessions()
        af.stop()
        islands = stop_islands(runs)
        alive = groups_still_alive(islands) + [p for s in sessions for p in session_members(s)]
        assert not alive, f"processes {alive} outlived the test"


def _wait(af, run_id: str, what: str, check, timeout_s: float = PHASE_TIMEOUT_S):
    """Poll `check()` every second until it returns something truthy (returned); fails when the
    run ends first, a component died, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        af.check_alive()
        found = check()
        if found:
            return found
        state = af.dag_run(DAG, run_id)["state"]
        assert state not in ("success", "failed"), f"run ended {state} before: {what}"
        time.sleep(1)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def _tries(af, run_id: str, task_id: str, map_index: int) -> list[dict]:
    path = f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries"
    return sorted(af.request("GET", path)["task_instances"], key=lambda t: t["try_number"])


def _shards_merged(estore, since: float = 0.0) -> set[int]:
    """Shards with a merge after `since` (fragment p is shard p's: two of each)."""
    merges = estore.read_metrics("merge")
    return {c["fragment"] for m in merges if m["at"] > since for c in m["contributions"]}


def test_celery_workers_share_the_run_and_survive_a_lost_worker_and_a_triggerer_restart(
    celery_airflow,
    gcs_bucket,  # noqa: F811
):
    from diloco_airflow.store import open_experiment

    af = celery_airflow
    started = time.monotonic()
    af.wait_healthy()
    nodes = af.wait_workers()
    af.ensure_pools()
    af.wait_dag(DAG)
    ready_s = time.monotonic() - started

    name = f"celery-{uuid.uuid4().hex[:8]}"
    prefix = f"celery-{uuid.uuid4().hex[:8]}"
    store_url = f"{gcs_bucket}/{prefix}"
    # the run ends when the test stops it (step 3), never on its token budget
    conf = small_dag_params(
        name,
        store_url,
        ISLANDS,
        H=20,
        fragments=2,
        syncer_shards=2,
        syncer_eval_every_s=10.0,
        token_budget=10**9,
    )
    run_id = af.trigger(DAG, conf)
    estore = open_experiment(store_url, name)

    # 1. both shards merged: SIGKILL the worker running shard 0
    def shard0_running_after_merges():
        if _shards_merged(estore) != {0, 1}:
            return None
        tis = af.task_instances(DAG, run_id)
        shard0 = next(t for t in tis if t["task_id"] == "syncer" and t["map_index"] == 0)
        return (tis, shard0) if shard0["state"] == "running" else None

    before, shard0 = _wait(af, run_id, "both shards merged", shard0_running_after_merges)
    victim = shard0["hostname"]
    assert victim in WORKERS, shard0
    (survivor,) = set(WORKERS) - {victim}
    # which worker ran what before the kill: Celery hands tasks to free slots (4 a worker), so
    # one kind may all land on one worker (in one CI run both launches and both shards did);
    # the run as a whole (init, provision, launch, syncer, evaluate) is shared
    spread = {(t["task_id"], t["map_index"]): t["hostname"] for t in before if t["hostname"]}
    on_victim = [t for t in before if t["state"] == "running" and t["hostname"] == victim]
    victim_session = af.kill_worker(victim)
    killed_at = time.time()

    # 2. the islands' wait tasks deferred: restart the triggerer
    def islands_deferred():
        tis = af.task_instances(DAG, run_id)
        waits = [t for t in tis if t["task_id"] == "islands_local.wait"]
        ok = len(waits) == len(ISLANDS) and all(t["state"] == "deferred" for t in waits)
        return waits if ok else None

    waits = _wait(af, run_id, "island waits deferred", islands_deferred)
    old_jobs = {(t.get("triggerer_job") or {}).get("id") for t in waits}
    af.restart("triggerer")

    def triggers_taken_over():
        tis = af.task_instances(DAG, run_id)
        waits = [t for t in tis if t["task_id"] == "islands_local.wait"]
        jobs = {(t.get("triggerer_job") or {}).get("id") for t in waits}
        return jobs if None not in jobs and not jobs & old_jobs else None

    new_jobs = _wait(
        af, run_id, "the new triggerer runs the islands' triggers", triggers_taken_over
    )
    orphans = session_members(victim_session)  # what the kill left running, seconds later

    # 1. (cont.) shard 0's retry runs on the survivor and merges there
    def shard0_retried():
        tries = _tries(af, run_id, "syncer", 0)
        last = tries[-1]
        merged = 0 in _shards_merged(estore, since=killed_at)
        ok = len(tries) > 1 and last["hostname"] == survivor and last["state"] == "running"
        return tries if ok and merged else None

    _wait(af, run_id, f"shard 0 retried on {survivor} and merging", shard0_retried)

    # 3. stop the experiment (the page's "stop experiment"): the run ends
    estore.request_stop()
    state = af.wait_run(DAG, run_id, 180.0)
    run_s = time.monotonic() - started - ready_s
    assert state == "success", f"run ended {state} after {run_s:.0f}s"

    tis = af.task_instances(DAG, run_id)
    assert all(t["state"] == "success" for t in tis if t["task_id"] in ("syncer", "finalize"))
    # the run's tasks ran on both workers before the kill
    assert set(spread.values()) == set(WORKERS), spread
    # shard 0: its try on the killed worker failed, its retry on the survivor succeeded
    tries = _tries(af, run_id, "syncer", 0)
    assert (tries[0]["hostname"], tries[0]["state"]) == (victim, "failed"), tries
    assert (tries[-1]["hostname"], tries[-1]["state"]) == (survivor, "success"), tries
    # every task that ran on the victim when it died ended on the survivor
    for t in on_victim:
        final = _tries(af, run_id, t["task_id"], t["map_index"])[-1]
        assert final["hostname"] == survivor and final["try_number"] > t["try_number"], final

    counts = check_exactly_once(Bucket(f"{prefix}/{name}"), ISLANDS)
    s = summarize(estore.read_metrics("merge"), estore.read_metrics("eval"), {}, 10**9)
    assert s["applied_twice"] == 0
    assert s["final_eval_loss"] <= 1.001 * s["best_eval_loss"], s
    print(
        f"\n[celery] workers {nodes}; ready {ready_s:.0f}s, run {run_s:.0f}s; before the kill "
        f"{spread}; killed {victim} running {[t['task_id'] for t in on_victim]}, "
        f"{len(orphans)} task processes outlived it; shard 0 tries "
        f"{[(t['hostname'], t['state']) for t in tries]}; triggerer jobs {old_jobs} -> "
        f"{new_jobs}; versions {counts['versions']}, applied {counts['applied']}; eval "
        f"{s['initial_eval_loss']:.3f} -> best {s['best_eval_loss']:.3f}, final "
        f"{s['final_eval_loss']:.3f}"
    )
