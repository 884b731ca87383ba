"""The installed layout, as Composer and the image deploy it: the wheel built from a clean clone,
installed into a fresh virtualenv where the repo is not on sys.path, an $AIRFLOW_HOME holding
only the thin DAG files, nothing on PYTHONPATH and an empty plugins folder. Airflow of that
virtualenv must list the page and the provider, parse the DAGs, and run a short experiment whose
page API answers.

The harness (process management, REST helpers) is devtools.local_airflow, run from this test's
interpreter; every Airflow component, task and island runs in the fresh virtualenv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

from devtools.local_airflow import LocalAirflow, groups_still_alive, stop_islands
from tests.airflow_fixture import free_port, island_env
from tests.helpers import small_dag_params, tokens_discarded
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
DAG_IDS = {"diloco_experiment", "diloco_maintenance", "diloco_scavenge", "diloco_export_best"}
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


def doc_block(heading: str, fence: str = "```sh") -> str:
    """The first code block under `heading` in docs/AIRFLOW.md, as printed."""
    text = (ROOT / "docs" / "AIRFLOW.md").read_text()
    return text.split(heading, 1)[1].split(fence, 1)[1].split("```", 1)[0]


def deploy_block() -> str:
    """The deploy block ("Deploying: one package and four DAG files") and the pools block
    after it ("Pools"), as printed."""
    deploy = doc_block("## Deploying: one package and four DAG files")
    pools = doc_block("## Pools", "```\n")
    return deploy + pools


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(virtualenv, AIRFLOW_HOME, env): docs/AIRFLOW.md's deploy block run as printed in a clean
    clone, with a fresh virtualenv first on PATH and a new AIRFLOW_HOME (Airflow's defaults:
    `load_examples` on); then the clone is removed, so nothing of the repo is left to import."""
    tmp = tmp_path_factory.mktemp("installed")
    clone = tmp / "clone"
    _run(["git", "clone", "--quiet", ROOT, clone])
    venv = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", venv])
    home = tmp / "airflow_home"
    path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env = _clean_env(AIRFLOW_HOME=str(home), PATH=path, VIRTUAL_ENV=str(venv))
    out = _run(["bash", "-c", "set -euo pipefail\n" + deploy_block()], env, clone, timeout=1200)
    assert "decoupled-diloco" in out and "diloco" in out  # providers list, plugins
    (home / "plugins").mkdir(exist_ok=True)
    shutil.rmtree(clone)  # nothing of the repo is left to import from
    return venv, home, {**env, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}


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


def _choices(help_text: str) -> list[str]:
    """The subcommands an argparse usage line offers: `{a,b,c}`."""
    return help_text.split("{", 1)[1].split("}", 1)[0].split(",")


def test_every_diloco_subcommand_runs_from_the_wheel(installed, tmp_path):
    """The console script of the wheel (no repo on sys.path): every subcommand's and every
    bench's --help (the benches crashed with `No module named 'tests'`, issue 38), and one short
    bench run to its JSON."""
    venv, _, env = installed
    diloco = venv / "bin" / "diloco"
    commands = _choices(_run([diloco, "--help"], env, tmp_path))
    benches = _choices(_run([diloco, "bench", "--help"], env, tmp_path))
    assert {"init", "island", "merge", "export", "delete", "bench"} <= set(commands)
    assert {"quality", "chaos", "science", "scavenge", "wan", "syncer"} <= set(benches)
    for words in [[c] for c in commands if c != "bench"] + [["bench", b] for b in benches]:
        assert "usage: diloco" in _run([diloco, *words, "--help"], env, tmp_path), words
    _run([diloco, "bench", "goodput-sim", "--json", tmp_path / "gs.json"], env, tmp_path)
    assert json.loads((tmp_path / "gs.json").read_text())


def test_example_dag_discovery_with_load_examples_logs_no_error(installed, tmp_path):
    """Airflow's default `load_examples = True`: its example-DAG discovery imports the module
    named after the distribution (`decoupled_diloco`, from the wheel): no traceback."""
    venv, home, env = installed
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from airflow.dag_processing.bundles import manager\n"
        "manager._add_provider_example_dags_to_bundle([])\n"
        "print('ok')\n"
    )
    out = _run(
        [venv / "bin" / "python", "-c", code], {**env, "AIRFLOW__CORE__LOAD_EXAMPLES": "True"}
    )
    assert out.strip().endswith("ok") and "Could not load provider module" not in out


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


def _until(what: str, timeout_s: float, probe):
    """`probe()`'s first truthy value, polled every 2 s; fails naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(2.0)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def _models_asset(af, store_url: str) -> dict | None:
    """The store's models asset as the REST API shows it, once its watcher runs."""
    query = urllib.parse.urlencode({"uri_pattern": Path(store_url[len("file://") :]).name})
    found = [a for a in af.request("GET", f"/api/v2/assets?{query}")["assets"]]
    return next((a for a in found if a["uri"] == store_url and a["watchers"]), None)


