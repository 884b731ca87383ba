"""diloco_export_best (an example): export an experiment's model whenever a better one exists

Scheduled on the models asset of one store (`DILOCO_EXPORT_STORE`, default the form's default
store): its watcher in the triggerer reports every new best snapshot of any experiment in that
store, and `finalize` of `diloco_experiment` reports every run that finished. Each event runs
this DAG, which exports that experiment's best snapshot (`diloco export --snapshot best`:
safetensors + config.json) into `DILOCO_EXPORT_DIR/<experiment>/best-<snapshot id>`.

Paused when it first appears, as every DAG: unpause it to start the watcher (the triggerer then
polls the store every `DILOCO_ASSET_POLL_S` seconds). Copy it and change the task to chain your
own work (an evaluation suite, a model registry upload) on new models: `assets.payloads_of` reads
the events, whose extra names the experiment, its URL, the snapshot's versions, loss and tokens.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from diloco_airflow import knobs
from diloco_airflow.assets import models_asset
from diloco_airflow.pools import CONTROL_POOL

STORE = knobs.EXPORT_STORE.get() or knobs.DEFAULT_STORE.get()


@dag(
    dag_id="diloco_export_best",
    schedule=[models_asset(STORE, poll_s=knobs.ASSET_POLL_S.get())],
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={
        "retries": 2,
        "retry_delay": timedelta(seconds=30),
        "execution_timeout": timedelta(hours=1),
        "pool": CONTROL_POOL,
    },
    tags=["diloco", "example"],
    doc_md=__doc__,
)
def diloco_export_best():
    @task
    def export(triggering_asset_events=None) -> list:
        from diloco_airflow.assets import payloads_of
        from diloco_airflow.exports import export_best

        out = []
        for p in payloads_of(triggering_asset_events):
            if any(o["experiment"] == p["experiment"] for o in out):
                continue  # one export per experiment: its best now
            out.append(
                {
                    **export_best(p["store_url"], p["experiment"], knobs.EXPORT_DIR.get()),
                    "event": p["event"],
                }
            )
        return out

    export()
