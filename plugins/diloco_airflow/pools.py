"""Airflow pools of the DiLoCo DAGs (create them with ``include_deferred``: deferred island
waits and syncer shards hold their slot)."""

from __future__ import annotations

CONTROL_POOL = "diloco_control"
"""init, the syncer's shards and evaluator, islands_ended, finalize, maintenance."""


def pool_for(backend: str) -> str:
    """The pool bounding concurrent islands of one backend."""
    return f"diloco_{backend}"
