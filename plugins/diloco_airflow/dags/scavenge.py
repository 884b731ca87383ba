"""diloco_scavenge: extra islands join a running experiment for a time window, then leave.

Its schedule is `DILOCO_SCAVENGE_SCHEDULE` (cron or preset; default none: trigger it by hand);
its window and everything else are the Params form (`training.config.scavenge.ScavengeConfig`).
`plan` checks that the experiment runs and joins the scavenged islands (spot / preemptible
queued resources on `tpu_vm`, processes locally); per island, `join` starts it, `wait`
(deferred) ends when the window closes or the capacity is reclaimed, `leave` writes its stop
marker and records the leave, `teardown` releases it. Structure only: the work is in
plugins/diloco_airflow/scavenge.py, the rules in training/config/scavenge.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task, task_group

from diloco_airflow import knobs
from diloco_airflow.backends.registry import enabled_backends
from diloco_airflow.pools import CONTROL_POOL, pool_for
from diloco_airflow.scavenge import (
    ScavengeWaitOperator,
    join_island,
    leave_island,
    plan_scavenge,
    scavenge_params,
)

RETRY_DELAY = timedelta(seconds=knobs.RETRY_DELAY_S.get())
ISLAND_RETRIES = knobs.ISLAND_RETRIES.get()
# the backends diloco_experiment offers (DILOCO_BACKENDS, at parse time): plan's join returns
# exactly these keys
OFFERED_BACKENDS = enabled_backends()
# always a string (the DAG renders native objects: a bare map index would be an int)
LABEL = "{{ island_label if island_label is defined else 'island ' ~ ti.map_index }}"

default_args = {
    "retries": 2,
    "retry_delay": RETRY_DELAY,
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=10),
    "execution_timeout": timedelta(minutes=30),
    "pool": CONTROL_POOL,
}


def _label(entry: dict) -> None:
    from airflow.sdk import get_current_context

    get_current_context()["island_label"] = entry["label"]


def scavenge_group(backend: str, islands, window):
    """The join -> wait -> leave -> teardown group of one backend, mapped over its islands."""
    pool = pool_for(backend)

    @task_group(group_id=f"scavenge_{backend}")
    def one(island: dict):
        @task(pool=pool, map_index_template=LABEL, retries=ISLAND_RETRIES)
        def join(island: dict, window: dict, run_id=None) -> dict:
            _label(island)
            return join_island(island, window, run_id)

        @task(pool=pool, map_index_template=LABEL, trigger_rule="all_done")
        def leave(island: dict, window: dict, params=None, run_id=None, ti=None) -> dict:
            _label(island)
            ended = ti.xcom_pull(task_ids=f"scavenge_{backend}.wait", map_indexes=ti.map_index)
            return leave_island(
                island,
                window,
                run_id,
                params["leave_timeout_s"],
                min(params["poll_s"], 2.0),
                outcome=(ended or {}).get("status"),  # None: the wait failed
            )

        @task(pool=pool, map_index_template=LABEL)
        def teardown(island: dict) -> None:
            from diloco_airflow.island_tasks import teardown_island

            _label(island)
            teardown_island(island)

        joined = join(island, window)
        wait = ScavengeWaitOperator(
            task_id="wait",
            island=island,
            window=window,
            pool=pool,
            map_index_template=LABEL,
            retries=ISLAND_RETRIES,
            execution_timeout=timedelta(days=7, hours=1),  # the longest window, and then some
            heartbeat_timeout_s=knobs.HEARTBEAT_TIMEOUT_S.get(),
        )
        down = teardown(island).as_teardown(setups=joined)
        joined >> wait >> leave(island, window) >> down

    return one.expand(island=islands)


@dag(
    dag_id="diloco_scavenge",
    schedule=knobs.SCAVENGE_SCHEDULE.get(),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,  # one window at a time: its slots are the next window's
    params=scavenge_params(),
    default_args=default_args,
    tags=["diloco"],
    render_template_as_native_obj=True,
    doc_md=__doc__,
)
def diloco_scavenge():
    @task
    def plan(params=None, dag_run=None) -> dict:
        started = dag_run.start_date.timestamp() if dag_run and dag_run.start_date else None
        return plan_scavenge(dict(params), opened_at=started)

    planned = plan()

    @task
    def select(planned: dict, key: str):
        return planned[key]

    window = select.override(task_id="select_window")(planned, "window")
    for b in OFFERED_BACKENDS:
        scavenge_group(b, select.override(task_id=f"select_{b}")(planned, b), window)
