"""The experiments in a store: `diloco list` and the Airflow page's experiment list.

An experiment is a top-level folder `<root>/<name>/` holding `config.json` (docs/STORE.md).
Folders are found without listing the whole store where the backend can say what its top-level
"folders" are (a directory scan on file://, a delimiter listing on gs://); elsewhere (memory://)
the listing is filtered. Names outside `training.config.names.NAME_PATTERN` are ignored.
"""

from __future__ import annotations

import os

from training.config.names import NAME_PATTERN
from training.store.objectstore import ObjectStore

CONFIG = "config.json"


def _top_level_names(store: ObjectStore) -> list[str]:
    """Candidate experiment names: the store's top-level folders."""
    kind = type(store).__name__
    if kind == "LocalStore":
        try:
            return [e.name for e in os.scandir(store.root) if e.is_dir()]
        except FileNotFoundError:
            return []
    if kind == "GCSStore":
        root = f"{store.prefix}/" if store.prefix else ""
        blobs = store._client().list_blobs(
            store.bucket, prefix=root, delimiter="/", retry=None, timeout=store.timeout
        )
        for _ in blobs:  # the prefixes are filled in while the pages are read
            pass
        return [p[len(root) :].rstrip("/") for p in blobs.prefixes]
    return sorted({key.split("/", 1)[0] for key in store.list("") if "/" in key})


def list_experiments(store: ObjectStore) -> list[str]:
    """Names of the experiments in `store` (folders with a config.json), sorted."""
    names = sorted(n for n in _top_level_names(store) if NAME_PATTERN.fullmatch(n))
    return [n for n in names if store.exists(f"{n}/{CONFIG}")]
