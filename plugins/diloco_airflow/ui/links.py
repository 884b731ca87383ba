"""Extra links on the tasks of `diloco_experiment` runs (global links of the page plugin):
"DiLoCo page" (the page showing the run's experiment) on every task, "Island in bucket" (the
island's pseudo-gradients in the Cloud console) on the island tasks, and "Experiment in bucket"
(the experiment's prefix) on the others: the merge shards, the evaluator, init, finalize. The
bucket links exist for gs:// stores only (`bucket_link`): a file:// store has no page to open.

Global links are computed by the api-server when a task's links are asked for (it has the
metadata DB); on tasks of other DAGs, and where no URL applies, they are empty (the UI shows
them disabled).
"""

from __future__ import annotations

from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

DAG_ID = "diloco_experiment"


def _root() -> str:
    try:
        from airflow.api_fastapi.app import API_ROOT_PATH

        return API_ROOT_PATH or "/"
    except Exception:
        return "/"


def page_url(run_id: str, root: str = "/") -> str:
    """The page, opened on the experiment of run `run_id`."""
    return f"{root.rstrip('/')}/diloco/?run_id={quote(run_id, safe='')}"


class DilocoPageLink(BaseOperatorLink):
    name = "DiLoCo page"

    def get_link(self, operator, *, ti_key) -> str:
        if ti_key.dag_id != DAG_ID:
            return ""
        return page_url(ti_key.run_id, _root())


def _island_of(ti_key) -> str | None:
    """The island of a mapped island task: its rendered label "name (backend)"."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalar(
            select(TI).where(
                TI.dag_id == ti_key.dag_id,
                TI.run_id == ti_key.run_id,
                TI.task_id == ti_key.task_id,
                TI.map_index == ti_key.map_index,
            )
        )
        label = ti.rendered_map_index if ti is not None else None
    return label.split(" (")[0] if label else None


def bucket_link(run: dict | None, island: str | None = None) -> str:
    """The Cloud console URL of run `run`'s experiment ({"store", "experiment"}), or of
    `island`'s pseudo-gradients in it; "" without a run or for a store that is not gs://."""
    from training.views.dashboard import bucket_url

    if not run or not str(run.get("store", "")).startswith("gs://"):
        return ""
    return bucket_url(run["store"], run["experiment"], f"pseudograds/{island}" if island else "")


def _run_of(ti_key) -> dict | None:
    from diloco_airflow.ui.sources import AirflowSource

    return AirflowSource().resolve_run(ti_key.run_id)


class IslandBucketLink(BaseOperatorLink):
    name = "Island in bucket"

    def get_link(self, operator, *, ti_key) -> str:
        if ti_key.dag_id != DAG_ID or not ti_key.task_id.startswith("islands_"):
            return ""
        island = _island_of(ti_key)
        return bucket_link(_run_of(ti_key), island) if island else ""


class ExperimentBucketLink(BaseOperatorLink):
    name = "Experiment in bucket"

    def get_link(self, operator, *, ti_key) -> str:
        if ti_key.dag_id != DAG_ID or ti_key.task_id.startswith("islands_"):
            return ""
        return bucket_link(_run_of(ti_key))
