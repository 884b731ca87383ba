"""The backends' registry: a backend by name, its module imported only when asked for.

``BACKENDS`` is `training.config.experiment.Backend`'s list (the config's type is the one source: the
trigger form's enum and the DAG's task groups derive from it). This module imports the backend
modules lazily, and they import only `base` and `common`: no cycle.
"""

from __future__ import annotations

import importlib
from typing import Any, get_args

from training.config.experiment import Backend

from .base import IslandBackend

BACKENDS: tuple[str, ...] = tuple(get_args(Backend))
"""Backend names, in the config's order: ``local``, ``tpu_vm``, ``gke``."""

_CLASSES = {
    "local": (".local", "LocalBackend"),
    "tpu_vm": (".tpu_vm", "TpuVmBackend"),
    "gke": (".gke", "GkeBackend"),
}


def enabled_backends(setting: str | None = None) -> tuple[str, ...]:
    """The backends `diloco_experiment` offers: ``DILOCO_BACKENDS`` (`knobs.BACKENDS`, read
    now; `setting` instead when given), in the config's order; every backend when unset.

    Raises ValueError naming an unknown backend (the DAG then fails to parse, with that line)."""
    from diloco_airflow import knobs

    text = knobs.BACKENDS.get() if setting is None else setting
    if not text:
        return BACKENDS
    wanted = {b.strip() for b in text.split(",") if b.strip()}
    unknown = sorted(wanted - set(BACKENDS))
    if unknown or not wanted:
        raise ValueError(
            f"{knobs.BACKENDS.name}={text!r}: unknown backend(s) {unknown}; choose from "
            f"{', '.join(BACKENDS)}"
        )
    return tuple(b for b in BACKENDS if b in wanted)


def get_backend(name: str, **kwargs: Any) -> IslandBackend:
    """Build a backend by name: ``local``, ``tpu_vm`` or ``gke`` (imports the module lazily)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown island backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module, __package__), cls)(**kwargs)
