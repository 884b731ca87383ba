"""diloco_maintenance: relaunch stalled islands, delete expired cloud resources, collect garbage.

Scheduled (DILOCO_MAINTENANCE_SCHEDULE, default every 15 minutes); works on the experiments that
diloco_experiment registered.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from diloco_airflow import knobs
from diloco_airflow.experiment_registry import registered_experiments
from diloco_airflow.pools import CONTROL_POOL

default_args = {
    "retries": 1,
    "retry_delay": timedelta(minutes=1),
    "retry_exponential_backoff": True,
    "execution_timeout": timedelta(minutes=20),
    "pool": CONTROL_POOL,
}


@dag(
    dag_id="diloco_maintenance",
    schedule=knobs.MAINTENANCE_SCHEDULE.get(),
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
        from diloco_airflow import maintenance

        return maintenance.stop_stalled_islands(registered_experiments())

    @task
    def delete_expired() -> list:
        from diloco_airflow import maintenance

        return maintenance.delete_expired_resources(registered_experiments())

    @task
    def collect_garbage() -> list:
        from diloco_airflow import retention as gc

        return gc.collect_all(registered_experiments())

    [relaunch_stalled(), delete_expired(), collect_garbage()]
