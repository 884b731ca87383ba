"""What Airflow's ProvidersManager reads through the `apache_airflow_provider` entry point
(pyproject.toml), in the format of Airflow's own providers (`airflow/provider_info.schema.json`):
the `diloco_store` connection type with its hook, and the extra links on the DAG's tasks.

The page itself (the `fastapi_apps`, the menu entry, the run tab, the run-notes listener) is the
plugin of the `airflow.plugins` entry point (`diloco_airflow.ui.plugin.DilocoPagePlugin`).
Nothing here imports Airflow: the manager calls this function in any process.
"""

from __future__ import annotations

from importlib import metadata

PACKAGE = "decoupled-diloco"


def _version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0+unknown"


def get_provider_info() -> dict:
    return {
        "package-name": PACKAGE,
        "name": "Decoupled DiLoCo",
        "description": "Decoupled DiLoCo training orchestrated by Airflow: islands, syncer "
        "shards, the DiLoCo page and the experiment store.\n",
        "versions": [_version()],
        "integrations": [
            {
                "integration-name": "Decoupled DiLoCo",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {
                "integration-name": "Decoupled DiLoCo",
                "python-modules": ["diloco_airflow.store"],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "diloco_airflow.store.DilocoStoreHook",
                "hook-name": "DiLoCo store",
                "connection-type": "diloco_store",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "port", "login", "password"],
                    "relabeling": {"host": "Store URL"},
                    "placeholders": {
                        "host": "gs://bucket/prefix or file:///path",
                        "extra": '{"store_url": "gs://bucket/prefix"} (instead of the host)',
                    },
                },
            }
        ],
        "triggers": [
            {
                "integration-name": "Decoupled DiLoCo",
                "python-modules": ["diloco_airflow.triggers", "diloco_airflow.assets"],
            }
        ],
        "extra-links": [
            "diloco_airflow.ui.links.DilocoPageLink",
            "diloco_airflow.ui.links.IslandBucketLink",
            "diloco_airflow.ui.links.ExperimentBucketLink",
        ],
    }
