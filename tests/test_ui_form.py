"""The trigger form in a real browser (issue 24): Airflow's own form for `diloco_experiment`,
as a user meets it, on a real Airflow (all four components) and fake-gcs-server, driven by
headless Chromium (Debian's, through Playwright).

One test, in the order a user goes: the form opens with the demo's setup as its defaults; a
number typed out of bounds is kept as typed (no `min` that clamps H 0 to 1); a store URL the
schema refuses starts no run and its reason is one line in the form (the plugin's middleware:
no jsonschema dump); the corrected form, with only a small budget typed, starts a run; the run
succeeds and its DiLoCo tab says "Finished" (the budget merged), not "STOP requested".

    make browser   # Debian's chromium, when missing
    .venv/bin/python -m pytest -m slow tests/test_ui_form.py
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from urllib.parse import quote, unquote

import pytest

from tests.airflow_fixture import running_airflow
from tests.gcs_fixture import gcs_bucket  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

DAG = "diloco_experiment"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# three islands of the form's defaults: one interval is 20 steps x 16 x 64 = 20,480 tokens per
# island, so 30,000 tokens end the run within the first interval of each
BUDGET = 30_000


def test_the_form_refuses_in_one_line_then_runs_its_defaults_to_finished(tmp_path, gcs_bucket):  # noqa: F811
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: run `make browser`")
    from diloco_airflow.params import form_values

    defaults = form_values()
    store_url = f"{gcs_bucket}/form-{uuid.uuid4().hex[:6]}"
    expect = sync_api.expect
    with running_airflow(tmp_path) as af:
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag(DAG)
        af.unpause(DAG)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.add_cookies([{"name": "_token", "value": af.token(), "url": af.base}])
            page = context.new_page()
            page.goto(f"{af.base}/dags/{DAG}")
            page.get_by_role("button", name="Trigger").first.click()
            dialog = page.locator("[role=dialog][data-state=open]")
            names = ("H", "fragments", "store_url", "token_budget")
            field = {n: dialog.locator(f"input[name=element_{n}]") for n in names}
            expect(field["H"]).to_have_value(str(defaults["H"]), timeout=30_000)
            assert (defaults["H"], defaults["fragments"], len(defaults["islands"])) == (20, 4, 3)
            expect(field["fragments"]).to_have_value("4")

            # out of bounds, kept as typed (the API refuses it; the input does not rewrite it)
            field["H"].fill("0")
            field["store_url"].click()  # blur
            expect(field["H"]).to_have_value("0")
            field["H"].fill("20")

            # refused by the schema: no run, the reason in one line inside the form
            field["store_url"].fill("s3://x/y")
            dialog.get_by_role("button", name="Trigger").last.click()
            reason = dialog.get_by_text("Invalid input for param store_url: 's3://x/y' does not")
            expect(reason).to_have_count(1, timeout=15_000)
            assert "Failed validating" not in dialog.inner_text()
            assert af.request("GET", f"/api/v2/dags/{DAG}/dagRuns")["total_entries"] == 0
            # Airflow's toast ("Failed to Trigger Dag / Bad Request") covers the Trigger button
            # until it goes away by itself
            toast = page.locator("[data-scope=toast][data-part=root]")
            expect(toast).to_contain_text("Failed to Trigger Dag")
            page.mouse.move(5, 5)  # a toast under the pointer stays
            expect(toast).to_have_count(0, timeout=30_000)

            # corrected, a small budget typed, everything else the defaults: a run starts
            field["store_url"].fill(store_url)
            field["token_budget"].fill(str(BUDGET))
            dialog.get_by_role("button", name="Trigger").last.click()
            page.wait_for_url("**/runs/**", timeout=30_000)
            run_id = unquote(page.url.split("/runs/", 1)[1].split("/")[0].split("?")[0])
            state = af.wait_run(DAG, run_id, 420)
            assert state == "success", f"run ended {state}"

            # the finished state on the run's DiLoCo tab
            page.goto(f"{af.base}/diloco/?run_id={quote(run_id, safe='')}")
            expect(page.locator("[data-testid=finished]")).to_contain_text(
                "Finished: the token budget is merged", timeout=30_000
            )
            expect(page.locator("#warning")).to_have_text("")
            browser.close()
