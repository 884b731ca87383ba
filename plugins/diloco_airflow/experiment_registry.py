"""The experiment registry: which experiments `diloco_experiment` runs, for the maintenance DAG
(and the UI). One Airflow Variable, JSON::

    {"<store_url>|<experiment>": {"store_url", "experiment", "registered_at",
                                  "islands": {"<island>": IslandEntry.to_dict(), ...}}}

`init` registers the islands of each run; `finalize` unregisters the experiment once every island
of its config is done. Written by read-modify-write of the Variable (the control pool serializes
init and finalize well enough for a registry that only guides maintenance).
"""

from __future__ import annotations

import time
from typing import Any

from diloco_airflow.island_entry import IslandEntry

REGISTRY_VARIABLE = "diloco_experiments"
"""The Airflow Variable (JSON) naming the running experiments."""


def _key(store_url: str, experiment: str) -> str:
    return f"{store_url}|{experiment}"


def _registry() -> dict[str, dict[str, Any]]:
    from airflow.sdk import Variable

    try:
        value = Variable.get(REGISTRY_VARIABLE, deserialize_json=True)
    except Exception:  # not set yet
        return {}
    return value if isinstance(value, dict) else {}


def registered_experiments() -> list[dict[str, Any]]:
    """The registry's values (islands as entry dicts: `IslandEntry.of` reads them)."""
    return list(_registry().values())


def register_experiment(store_url: str, experiment: str, islands: list[IslandEntry]) -> None:
    """Add (or refresh) these islands of the experiment."""
    from airflow.sdk import Variable

    reg = _registry()
    key = _key(store_url, experiment)
    entry = reg.get(key) or {"store_url": store_url, "experiment": experiment, "islands": {}}
    entry["islands"].update({i.name: i.to_dict() for i in map(IslandEntry.of, islands)})
    entry["registered_at"] = entry.get("registered_at") or time.time()
    reg[key] = entry
    Variable.set(REGISTRY_VARIABLE, reg, serialize_json=True)


def unregister_experiment(store_url: str, experiment: str) -> None:
    """Drop the experiment (no-op when it is not registered)."""
    from airflow.sdk import Variable

    reg = _registry()
    if reg.pop(_key(store_url, experiment), None) is not None:
        Variable.set(REGISTRY_VARIABLE, reg, serialize_json=True)
