"""Deferrable sensors of the DiLoCo DAGs."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowSkipException


class PendingPseudogradSensor(BaseOperator):
    """Defers until a registered experiment has committed, unapplied pseudo-gradients.

    Returns ``[{"store_url", "experiment", "pending"}]``. It always defers (never pokes in a
    loop), and skips after ``idle_timeout_s`` without work so that the next run of a continuous
    DAG re-reads the registry of running experiments: no hot loop, idle or failing.
    """

    def __init__(self, *, poll_s: float = 5.0, idle_timeout_s: float = 300.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.poll_s = poll_s
        self.idle_timeout_s = idle_timeout_s

    def execute(self, context):
        from diloco_airflow.operators import registered_experiments
        from diloco_airflow.triggers import PendingPseudogradTrigger

        experiments = [
            {"store_url": e["store_url"], "experiment": e["experiment"]}
            for e in registered_experiments()
        ]
        self.log.info("watching %s", [e["experiment"] for e in experiments] or "nothing")
        self.defer(
            trigger=PendingPseudogradTrigger(
                experiments=experiments, poll_s=self.poll_s, idle_timeout_s=self.idle_timeout_s
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None):
        if not event or event.get("status") != "pending":
            raise AirflowSkipException("no pending pseudo-gradients")
        return event["experiments"]