def _events(af, asset_id: int) -> list[dict]:
    return af.request("GET", f"/api/v2/assets/events?asset_id={asset_id}")["asset_events"]


def test_a_short_run_succeeds_and_the_page_answers_for_it(installed, tmp_path):
    """Also the Asset events (issue 23 item 5): the example `diloco_export_best`, unpaused before
    the run, is scheduled on the store's models asset; its watcher (in the triggerer) reports
    the run's new best snapshots and `finalize` reports the run's end, both naming the
    experiment; the DAG runs they trigger export the best model, which loads back."""
    from safetensors.numpy import load_file

    venv, home, _ = installed
    runs = tmp_path / "islands"
    store_url = (tmp_path / "store").as_uri()
    exports = tmp_path / "exports"
    env = island_env(runs, gcs=False)
    # the example DAG watches this run's store; the DAG processor re-parses each file every
    # 10 s (default 30), so that the watcher starts soon after the DAG is unpaused
    env |= {
        "DILOCO_EXPORT_STORE": store_url,
        "DILOCO_EXPORT_DIR": str(exports),
        "DILOCO_ASSET_POLL_S": "1",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
    }
    af = InstalledAirflow(venv, home, env)
    name = f"installed-{uuid.uuid4().hex[:8]}"
    try:
        af.start()
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag("diloco_experiment")
        af.wait_dag("diloco_export_best")
        af.unpause("diloco_export_best")
        asset = _until("the models asset's watcher", 120, lambda: _models_asset(af, store_url))
        conf = small_dag_params(name, store_url, ["island-a", "island-b"], token_budget=BUDGET)
        run_id = af.trigger("diloco_experiment", conf)
        state = af.wait_run("diloco_experiment", run_id, timeout_s=420)
        assert state == "success", f"run ended {state}"
        query = urllib.parse.urlencode({"store": store_url, "experiment": name})
        page = af.request("GET", f"/diloco/api/experiment?{query}")
        # finalize recorded the model the run ends with (`diloco export --snapshot final`)
        final = json.loads((tmp_path / "store" / name / "snapshots" / "FINAL.json").read_text())
        assert final["run_id"] == run_id and final["loss"] > 0
        # the page reports the tokens in that model: the budget's, unless finalize restored an
        # earlier best (then fewer, and the restored version says how many it discarded)
        assert page["experiment"] == name
        assert page["tokens"]["merged"] == final["tokens_merged"]
        estore = ExperimentStore(open_store(store_url), name)
        assert page["tokens"]["merged"] + tokens_discarded(estore) >= BUDGET

        def ours(kind: str):
            for ev in _events(af, asset["id"]):
                extra = ev["extra"] or {}
                data = extra.get("payload", extra) if extra.get("from_trigger") else extra
                if data.get("event") == kind and data.get("experiment") == name:
                    return ev, data

        best_event, best = _until("a 'best' event from the watcher", 60, lambda: ours("best"))
        assert best_event["source_dag_id"] is None  # the triggerer's, not a task's
        end_event, end = _until("the 'finished' event", 30, lambda: ours("finished"))
        assert (end_event["source_dag_id"], end_event["source_task_id"]) == (
            "diloco_experiment",
            "finalize",
        )
        assert end["over"] is True and end["experiment_url"] == f"{store_url}/{name}"

        def exported():
            done = [
                r
                for r in af.request("GET", "/api/v2/dags/diloco_export_best/dagRuns")["dag_runs"]
                if r["state"] == "success"
            ]
            return done and sorted((exports / name).glob("best-*/model.safetensors"))

        model = _until("an export by diloco_export_best", 240, exported)[-1]
        config = json.loads((model.parent / "config.json").read_text())
        assert config["experiment"] == name and len(load_file(model)) > 0
        # what someone debugging a task reads first: no task of the run or of the export DAG
        # logged an error (issue 38: a traceback in 54 of 60 task logs on a default Airflow)
        errors = _error_lines(home / "logs")
        assert not errors, "ERROR lines in task logs:\n" + "\n".join(errors[:10])
    finally:
        pgids = [p.pid for p in af.procs.values()]
        af.stop()
        alive = groups_still_alive(pgids + stop_islands(runs))
        assert not alive, f"process groups {alive} outlived the test"


def _error_lines(logs: Path) -> list[str]:
    """`file: line` of every task log line at level error or above: Airflow 3 writes task
    logs as JSON lines (`"level": "error"`), other lines are judged by an ERROR word."""
    found = []
    for path in sorted(logs.rglob("*.log")):
        if "dag_id=" not in str(path):
            continue  # the scheduler's and the DAG processor's own logs: not task logs
        for line in path.read_text(errors="replace").splitlines():
            try:
                level = str(json.loads(line).get("level", "")).lower()
            except (ValueError, AttributeError):
                level = "error" if re.search(r"\bERROR\b", line) else ""
            if level in ("error", "critical", "fatal"):
                found.append(f"{path.relative_to(logs)}: {line[:300]}")
    return found
