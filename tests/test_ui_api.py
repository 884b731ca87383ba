"""The DiLoCo page's API (plugins/diloco_airflow/ui/): Airflow's auth on every route and the JSON
it serves, against a real server (tests/ui_server.py): the page's FastAPI app beside Airflow's
SimpleAuthManager app, on a migrated metadata DB of a private AIRFLOW_HOME, and a file:// store
written through the real ExperimentStore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.airflow_fixture import free_port
from tests.helpers import new_store, small_config
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

ROOT = Path(__file__).resolve().parents[1]
USERS = "admin:admin,viewer:viewer,editor:user"


def _env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": USERS,
        "AIRFLOW__API_AUTH__JWT_SECRET": "x" * 64,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
        "JAX_PLATFORMS": "cpu",
    }


def _seed(store_url: str) -> None:
    """Two experiments: `plain` with islands a, b (heartbeats, a merge, an eval, a quarantined
    pseudo-gradient) and `wild` in chaos mode with a non-local island."""
    cfg = small_config("plain", islands=("a", "b"))
    estore = new_store(cfg, store_url)
    now = time.time()
    estore.write_heartbeat("a", dict(step=12, tokens=1536, loss=3.25, time=now, base_version=[0]))
    estore.append_metric(
        "merge",
        dict(
            versions={"0": 1},
            version=1,
            applied=1,
            quarantined=0,
            tokens_merged=512,
            at=now,
            contributions=[
                dict(
                    island="a",
                    fragment=0,
                    weight=1.0,
                    staleness=0,
                    tokens=512,
                    loss=3.5,
                    published_at=now - 2.0,
                    merged_at=now,
                )
            ],
        ),
    )
    estore.append_metric("eval", dict(version=1, loss=3.4, tokens_merged=512, at=now))
    estore.quarantine("b/00000003-f000", "norm 1e9 is over 1000 x the median")
    wild = small_config(
        "wild",
        islands=({"name": "a"}, {"name": "t", "backend": "tpu_vm"}),
        chaos={"slow_island": "a", "slow_factor": 2.0},
    )
    new_store(wild, store_url)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    home, store_url = tmp / "airflow_home", f"file://{tmp / 'store'}"
    home.mkdir()
    env = _env(home)
    airflow = Path(sys.executable).with_name("airflow")
    migrate = subprocess.run(
        [str(airflow), "db", "migrate"], env=env, capture_output=True, text=True, timeout=180
    )
    assert migrate.returncode == 0, migrate.stderr[-2000:]
    _seed(store_url)
    port = free_port()
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "ui_server.py"), str(port), store_url],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/diloco/", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the API server did not start"
                time.sleep(0.2)
        passwords = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())
        tokens = {
            user: call(base, "POST", "/auth/token", {"username": user, "password": pw})[1][
                "access_token"
            ]
            for user, pw in passwords.items()
        }
        yield dict(base=base, store=store_url, tokens=tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def call(base, method, path, body=None, token=None, cookie=None):
    """(status, JSON body) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if cookie:
        req.add_header("Cookie", f"_token={cookie}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def q(text):
    return urllib.parse.quote(text, safe="")


def test_no_token_is_401(server):
    assert call(server["base"], "GET", "/diloco/api/experiments")[0] == 401


def test_a_forged_token_is_401(server):
    forged = server["tokens"]["viewer"][:-4] + "AAAA"
    assert call(server["base"], "GET", "/diloco/api/experiments", token=forged)[0] == 401


def test_a_viewer_reads_through_the_ui_cookie(server):
    code, body = call(server["base"], "GET", "/diloco/api/me", cookie=server["tokens"]["viewer"])
    assert (code, body) == (200, {"user": "viewer", "can_edit": False})


def test_a_viewer_may_not_stop_an_island(server):
    body = {"store": server["store"], "experiment": "plain", "island": "a"}
    token = server["tokens"]["viewer"]
    assert call(server["base"], "POST", "/diloco/api/stop", body, token=token)[0] == 403


def test_an_editor_stops_an_island_with_its_marker(server):
    body = {"store": server["store"], "experiment": "plain", "island": "b"}
    token = server["tokens"]["editor"]
    assert call(server["base"], "POST", "/diloco/api/stop", body, token=token)[0] == 200
    estore = ExperimentStore(open_store(server["store"]), "plain")
    assert estore.stopped_islands() == {"b"} and not estore.stop_requested(None)


def test_kill_is_refused_outside_chaos_mode(server):
    body = {"store": server["store"], "experiment": "plain", "island": "a"}
    code, _ = call(
        server["base"], "POST", "/diloco/api/kill", body, token=server["tokens"]["admin"]
    )
    assert code == 409


def test_kill_is_refused_for_a_non_local_island(server):
    body = {"store": server["store"], "experiment": "wild", "island": "t"}
    code, out = call(
        server["base"], "POST", "/diloco/api/kill", body, token=server["tokens"]["admin"]
    )
    assert (code, out["detail"]) == (409, "kill works on local islands only (tpu_vm)")


def test_an_unknown_store_is_404_and_never_opened(server):
    path = f"/diloco/api/experiment?store={q('file:///etc')}&experiment=passwd"
    assert call(server["base"], "GET", path, token=server["tokens"]["admin"])[0] == 404


def test_the_list_names_both_experiments_with_their_progress(server):
    code, body = call(
        server["base"], "GET", "/diloco/api/experiments", token=server["tokens"]["viewer"]
    )
    rows = {r["experiment"]: r for r in body["experiments"]}
    assert code == 200 and set(rows) == {"plain", "wild"}
    assert (rows["plain"]["versions"], rows["wild"]["chaos"]) == ([0], True)


def test_the_experiment_json_matches_the_store(server):
    path = f"/diloco/api/experiment?store={q(server['store'])}&experiment=plain"
    code, d = call(server["base"], "GET", path, token=server["tokens"]["viewer"])
    assert code == 200
    islands = {i["island"]: i for i in d["islands"]}
    assert (islands["a"]["state"], islands["a"]["step"], islands["a"]["tokens"]) == (
        "running",
        12,
        1536,
    )
    assert islands["b"]["state"] == "not started"
    assert [p["loss"] for p in d["evals"]] == [3.4]
    assert [p["loss"] for p in d["island_losses"]["a"]] == [3.5]
    assert d["merges"][0]["contributions"][0]["latency_s"] == pytest.approx(2.0)
    assert d["quarantine"] == [
        {"id": "b/00000003-f000", "island": "b", "reason": "norm 1e9 is over 1000 x the median"}
    ]
    assert (d["snapshot"]["versions"], d["tokens"]["budget"], d["can_edit"]) == ([0], 10**9, False)


def test_the_page_is_self_contained(server):
    with urllib.request.urlopen(server["base"] + "/diloco/", timeout=10) as resp:
        html = resp.read().decode()
    assert "<script" in html and "src=" not in html and "://" not in html


def test_the_page_link_opens_the_run_and_only_on_diloco_runs():
    from airflow.models.taskinstancekey import TaskInstanceKey
    from diloco_airflow.ui.links import DilocoPageLink

    link = DilocoPageLink()
    ours = TaskInstanceKey("diloco_experiment", "init", "manual__2026-01-01T00:00:00+00:00", 1)
    other = TaskInstanceKey("diloco_maintenance", "gc", "r", 1)
    assert link.get_link(None, ti_key=ours) == (
        "/diloco/?run_id=manual__2026-01-01T00%3A00%3A00%2B00%3A00"
    )
    assert link.get_link(None, ti_key=other) == ""


def test_a_runs_note_names_its_experiment_unless_it_has_one():
    from types import SimpleNamespace

    from diloco_airflow.ui.run_notes import on_dag_run_running

    conf = {"experiment_name": "e1", "store_url": "gs://b/p"}
    run = SimpleNamespace(dag_id="diloco_experiment", note=None, conf=conf, run_id="r")
    on_dag_run_running(dag_run=run, msg="started")
    assert run.note == "experiment e1 in gs://b/p"
    kept = SimpleNamespace(dag_id="diloco_experiment", note="mine", conf=conf, run_id="r")
    on_dag_run_running(dag_run=kept, msg="started")
    assert kept.note == "mine"


def test_a_scheduled_run_gets_a_note_naming_its_own_experiment(monkeypatch):
    """A schedule's run has no conf: its experiment is a new one, named after the run."""
    from diloco_airflow.ui.run_notes import note_for

    monkeypatch.setenv("DILOCO_DEFAULT_STORE", "gs://b/p")
    note = note_for({}, "scheduled__2026-12-03T20:03:00+00:00")
    assert note == "experiment diloco-scheduled-20261203t200300 in gs://b/p"


def test_a_runs_note_carries_the_budget_warning():
    from diloco_airflow.ui.run_notes import note_for

    note = note_for({"experiment_name": "e1", "store_url": "gs://b/p", "token_budget": 10**15}, "r")
    assert note.startswith("experiment e1 in gs://b/p. Warning: token_budget 1,000,000,000,000,000")


def test_bucket_links_open_the_cloud_console_for_gs_stores_only():
    from diloco_airflow.ui.links import bucket_link

    run = {"store": "gs://b/p", "experiment": "e"}
    console = "https://console.cloud.google.com/storage/browser/b/p/e"
    assert bucket_link(run) == console
    assert bucket_link(run, "island-a") == f"{console}/pseudograds/island-a"
    assert bucket_link({"store": "file:///tmp/s", "experiment": "e"}) == ""
    assert bucket_link(None) == ""


def test_the_experiment_bucket_link_is_on_the_merge_tasks_not_the_island_tasks(monkeypatch):
    from airflow.models.taskinstancekey import TaskInstanceKey
    from diloco_airflow.ui import links

    link, run = links.ExperimentBucketLink(), {"store": "gs://b", "experiment": "e"}
    monkeypatch.setattr(links, "_run_of", lambda ti_key: run)  # the metadata DB's answer
    syncer = TaskInstanceKey("diloco_experiment", "syncer", "r", 1, 0)
    island = TaskInstanceKey("diloco_experiment", "islands_local.wait", "r", 1, 0)
    assert link.get_link(None, ti_key=syncer).endswith("/storage/browser/b/e")
    assert link.get_link(None, ti_key=island) == ""
