"""Bad input stops a run at once, on a real Airflow (issue 12, item 3).

A store URL that cannot work (``s3://nope/x``) is refused by the form's schema (the REST API
answers 400, no run starts). A budget under one batch per island passes the schema and fails
`init` in one attempt, with the reason in its log; `islands_ended` fails at once after it,
`finalize` never runs, and the run is failed within seconds (not the 5 minutes of retries).
That run is triggered without a note, as the form does: the page plugin's listener gives it one
naming its experiment.

    .venv/bin/python -m pytest -m slow tests/test_e2e_form_errors.py
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime

import pytest

from devtools.demo import demo_conf
from devtools.local_airflow import AirflowError
from tests.airflow_fixture import running_airflow
from tests.gcs_fixture import gcs_bucket  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(400)]

DAG = "diloco_experiment"
FAIL_WITHIN_S = 60.0  # trigger to failed run, on a loaded two-core machine


def _seconds(run: dict) -> float:
    start, end = (datetime.fromisoformat(run[k]) for k in ("start_date", "end_date"))
    return (end - start).total_seconds()


def test_bad_input_fails_at_once_with_one_attempt(tmp_path, gcs_bucket):  # noqa: F811
    with running_airflow(tmp_path) as af:
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag(DAG)
        name = f"bad-{uuid.uuid4().hex[:8]}"
        with pytest.raises(AirflowError, match="HTTP 400") as refused:
            af.trigger(DAG, demo_conf(name, "s3://nope/x"))
        # the plugin's middleware: jsonschema's first line, not its dump of the schema
        detail = json.loads(str(refused.value).split("HTTP 400: ", 1)[1])["detail"]
        assert detail.startswith("Invalid input for param store_url: 's3://nope/x' does not ")
        assert "\n" not in detail and "Failed validating" not in detail

        conf = demo_conf(name, f"file://{tmp_path}/store", budget=100)
        body = {"logical_date": None, "conf": conf}  # as the form: no note
        run_id = af.request("POST", f"/api/v2/dags/{DAG}/dagRuns", body)["dag_run_id"]
        assert af.wait_run(DAG, run_id, 180) == "failed"
        run = af.dag_run(DAG, run_id)
        tis = {(t["task_id"], t["map_index"]): t for t in af.task_instances(DAG, run_id)}
        init, ended = tis[("init", -1)], tis[("islands_ended", -1)]
        assert (init["state"], init["try_number"]) == ("failed", 1)
        assert (ended["state"], ended["try_number"]) == ("failed", 1)
        assert tis[("finalize", -1)]["state"] == "upstream_failed"
        log = af.request("GET", f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/init/logs/1")
        assert "is less than one batch per island" in str(log)
        assert _seconds(run) < FAIL_WITHIN_S, f"failed after {_seconds(run):.0f}s"
        assert not (tmp_path / "store").exists(), "init created nothing"
        assert run["note"] == f"experiment {name} in file://{tmp_path}/store"
