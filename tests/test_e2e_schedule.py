"""A schedule makes a new experiment per run, finalized once, on a real Airflow (issue 24 item 3).

`diloco_experiment` gets a schedule (`DILOCO_EXPERIMENT_SCHEDULE`, read at parse time: monthly,
so that unpausing it starts no run of its own during the test) and three of its intervals are
run (a backfill over three past months: the scheduler's runs for three schedule intervals, each
with a conf that names no experiment and only makes the model small, as a deployment's form
defaults would). Each run trains its own experiment
(`diloco-backfill-<date>`, from its run id), each experiment is finalized by its own run alone
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

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(420)]

DAG = "diloco_experiment"
RUNS = 3


def _conf(store_url: str) -> dict:
    """The small model of tests/helpers, one island, 16 steps (16 x 2 x 32 = 1,024 tokens);
    no experiment name: each run makes its own."""
    conf = small_dag_params("unused", store_url, ["island-0"], token_budget=1024)
    del conf["experiment_name"]
    return conf


def test_three_scheduled_runs_make_three_experiments_finalized_once_each(tmp_path, gcs_bucket):  # noqa: F811
    store = tmp_path / "store"
    with running_airflow(tmp_path, DILOCO_EXPERIMENT_SCHEDULE="0 0 1 * *") as af:
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag(DAG)
        af.unpause(DAG)  # the scheduler starts no run of a paused DAG, backfills included
        body = {
            "dag_id": DAG,
            "from_date": "2026-01-01T00:00:00Z",
            "to_date": "2026-03-01T00:00:00Z",
            "dag_run_conf": _conf(f"file://{store}"),
            "max_active_runs": RUNS,
        }
        af.request("POST", "/api/v2/backfills", body)
        deadline = time.monotonic() + 330
        runs: list[dict] = []
        while time.monotonic() < deadline:
            runs = af.request("GET", f"/api/v2/dags/{DAG}/dagRuns")["dag_runs"]
            if len(runs) >= RUNS and all(r["state"] in ("success", "failed") for r in runs):
                break
            time.sleep(5)
        assert sorted(r["state"] for r in runs) == ["success"] * RUNS, runs
        names = {experiment_of({}, r["dag_run_id"]): r for r in runs}
        assert len(names) == RUNS and all(n.startswith("diloco-backfill-2026") for n in names)
        for name, run in names.items():
            claim = json.loads((store / name / "control" / "finalized.json").read_text())
            assert claim["run_id"] == run["dag_run_id"], name
            assert run["note"] == f"experiment {name} in file://{store}", run["note"]
        assert sorted(p.name for p in store.iterdir()) == sorted(names)
