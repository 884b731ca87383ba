"""diloco_maintenance: relaunch stalled islands, delete expired cloud resources, collect garbage.

Scheduled (DILOCO_MAINTENANCE_SCHEDULE, default every 15 minutes); works on the experiments that
diloco_experiment registered.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import dag, task
from diloco_airflow import operators as ops

default_args = {
    "retries": 1,
    "retry_delay": timedelta(minutes=1),
    "retry_exponential_backoff": True,
    "execution_timeout": timedelta(minutes=20),
    "pool": ops.CONTROL_POOL,
}


@dag(
    dag_id="diloco_maintenance",
    schedule=os.environ.get("DILOCO_MAINTENANCE_SCHEDULE", "*/15 * * * *"),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["diloco"],
    doc_md=__doc__,
)
def diloco_maintenance():
    @task
    def relaunch_stalled() -> list:
        from diloco_airflow import retention as gc

        return gc.stop_stalled_islands(ops.registered_experiments())

    @task
    def delete_expired() -> list:
        from diloco_airflow import retention as gc

        return gc.delete_expired_resources(ops.registered_experiments())

    @task
    def collect_garbage() -> list:
        from diloco_airflow import retention as gc

        return gc.collect_all(ops.registered_experiments())

    [relaunch_stalled(), delete_expired(), collect_garbage()]


diloco_maintenance()
