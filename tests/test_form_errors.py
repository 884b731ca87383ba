"""The api-server middleware that reports a refused form value in one line
(plugins/diloco_airflow/ui/form_errors.py), on a real FastAPI app."""

from __future__ import annotations

from diloco_airflow.ui.form_errors import OneLineParamErrors
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

# what Airflow 3.3 answered for store s3://x/y (tests/test_e2e_form_errors.py), shortened
REPORT = (
    "Invalid input for param store_url: 's3://x/y' does not match '^(file:///.+|gs://.+)$'\n\n"
    "Failed validating 'pattern' in schema:\n    {'type': 'string',\n     'pattern': "
    "'^(file:///.+|gs://.+)$'}\n\nOn instance:\n    's3://x/y'"
)


def _client(status: int = 400, detail: str = REPORT) -> TestClient:
    app = FastAPI()

    @app.post("/api/v2/dags/{dag_id}/dagRuns")
    def trigger(dag_id: str):
        return JSONResponse({"detail": detail}, status_code=status)

    @app.post("/api/v2/other")
    def other():
        return JSONResponse({"detail": detail}, status_code=status)

    app.add_middleware(OneLineParamErrors)
    return TestClient(app)


def test_a_schema_report_becomes_its_first_line():
    resp = _client().post("/api/v2/dags/diloco_experiment/dagRuns", json={})
    assert resp.status_code == 400
    assert resp.json() == {"detail": REPORT.splitlines()[0]}
    assert int(resp.headers["content-length"]) == len(resp.content)


def test_other_paths_and_statuses_and_details_pass_unchanged():
    assert _client().post("/api/v2/other").json() == {"detail": REPORT}
    assert _client(409).post("/api/v2/dags/d/dagRuns").json() == {"detail": REPORT}
    plain = "DAG with dag_id: 'd' not found"
    assert _client(400, plain).post("/api/v2/dags/d/dagRuns").json() == {"detail": plain}


def test_a_long_first_line_is_bounded():
    long = "Invalid input for param x: " + "y" * 1000 + "\n\nFailed validating"
    detail = _client(400, long).post("/api/v2/dags/d/dagRuns").json()["detail"]
    assert len(detail) == 400 and detail.endswith("...")
