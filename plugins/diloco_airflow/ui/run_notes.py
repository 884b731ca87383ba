"""The note of a `diloco_experiment` run names its experiment (a listener of the page plugin).

Runs are told apart by their experiment, not by a timestamp: when a run starts (the scheduler
calls `on_dag_run_running`, in its own session, which it then commits), a run without a note
gets ``experiment NAME in STORE`` from its conf, however it was triggered (the form, the REST
API, a schedule). A note someone wrote is kept.
"""

from __future__ import annotations

from typing import Any

from airflow.listeners import hookimpl

DAG_ID = "diloco_experiment"


def note_for(conf: dict[str, Any] | None) -> str | None:
    """The note of a run with this conf; None without an experiment name."""
    conf = conf if isinstance(conf, dict) else {}
    name = conf.get("experiment_name")
    if not isinstance(name, str) or not name:
        return None
    store = conf.get("store_url")
    return (
        f"experiment {name} in {store}"
        if isinstance(store, str) and store
        else f"experiment {name}"
    )


@hookimpl
def on_dag_run_running(dag_run, msg: str) -> None:
    if dag_run.dag_id != DAG_ID or dag_run.note:
        return
    note = note_for(dag_run.conf)
    if note:
        dag_run.note = note
