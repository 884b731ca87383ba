"""The note of a `diloco_experiment` run names its experiment (a listener of the page plugin).

Runs are told apart by their experiment, not by a timestamp: when a run starts (the scheduler
calls `on_dag_run_running`, in its own session, which it then commits), a run without a note
gets ``experiment NAME in STORE`` from its conf and the form's defaults (the name:
`params.experiment_of`, a new ``diloco-<run>`` when the conf names none), however it was
triggered (the form, the REST API, a schedule), with init's budget warning when there is one
(`experiment_setup.budget_warning`). A note someone wrote is kept.
"""

from __future__ import annotations

from typing import Any

from airflow.listeners import hookimpl

DAG_ID = "diloco_experiment"


def note_for(conf: dict[str, Any] | None, run_id: str) -> str:
    """The note of run `run_id` with this conf (over the form's defaults)."""
    from diloco_airflow import params as form

    conf = conf if isinstance(conf, dict) else {}
    name = form.experiment_of(conf, run_id)
    store = conf.get("store_url") or _default_store()
    note = (
        f"experiment {name} in {store}"
        if isinstance(store, str) and store
        else (f"experiment {name}")
    )
    warning = _budget_warning(conf, name)
    return f"{note}. Warning: {warning}" if warning else note


def _default_store() -> str | None:
    from diloco_airflow import knobs

    return knobs.DEFAULT_STORE.get()


def _budget_warning(conf: dict[str, Any], name: str) -> str | None:
    """init's budget warning for this conf over the form's defaults; None when there is none
    or the conf is not a valid config (init says why)."""
    from diloco_airflow import params as form
    from diloco_airflow.experiment_setup import budget_warning

    try:
        values = {**form.form_values(), **conf, "experiment_name": name}
        return budget_warning(form.config_from_params(values))
    except Exception:
        return None


@hookimpl
def on_dag_run_running(dag_run, msg: str) -> None:
    if dag_run.dag_id != DAG_ID or dag_run.note:
        return
    dag_run.note = note_for(dag_run.conf, dag_run.run_id)
