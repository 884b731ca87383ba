"""The image built and run here (issue 23 item 3): `make image` builds the Dockerfile's `default`
target with podman FROM local stand-ins for the official bases (devtools/image/bases.sh), then
the image must answer `airflow version`, list the page plugin, parse the four DAGs with no import
error and run `diloco --help` — with nothing but the installed package and the four DAG files.

    .venv/bin/python -m pytest -m slow tests/test_image.py
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/diloco-airflow:test"
DAG_IDS = {"diloco_experiment", "diloco_maintenance", "diloco_scavenge", "diloco_export_best"}


def _run(cmd: list[str], timeout: int = 600) -> str:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd[:6])}: {(out.stdout + out.stderr)[-3000:]}"
    return out.stdout


def _in_image(script: str) -> str:
    # as the Helm chart and docker-compose run it: without Airflow's example DAGs
    env = ["-e", "AIRFLOW__CORE__LOAD_EXAMPLES=False"]
    return _run(["podman", "run", "--rm", "--network", "host", *env, IMAGE, "bash", "-c", script])


def _last_json(out: str):
    """The CLI's one line of JSON (warnings, e.g. graphviz missing, may come before it)."""
    return json.loads([line for line in out.splitlines() if line.startswith(("[", "{"))][-1])


@pytest.fixture(scope="module")
def image():
    _run(["make", "--no-print-directory", "image", f"IMAGE={IMAGE}"], timeout=1200)
    yield IMAGE
    subprocess.run(["podman", "rmi", "-f", IMAGE], capture_output=True)


def test_airflow_runs_in_the_image(image):
    assert "3.3.2" in _in_image("airflow version")


def test_the_image_lists_the_page_plugin(image):
    names = {p["name"] for p in _last_json(_in_image("airflow plugins --output json"))}
    assert "diloco" in names


def test_the_dags_parse_in_the_image(image):
    # `dags list` reads the serialized DAGs: migrate a (throwaway SQLite) database, parse into it
    out = _in_image(
        "airflow db migrate >/dev/null && airflow dags reserialize >/dev/null"
        " && airflow dags list-import-errors --output json && echo && airflow dags list --output json"
    )
    errors, dags = [json.loads(line) for line in out.splitlines() if line.startswith(("[", "{"))][
        -2:
    ]
    assert errors == [] and {d["dag_id"] for d in dags} == DAG_IDS, (errors, dags)


def test_the_diloco_command_runs_in_the_image(image):
    assert "prepare" in _in_image("diloco --help")
