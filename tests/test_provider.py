"""The Airflow layer as an installed provider: Airflow itself, in a process started outside the
checkout with nothing on PYTHONPATH and an empty plugins folder, finds the DiLoCo page (the
`airflow.plugins` entry point) and the provider (`apache_airflow_provider`: connection type,
hook, extra links) of the installed package. The wheel in a fresh virtualenv: test_installed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from diloco_airflow.get_provider_info import get_provider_info

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def _airflow(tmp_path, *args: str) -> str:
    home = tmp_path / "airflow_home"
    (home / "plugins").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    out = subprocess.run(
        [AIRFLOW, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_provider_info_is_valid_under_airflows_own_schema():
    import jsonschema
    from airflow import providers_manager  # noqa: F401 (the schema ships beside it)

    schema_path = Path(sys.modules["airflow"].__file__).with_name("provider_info.schema.json")
    jsonschema.validate(get_provider_info(), json.loads(schema_path.read_text()))


def test_every_class_the_provider_names_imports():
    from importlib import import_module

    info = get_provider_info()
    names = [c["hook-class-name"] for c in info["connection-types"]] + info["extra-links"]
    for name in names:
        module, _, cls = name.rpartition(".")
        assert hasattr(import_module(module), cls), name


def test_airflow_lists_the_page_plugin_from_the_entry_point(tmp_path):
    plugins = json.loads(_airflow(tmp_path, "plugins", "--output", "json"))
    (diloco,) = [p for p in plugins if p["name"] == "diloco"]
    assert "group='airflow.plugins'" in str(diloco["source"])  # not a file in a plugins folder


def test_airflow_lists_the_provider_with_its_version(tmp_path):
    from importlib.metadata import version

    providers = json.loads(_airflow(tmp_path, "providers", "list", "--output", "json"))
    (ours,) = [p for p in providers if p["package_name"] == "decoupled-diloco"]
    assert ours["version"] == version("decoupled-diloco")


def test_the_connection_type_maps_to_the_store_hook(tmp_path):
    hooks = json.loads(_airflow(tmp_path, "providers", "hooks", "--output", "json"))
    (ours,) = [h for h in hooks if h["connection_type"] == "diloco_store"]
    assert ours["class"] == "diloco_airflow.store.DilocoStoreHook"


@pytest.mark.parametrize("field", ["host", "store_url"])
def test_the_hook_reads_the_store_url_from_a_connection(monkeypatch, field):
    from diloco_airflow.store import DilocoStoreHook

    conn = {"conn_type": "diloco_store"}
    if field == "host":
        conn["host"] = "file:///tmp/diloco-store"
    else:
        conn["extra"] = {"store_url": "file:///tmp/diloco-store"}
    monkeypatch.setenv("AIRFLOW_CONN_DILOCO_STORE_DEFAULT", json.dumps(conn))
    assert DilocoStoreHook().get_store_url() == "file:///tmp/diloco-store"


def test_example_dag_discovery_finds_the_providers_module(tmp_path):
    """Airflow with its default `load_examples = True` imports a module named after each
    provider's distribution (`decoupled-diloco` -> `decoupled_diloco`) for example DAGs: it
    imports, and Airflow's own discovery logs no traceback for it (it did in 54 of 60 task
    logs before, issue 38)."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from airflow.dag_processing.bundles import manager\n"
        "configs = []\n"
        "manager._add_provider_example_dags_to_bundle(configs)\n"
        "print('BUNDLES', [c.name for c in configs])\n"
    )
    home = tmp_path / "airflow_home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="True")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "BUNDLES" in out.stdout
    assert "Could not load provider module" not in out.stdout + out.stderr
