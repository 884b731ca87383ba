"""Store access for Airflow tasks and triggers: `open_experiment` (what every task uses) and
`DilocoStoreHook`.

`DilocoStoreHook` (optional: no DAG of this project needs a connection) opens an experiment store from an explicit URL (``file:///...``,
``gs://bucket/prefix``) or from an Airflow connection (conn type ``diloco_store``: the URL in the
connection's ``host`` or in its extra as ``store_url``). It is stateless: every call opens what it
needs, so it is safe in triggers (which may run twice, in another process) and in retried tasks.

Nothing here imports jax or a cloud client at import time.
"""

from __future__ import annotations

import os
from typing import Any

try:  # the hook base is only needed inside Airflow; keep the module importable without it
    from airflow.sdk.bases.hook import BaseHook
except ImportError:  # pragma: no cover
    BaseHook = object  # type: ignore[assignment,misc]


def _gcsfs_emulator_guard() -> None:
    # gcsfs 2026.x stalls against emulators unless this is set before it is imported
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def open_root(store_url: str):
    """The `ObjectStore` at `store_url` (nothing contacted; imports the store lazily)."""
    _gcsfs_emulator_guard()
    from training.store.registry import open_store

    return open_store(store_url)


def open_experiment(store_url: str, experiment: str, faults=None):
    """An `ExperimentStore` for one experiment (imports the store lazily). `faults`: the
    process's fault plan, for the tasks that merge in their process (`knobs.fault_plan`)."""
    from training.store.experiment import ExperimentStore

    return ExperimentStore(open_root(store_url), experiment, faults=faults)


class DilocoStoreHook(BaseHook):  # type: ignore[misc]
    """Access to a DiLoCo experiment store, from a URL or an Airflow connection."""

    conn_name_attr = "diloco_conn_id"
    default_conn_name = "diloco_store_default"
    conn_type = "diloco_store"
    hook_name = "DiLoCo store"

    def __init__(self, store_url: str | None = None, diloco_conn_id: str | None = None) -> None:
        if BaseHook is not object:
            super().__init__()
        self.store_url = store_url
        self.diloco_conn_id = diloco_conn_id

    def get_store_url(self) -> str:
        if self.store_url:
            return self.store_url
        conn_id = self.diloco_conn_id or self.default_conn_name
        conn = self.get_connection(conn_id)
        extra: dict[str, Any] = conn.extra_dejson or {}
        url = extra.get("store_url") or conn.host
        if not url:
            raise ValueError(f"connection {conn_id!r} has no store URL (host or extra.store_url)")
        return url

    def experiment(self, name: str):
        return open_experiment(self.get_store_url(), name)

    def check(self) -> None:
        """Fail at once, with the store's own message, when the store is unreachable."""
        store = open_root(self.get_store_url())
        check = getattr(store, "check", None)
        if check is not None:
            check()

    def read_config(self, name: str):

        return self.experiment(name).config()
