"""A schedule makes a new experiment per run, finalized once, on a real Airflow (issue 24 item 3).

`diloco_experiment` gets a schedule (`DILOCO_EXPERIMENT_SCHEDULE`: every minute, read at parse
time) and the deployment's form defaults (`DILOCO_FORM_DEFAULTS`: a small model, one island,
1,024 tokens; no experiment name), is unpaused and left to the scheduler until it has started
three runs (no conf: each uses the form's defaults). Each run trains its own experiment
(`diloco-scheduled-<time>`, from its run id), each experiment is finalized by its own run alone
(`control/finalized.json` names it), and every run has a note naming its experiment.

    .venv/bin/python -m pytest -m slow tests/test_e2e_schedule.py
"""

from __future__ import annotations

import json
import time

import pytest
from diloco_airflow.params import experiment_of

from tests.airflow_fixture import running_airflow
from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.helpers import small_dag_params

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(780)]

DAG = "diloco_experiment"
RUNS = 3


def _form_defaults() -> dict:
    """The small model of tests/helpers, one island, 16 steps (16 x 2 x 32 = 1,024 tokens),
    one syncer shard; no name and no store (the deployment's default store)."""
    conf = small_dag_params("unused", "unused", ["island-0"], token_budget=1024, syncer_shards=1)
    del conf["experiment_name"], conf["store_url"]
    return conf


def _runs(af) -> list[dict]:
    runs = af.request("GET", f"/api/v2/dags/{DAG}/dagRuns?order_by=run_after")["dag_runs"]
    return [r for r in runs if r["run_type"] == "scheduled"]


def test_three_scheduled_runs_make_three_experiments_finalized_once_each(tmp_path, gcs_bucket):  # noqa: F811
    store = tmp_path / "store"
    env = {
        "DILOCO_EXPERIMENT_SCHEDULE": "* * * * *",
        "DILOCO_FORM_DEFAULTS": json.dumps(_form_defaults()),
        "DILOCO_DEFAULT_STORE": f"file://{store}",
        "AIRFLOW__CORE__PARALLELISM": "16",  # overlapping runs: no task waits for a slot
    }
    with running_airflow(tmp_path, **env) as af:
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag(DAG)
        af.unpause(DAG)  # the newest minute's run at once, then one a minute
        deadline = time.monotonic() + 420
        while len(_runs(af)) < RUNS and time.monotonic() < deadline:
            time.sleep(3)
        # not paused yet: the scheduler schedules no task of a paused DAG's runs, running or not
        runs = _runs(af)[:RUNS]
        assert len(runs) == RUNS, f"{len(runs)} scheduled runs in 420 s"
        ids = [r["dag_run_id"] for r in runs]
        states = {}
        deadline = time.monotonic() + 300  # the last run started: its own time to finish
        while time.monotonic() < deadline:
            states = {i: af.dag_run(DAG, i)["state"] for i in ids}
            if all(s in ("success", "failed") for s in states.values()):
                break
            time.sleep(5)
        af.request("PATCH", f"/api/v2/dags/{DAG}", {"is_paused": True})  # no fourth
        assert list(states.values()) == ["success"] * RUNS, states
        names = {experiment_of({}, i): af.dag_run(DAG, i) for i in ids}
        assert len(names) == RUNS and all(n.startswith("diloco-scheduled-") for n in names)
        for name, run in names.items():
            claim = json.loads((store / name / "control" / "finalized.json").read_text())
            assert claim["run_id"] == run["dag_run_id"], name
            assert run["note"] == f"experiment {name} in file://{store}", run["note"]
