"""The installed layout, as Composer and the image deploy it: the wheel built from a clean clone,
installed into a fresh virtualenv where the repo is not on sys.path, an $AIRFLOW_HOME holding
only the three thin DAG files, nothing on PYTHONPATH and an empty plugins folder. Airflow of that
virtualenv must list the page and the provider, parse the DAGs, and run a short experiment whose
page API answers.

The harness (process management, REST helpers) is devtools.local_airflow, run from this test's
interpreter; every Airflow component, task and island runs in the fresh virtualenv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import uuid
from pathlib import Path

import pytest

from devtools.local_airflow import LocalAirflow, groups_still_alive, stop_islands
from tests.airflow_fixture import free_port, island_env
from tests.helpers import small_dag_params

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
DAG_IDS = {"diloco_experiment", "diloco_maintenance", "diloco_scavenge"}
BUDGET = 6_000  # tokens: about a dozen intervals of 2 x 32 x 4 tokens per island (two islands)


def _run(cmd: list, env: dict | None = None, cwd: Path | None = None, timeout: int = 600) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{cmd[:3]}: {out.stderr[-3000:]}"
    return out.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(virtualenv, AIRFLOW_HOME): the wheel of a clean clone installed, the home laid out."""
    tmp = tmp_path_factory.mktemp("installed")
    clone = tmp / "clone"
    _run(["git", "clone", "--quiet", ROOT, clone])
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp / "dist", clone])
    (wheel,) = (tmp / "dist").glob("decoupled_diloco-*.whl")
    venv = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", venv])
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet"]
    _run([*pip, "-r", clone / "requirements.lock"], env=_clean_env(), cwd=tmp)
    _run([*pip, "--no-deps", wheel], env=_clean_env(), cwd=tmp)
    home = tmp / "airflow_home"
    (home / "plugins").mkdir(parents=True)
    (home / "dags").mkdir()
    for dag_file in (clone / "dags").glob("*.py"):
        shutil.copy(dag_file, home / "dags")
    shutil.rmtree(clone)  # nothing of the repo is left to import from
    env = _clean_env(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    _run([venv / "bin" / "airflow", "db", "migrate"], env=env, cwd=tmp)
    return venv, home, env


def _airflow_json(installed, *args: str):
    venv, home, env = installed
    out = _run([venv / "bin" / "airflow", *args, "--output", "json"], env, home)
    # the CLI may log a warning line (graphviz missing) before its one line of JSON
    return json.loads([line for line in out.splitlines() if line.startswith(("[", "{"))][-1])


def test_the_package_imports_from_the_virtualenv_not_the_repo(installed):
    venv, home, env = installed
    code = "import training, diloco_airflow; print(training.__file__, diloco_airflow.__file__)"
    paths = _run([venv / "bin" / "python", "-c", code], env, home).split()
    assert all(p.startswith(str(venv)) for p in paths), paths


def test_airflow_lists_the_page_plugin(installed):
    names = {p["name"] for p in _airflow_json(installed, "plugins")}
    assert "diloco" in names


def test_airflow_lists_the_provider(installed):
    packages = {p["package_name"] for p in _airflow_json(installed, "providers", "list")}
    assert "decoupled-diloco" in packages


def test_the_three_dags_parse_without_import_errors(installed):
    venv, home, env = installed
    # `dags list` reads the serialized DAGs from the database: parse the folder into it first
    _run([venv / "bin" / "airflow", "dags", "reserialize"], env, home)
    assert _airflow_json(installed, "dags", "list-import-errors") == []
    assert {d["dag_id"] for d in _airflow_json(installed, "dags", "list")} == DAG_IDS


class InstalledAirflow(LocalAirflow):
    """The project's harness driving the virtualenv's Airflow on the laid-out home."""

    def __init__(self, venv: Path, home: Path, env: dict[str, str]):
        super().__init__(home=home, port=free_port(), env=env)
        self.venv = venv

    def airflow_bin(self) -> list[str]:
        return [str(self.venv / "bin" / "airflow")]

    def env(self) -> dict[str, str]:
        env = super().env()
        env.pop("PYTHONPATH", None)  # the installed package only
        env["AIRFLOW__CORE__DAGS_FOLDER"] = str(self.home / "dags")
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env


def test_a_short_run_succeeds_and_the_page_answers_for_it(installed, tmp_path):
    venv, home, _ = installed
    runs = tmp_path / "islands"
    env = island_env(runs, gcs=False)
    af = InstalledAirflow(venv, home, env)
    store_url = (tmp_path / "store").as_uri()
    name = f"installed-{uuid.uuid4().hex[:8]}"
    try:
        af.start()
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag("diloco_experiment")
        conf = small_dag_params(name, store_url, ["island-a", "island-b"], token_budget=BUDGET)
        run_id = af.trigger("diloco_experiment", conf)
        state = af.wait_run("diloco_experiment", run_id, timeout_s=420)
        assert state == "success", f"run ended {state}"
        query = urllib.parse.urlencode({"store": store_url, "experiment": name})
        page = af.request("GET", f"/diloco/api/experiment?{query}")
        assert page["experiment"] == name and page["tokens"]["merged"] >= BUDGET
    finally:
        pgids = [p.pid for p in af.procs.values()]
        af.stop()
        alive = groups_still_alive(pgids + stop_islands(runs))
        assert not alive, f"process groups {alive} outlived the test"
