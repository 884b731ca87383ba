"""The DiLoCo page in a real browser: a real Airflow (all four components) runs a tiny
`diloco_experiment` on fake-gcs-server; headless Chromium (Debian's, driven by Playwright with
`executable_path`: no browser download) opens the page as the logged-in admin, what it shows is
checked against the store, "stop island" and "Stop experiment" are clicked and their control
markers checked, and the run then ends on its own. The screenshot goes to runs/dilocopage.png
(`DILOCO_SCREENSHOT=docs/img/dilocopage.png` for the one README.md shows).

    make browser   # Debian's chromium, when missing
    .venv/bin/python -m pytest -m slow tests/test_ui_browser.py
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from devtools.demo import demo_conf
from tests.airflow_fixture import running_airflow
from tests.gcs_fixture import gcs_bucket  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
# runs/ is not tracked; `DILOCO_SCREENSHOT=docs/img/dilocopage.png` refreshes the README's image
SCREENSHOT = Path(os.environ.get("DILOCO_SCREENSHOT") or ROOT / "runs" / "dilocopage.png")
DAG = "diloco_experiment"
ISLANDS = ["island-a", "island-b"]
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _until(predicate, timeout_s: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_the_page_shows_the_store_and_stops_islands(tmp_path, gcs_bucket):  # noqa: F811
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: run `make browser`")
    from diloco_airflow.store import open_experiment

    name = f"page-{uuid.uuid4().hex[:6]}"
    store_url = f"{gcs_bucket}/page-{uuid.uuid4().hex[:6]}"
    conf = demo_conf(name, store_url, budget=50_000_000)  # ends only when stopped from the page
    conf["islands"] = [
        {"name": n, "speed": 1.0, "backend": "local", "hardware": {}} for n in ISLANDS
    ]
    with running_airflow(tmp_path) as af:
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag(DAG)
        run_id = af.trigger(DAG, conf)
        # a run whose init fails (a budget under one batch per island): its tab shows why
        bad = {**conf, "experiment_name": f"{name}-bad", "token_budget": 100}
        bad_run = af.trigger(DAG, bad)
        estore = _until(lambda: _opened(store_url, name, open_experiment), 180, "the experiment")

        def progressed():
            af.check_alive()
            beats = estore.heartbeats()
            return (
                len(estore.read_metrics("eval")) >= 2
                and len(estore.read_metrics("merge")) >= 3
                and set(beats) >= set(ISLANDS)
            )

        _until(progressed, 240, "two evals, three merges and both islands' heartbeats", 2.0)
        # while the islands run: their wait tasks are labelled with the island, the run's note
        # names the experiment, and each wait task's log has progress lines
        waits = [t for t in af.task_instances(DAG, run_id) if t["task_id"] == "islands_local.wait"]
        assert sorted(t["rendered_map_index"] for t in waits) == [f"{i} (local)" for i in ISLANDS]
        assert name in (af.dag_run(DAG, run_id).get("note") or "")
        log_path = (
            f"/api/v2/dags/{DAG}/dagRuns/{quote(run_id, safe='')}/taskInstances/"
            f"islands_local.wait/logs/{waits[0]['try_number']}?map_index={waits[0]['map_index']}"
        )
        links_path = (
            f"/api/v2/dags/{DAG}/dagRuns/{quote(run_id, safe='')}/taskInstances/"
            f"islands_local.wait/links?map_index={waits[0]['map_index']}"
        )
        links = af.request("GET", links_path)["extra_links"]
        island0 = waits[0]["rendered_map_index"].split(" (")[0]
        assert links == {
            "DiLoCo page": f"/diloco/?run_id={quote(run_id, safe='')}",
            "Island in bucket": "https://console.cloud.google.com/storage/browser/"
            f"{store_url[5:]}/{name}/pseudograds/{island0}",
            "Experiment in bucket": None,  # the merge and setup tasks' link: none on island tasks
        }
        _until(
            lambda: "tok/s, loss" in json.dumps(af.request("GET", log_path)),
            60,
            "a progress line in the wait task's log",
            3.0,
        )

        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            # what the Airflow login leaves in the browser: the _token cookie
            context.add_cookies([{"name": "_token", "value": af.token(), "url": af.base}])
            page = context.new_page()
            page.on("dialog", lambda dialog: dialog.accept())
            page.goto(f"{af.base}/diloco/")  # no query: the page picks the newest experiment
            rows = page.locator("[data-testid=islands] tbody tr")
            sync_api.expect(rows).to_have_count(len(ISLANDS), timeout=30_000)
            row = page.locator("tr[data-island=island-a]")
            sync_api.expect(row.locator("[data-testid=state]")).to_have_text("running")
            assert page.locator("#pick").input_value().find(name) >= 0

            # what it shows against the store (which may only have moved on since)
            shown = [
                int(v) for v in page.locator("[data-testid=snapshot] .v").inner_text().split(",")
            ]
            now = list(estore.current_snapshot().versions)
            assert len(shown) == len(now) and all(s <= n for s, n in zip(shown, now, strict=True))
            merges = int(page.locator("[data-testid=merge-count]").inner_text().replace(",", ""))
            assert 3 <= merges <= len(estore.read_metrics("merge"))
            assert page.locator("[data-testid=eval-point]").count() >= 2
            bucket = page.locator("[data-testid=bucket-link]").get_attribute("href")
            assert (
                bucket == f"https://console.cloud.google.com/storage/browser/{store_url[5:]}/{name}"
            )
            link = page.locator("[data-testid=run-link]").get_attribute("href")
            assert link == f"../dags/{DAG}/runs/{quote(run_id, safe='')}"

            row.locator("button[data-act=stop]").click()
            _until(lambda: "island-a" in estore.stopped_islands(), 15, "control/stop/island-a")
            assert not estore.stop_requested(None)  # one island only
            sync_api.expect(row.locator("button[data-act=stop]")).to_have_text("stopping")

            # the page inside the Airflow UI (Browse -> DiLoCo), for the README
            page.goto(f"{af.base}/plugin/diloco")
            frame = page.frame_locator("iframe")
            sync_api.expect(frame.locator("[data-testid=islands] tbody tr")).to_have_count(
                len(ISLANDS), timeout=30_000
            )
            sync_api.expect(frame.locator("[data-testid=eval-point]").first).to_be_visible()
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))

            # the failed init's run: its one-line reason, not "404: no experiment ..."
            assert af.wait_run(DAG, bad_run, 60) == "failed"
            page.goto(f"{af.base}/diloco/?run_id={quote(bad_run, safe='')}")
            sync_api.expect(page.locator("#msg")).to_contain_text(
                "init failed: invalid config: token_budget 100 is less than one batch",
                timeout=15_000,
            )

            page.goto(f"{af.base}/diloco/")
            page.locator("[data-testid=stop-experiment]").click()
            _until(lambda: estore.stop_requested(None), 15, "control/STOP")
            state = af.wait_run(DAG, run_id, 240)
            # the island is done: its button no longer says "stopping"
            page.goto(f"{af.base}/diloco/?run_id={quote(run_id, safe='')}")
            done = page.locator("tr[data-island=island-a] button[data-act=stop]")
            sync_api.expect(done).to_have_text("stopped", timeout=15_000)
            browser.close()

        assert state == "success", f"run ended {state} after the stops"


def _opened(store_url, name, open_experiment):
    estore = open_experiment(store_url, name)
    try:
        estore.read_config()
    except Exception:
        return None
    return estore
