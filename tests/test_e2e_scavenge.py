"""End to end: a real Airflow runs `diloco_scavenge` against a running `diloco_experiment`.

A tiny experiment (two local islands, three data shards) runs on fake-gcs-server; once it has
merged, `diloco_scavenge` is triggered through REST API v2 with a 90-second window. Checked from
the store: the scavenged island `scav-0` joined (config.json, a join record), its
pseudo-gradients were merged (the ledger), and when the window closed it left cleanly (the stop
marker, its done marker, a leave record "window closed" after the window's end, `diloco
status` says "left"); the scavenge run succeeded without retrying the island. Then the
experiment is stopped (`diloco stop`) and its run ends.

    .venv/bin/python -m pytest -m slow tests/test_e2e_scavenge.py
"""

from __future__ import annotations

import time
import uuid

import pytest

from devtools.demo import demo_conf
from tests.airflow_fixture import running_airflow
from tests.gcs_fixture import gcs_bucket  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

EXPERIMENT_DAG, SCAVENGE_DAG = "diloco_experiment", "diloco_scavenge"
WINDOW_MIN = 1.5
SLOT = "scav-0"


@pytest.fixture
def airflow(tmp_path, gcs_bucket):  # noqa: F811 - the fixture
    with running_airflow(tmp_path) as af:
        yield af


def _wait(what: str, ready, timeout_s: float, airflow) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        airflow.check_alive()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(2)


def test_a_scavenged_island_joins_for_its_window_is_merged_and_leaves(airflow, gcs_bucket):  # noqa: F811
    from diloco_airflow.store import open_experiment

    from training.config.experiment import parse_config
    from training.views.status import collect_status, format_status

    name = f"scav-{uuid.uuid4().hex[:8]}"
    store_url = f"{gcs_bucket}/scav-{uuid.uuid4().hex[:8]}"
    conf = demo_conf(name, store_url, budget=50_000_000)  # it runs until we stop it
    conf["islands"] = conf["islands"][:2]
    conf["overrides"] = {**conf["overrides"], "data.num_shards": 3}  # one shard to spare
    airflow.wait_healthy()
    airflow.ensure_pools()
    airflow.wait_dag(EXPERIMENT_DAG)
    airflow.wait_dag(SCAVENGE_DAG)
    run_id = airflow.trigger(EXPERIMENT_DAG, conf)
    estore = open_experiment(store_url, name)

    def merged() -> bool:
        from training.store.objectstore import ObjectNotFound

        try:
            snapshot = estore.current_snapshot()
        except ObjectNotFound:  # init has not written config.json yet
            return False
        return snapshot is not None and sum(snapshot.versions) > 0

    _wait("the experiment's first merge", merged, 240, airflow)
    scavenge = {
        "experiment": name,
        "store_url": store_url,
        "islands": 1,
        "window_minutes": WINDOW_MIN,
        "poll_s": 1.0,
        "leave_timeout_s": 120.0,
    }
    scav_run = airflow.trigger(SCAVENGE_DAG, scavenge)
    state = airflow.wait_run(SCAVENGE_DAG, scav_run, 300)
    status = collect_status(parse_config(estore.read_config()), estore)
    print("\n" + format_status(status))
    estore.request_stop(None)  # `diloco stop`: the experiment ends
    exp_state = airflow.wait_run(EXPERIMENT_DAG, run_id, 240)
    assert state == "success", f"scavenge run ended {state}"

    cfg = parse_config(estore.read_config())
    assert [i.name for i in cfg.islands][-1] == SLOT and cfg.shard_of(SLOT) == 2
    records = estore.read_metrics("scavenge")
    assert [(r["event"], r["island"]) for r in records] == [("join", SLOT), ("leave", SLOT)]
    join, leave = records
    assert (leave["reason"], leave["clean"]) == ("window closed", True)
    assert leave["at"] >= join["closes_at"] == pytest.approx(join["opens_at"] + 60 * WINDOW_MIN)
    applied = [pg for pg in estore.applied() if pg.startswith(f"{SLOT}/")]
    assert applied, f"{SLOT} joined but nothing of it was merged"
    assert SLOT in estore.done() and SLOT in estore.stopped_islands()
    [row] = [i for i in status["islands"] if i["island"] == SLOT]
    assert (row["state"], row["left_reason"]) == ("left", "window closed")
    tis = airflow.task_instances(SCAVENGE_DAG, scav_run)
    wait = [ti for ti in tis if ti["task_id"] == "scavenge_local.wait"]
    assert [(ti["state"], ti["try_number"]) for ti in wait] == [("success", 1)]
    assert exp_state == "success", f"experiment run ended {exp_state}"
    print(f"[e2e scavenge] {SLOT}: {len(applied)} contributions merged in its window")
