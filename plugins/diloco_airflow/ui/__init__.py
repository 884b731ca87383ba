"""The DiLoCo page in the Airflow UI: plugin.py (the AirflowPlugin), api.py (its FastAPI app),
auth.py (Airflow's auth on every API route), sources.py (stores and runs), page.html."""

from __future__ import annotations

from pathlib import Path

SHIM_NAME = "diloco_page.py"
SHIM = (
    '"""Loads the DiLoCo page plugin (plugins/diloco_airflow/ui/plugin.py)."""\n\n'
    "from diloco_airflow.ui.plugin import DilocoPagePlugin  # noqa: F401\n"
)


def install_shim(plugins_folder: str | Path) -> Path:
    """Write the one-line module that makes Airflow load the page plugin into Airflow's plugins
    folder (the project's plugins/ itself is on PYTHONPATH, not Airflow's plugins folder)."""
    folder = Path(plugins_folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SHIM_NAME
    if not path.exists() or path.read_text() != SHIM:
        path.write_text(SHIM)
    return path
