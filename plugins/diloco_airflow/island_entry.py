"""The island entry: everything the island tasks, the trigger, the chaos monkey and the
maintenance DAG need to drive one island, typed.

It travels as JSON (XCom, trigger kwargs, the experiment registry): `IslandEntry.to_dict` on the
way out, `IslandEntry.of` on the way in (a task gets the dict XCom hands it). `island_entry`
builds one from the experiment's config; it decides the island's command line, the backend's
constructor arguments and the environment a local island inherits.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from diloco_airflow import knobs
from diloco_airflow.backends import IslandBackend, IslandSpec, get_backend

PASSED_TO_LOCAL_ISLANDS = (
    "STORAGE_EMULATOR_HOST",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
    "XLA_FLAGS",
)
"""Variables of this process's environment a local island gets too (besides PYTHONPATH)."""


@dataclass(frozen=True)
class IslandEntry:
    """One island of one experiment, as the Airflow tasks see it."""

    name: str
    experiment: str
    store_url: str
    backend: str
    spec: IslandSpec
    heartbeat_s: float
    label: str = ""
    backend_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (the spec as `IslandSpec.to_dict`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["spec"] = self.spec.to_dict()
        out["backend_kwargs"] = dict(self.backend_kwargs)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IslandEntry:
        """The inverse of `to_dict`; raises ValueError naming missing or unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown island entry fields: {sorted(unknown)}")
        missing = {"name", "experiment", "store_url", "backend", "spec", "heartbeat_s"} - set(data)
        if missing:
            raise ValueError(f"island entry lacks {sorted(missing)}")
        return cls(
            **{**data, "spec": IslandSpec.from_dict(data["spec"])},
        )

    @classmethod
    def of(cls, value: IslandEntry | dict[str, Any]) -> IslandEntry:
        """An entry from what a task receives: an entry already, or its dict."""
        return value if isinstance(value, cls) else cls.from_dict(value)

    def make_backend(self) -> IslandBackend:
        """A fresh backend object for this island (backends keep no state that matters)."""
        return get_backend(self.backend, **self.backend_kwargs)


def project_root() -> str | None:
    """The checkout the `training` package is imported from (local islands run there)."""
    spec = importlib.util.find_spec("training")
    if spec is None or not spec.origin:
        return None
    return str(Path(spec.origin).resolve().parent.parent)


def island_command(backend: str, store_url: str, experiment: str, island: str) -> list[str]:
    """The island's command line: this interpreter for a local island, the installed console
    script on a TPU VM / in the image."""
    args = ["island", "--store", store_url, "--experiment", experiment, "--island", island]
    if backend == "local":
        return [sys.executable, "-m", "training.cli", *args]
    return ["diloco", *args]


def backend_kwargs(backend: str) -> dict[str, Any]:
    """Constructor arguments of a backend, JSON-serializable (they travel to the triggerer)."""
    if backend != "local":
        return {}
    kw: dict[str, Any] = {}
    if knobs.RUNS_ROOT.get():
        kw["runs_root"] = knobs.RUNS_ROOT.get()
    root = project_root()
    if root:
        kw["cwd"] = root
    return kw


def local_island_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What a local island gets beyond the inherited environment: the project on PYTHONPATH
    (first) and `PASSED_TO_LOCAL_ISLANDS` that are set here."""
    environ = os.environ if environ is None else environ
    env = {}
    root = project_root()
    if root:
        parts = [root, *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    for key in PASSED_TO_LOCAL_ISLANDS:
        if environ.get(key):
            env[key] = environ[key]
    return env


def island_entry(cfg, isl, ttl_hours: float = 24.0) -> IslandEntry:
    """The entry of island config `isl` of experiment config `cfg`."""
    spec = IslandSpec(
        experiment=cfg.name,
        island=isl.name,
        store_url=cfg.store_url,
        command=island_command(isl.backend, cfg.store_url, cfg.name, isl.name),
        env=local_island_env() if isl.backend == "local" else {},
        hardware=dict(isl.hardware),
        ttl_hours=ttl_hours,
    )
    return IslandEntry(
        name=isl.name,
        experiment=cfg.name,
        store_url=cfg.store_url,
        backend=isl.backend,
        backend_kwargs=backend_kwargs(isl.backend),
        label=f"{isl.name} ({isl.backend})",
        heartbeat_s=cfg.heartbeat_s,
        spec=spec,
    )
