"""The DiLoCo page in the Airflow UI: plugin.py (the AirflowPlugin, found by Airflow through the
package's `airflow.plugins` entry point), api.py (its FastAPI app), auth.py (Airflow's auth on
every API route), sources.py (stores and runs), page.html."""

from __future__ import annotations

ENTRY_POINT_GROUP = "airflow.plugins"
ENTRY_POINT_VALUE = "diloco_airflow.ui.plugin:DilocoPagePlugin"


def installed_entry_point():
    """The installed entry point that makes Airflow load this plugin, or None when the package
    is not installed (a checkout on PYTHONPATH only: Airflow would show no DiLoCo page)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.value == ENTRY_POINT_VALUE:
            return ep
    return None
