"""diloco_merge: continuously merge committed pseudo-gradients of every running experiment.

One run at a time: a deferrable sensor waits for committed, unapplied pseudo-gradients (in any
experiment registered by diloco_experiment), a merge task applies them (exactly once: the store's
ledger and compare-and-swap), then new global versions are evaluated on a cadence.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import dag, task
from diloco_airflow import operators as ops
from diloco_airflow.sensors import PendingPseudogradSensor

default_args = {
    "retries": 2,
    "retry_delay": timedelta(seconds=float(os.environ.get("DILOCO_RETRY_DELAY_S", "30"))),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=10),
    "execution_timeout": timedelta(minutes=30),
    "pool": ops.CONTROL_POOL,
}


@dag(
    dag_id="diloco_merge",
    schedule="@continuous",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    max_consecutive_failed_dag_runs=5,
    default_args=default_args,
    tags=["diloco"],
    doc_md=__doc__,
)
def diloco_merge():
    pending = PendingPseudogradSensor(
        task_id="wait_for_pseudograds",
        poll_s=float(os.environ.get("DILOCO_MERGE_POLL_S", "5")),
        idle_timeout_s=float(os.environ.get("DILOCO_MERGE_IDLE_S", "300")),
        execution_timeout=timedelta(hours=1),
    )

    @task
    def merge(experiments: list) -> list:
        return ops.merge_experiments(experiments)

    @task
    def evaluate(merged: list) -> list:
        return [ops.evaluate_if_due(m["store_url"], m["experiment"]) for m in merged]

    evaluate(merge(pending.output))


diloco_merge()
