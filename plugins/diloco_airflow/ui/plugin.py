"""The Airflow plugin that puts the DiLoCo page in the UI (Airflow 3.3 `fastapi_apps` and
`external_views`).

- `/diloco/`: the page and its API (api.py), mounted in the api-server.
- "DiLoCo" in the navigation bar (Browse menu) shows it inside the Airflow UI, and every
  `diloco_experiment` run gets a "DiLoCo" tab showing its experiment.
- Extra links on its tasks: "DiLoCo page", "Island in bucket" on island tasks, "Experiment in
  bucket" on the merge shards and the other tasks (links.py).
- A listener (run_notes.py): every run's note names its experiment.
- A root middleware (form_errors.py): a value the trigger form's schema refuses is reported in
  one line, not jsonschema's dump of the schema.

Airflow loads it through the `airflow.plugins` entry point of the installed package
(pyproject.toml), on every deployment alike: `pip install` is all it takes, no file in Airflow's
plugins folder and nothing on PYTHONPATH (`diloco_airflow.ui.installed_entry_point`).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/diloco"


def _app():
    from diloco_airflow.ui.api import create_app

    return create_app()


def _links() -> list:
    from diloco_airflow.ui.links import DilocoPageLink, ExperimentBucketLink, IslandBucketLink

    return [DilocoPageLink(), IslandBucketLink(), ExperimentBucketLink()]


def _listeners() -> list:
    from diloco_airflow.ui import run_notes

    return [run_notes]


def _middlewares() -> list:
    from diloco_airflow.ui.form_errors import OneLineParamErrors

    return [{"middleware": OneLineParamErrors, "name": "DiLoCo: refused form values in one line"}]


class DilocoPagePlugin(AirflowPlugin):
    name = "diloco"
    global_operator_extra_links = _links()
    listeners = _listeners()
    fastapi_apps = [{"app": _app(), "url_prefix": URL_PREFIX, "name": "DiLoCo page"}]
    fastapi_root_middlewares = _middlewares()
    external_views = [
        {
            "name": "DiLoCo",
            "href": f"{URL_PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "diloco",
        },
        {
            "name": "DiLoCo",
            "href": f"{URL_PREFIX}/?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "diloco-run",
        },
    ]
