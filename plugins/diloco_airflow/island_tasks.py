"""The tasks of one island's task group: provision, launch, wait (deferred), teardown.

Each takes the island's entry (`IslandEntry`, or its dict from XCom). Backend errors become
Airflow's: a permanent one fails the task at once (`AirflowFailException`), a retryable one
raises so that the task retries.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from diloco_airflow import store
from diloco_airflow.backends import BackendError, ResourceState
from diloco_airflow.island_entry import IslandEntry

log = logging.getLogger(__name__)


def raise_backend_error(exc: BackendError) -> None:
    """Re-raise a backend error the way Airflow understands (never returns)."""
    if not exc.retryable:
        raise AirflowFailException(f"permanent backend error: {exc.message}") from exc
    raise RuntimeError(f"backend error (will retry): {exc.message}") from exc


def island_done(island: IslandEntry) -> bool:
    """Whether the island's done marker is in the store."""
    return island.name in store.open_experiment(island.store_url, island.experiment).done()


def provision_island(island: IslandEntry | dict) -> dict[str, Any]:
    """Make sure the island's resources exist; returns the backend's handle."""
    island = IslandEntry.of(island)
    try:
        return island.make_backend().provision(island.spec)
    except BackendError as exc:
        raise_backend_error(exc)
        raise  # unreachable


def launch_island(island: IslandEntry | dict, handle: dict | None = None) -> dict[str, Any]:
    """Start the island unless it already runs (or is done). Returns the handle."""
    island = IslandEntry.of(island)
    backend, spec = island.make_backend(), island.spec
    try:
        if island_done(island):
            log.info("island %s is already done", island.name)
            return dict(handle or {})
        st = backend.status(spec, handle or {})
        if st.state in (ResourceState.RUNNING, ResourceState.PROVISIONING):
            log.info("island %s already %s: %s", island.name, st.state.value, st.message)
            return dict(handle or {})
        if st.state.terminal:
            handle = backend.provision(spec)
        return backend.launch(spec, handle or {})
    except BackendError as exc:
        raise_backend_error(exc)
        raise


def teardown_island(island: IslandEntry | dict) -> None:
    """Stop the island and release its resources (always safe)."""
    island = IslandEntry.of(island)
    try:
        island.make_backend().teardown(island.spec, {})
    except BackendError as exc:
        raise_backend_error(exc)


class IslandWaitOperator(BaseOperator):
    """Waits (deferred) until the island is done; fails fast when it is dead.

    On a retry (the island died or stalled) it relaunches the island first; the island process
    resumes from its checkpoint in the store. A stalled island (process alive, heartbeat older
    than ``heartbeat_timeout_s``; default `stall.wait_timeout_s` of the island's heartbeat, the
    DAG passes ``DILOCO_HEARTBEAT_TIMEOUT_S`` when set) is stopped before the task fails, so that
    the retry relaunches it.
    """

    template_fields = ("island",)

    def __init__(
        self,
        *,
        island: Any,
        heartbeat_timeout_s: float | None = None,
        startup_timeout_s: float = 600.0,
        poll_s: float = 3.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.island = island
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s

    def execute(self, context):
        from diloco_airflow.triggers import IslandTrigger

        island = IslandEntry.of(self.island)
        context["island_label"] = island.label
        if island_done(island):
            self.log.info("island %s is done", island.name)
            return {"status": "done"}
        try:
            st = island.make_backend().status(island.spec, {})
            self.log.info("island %s: %s %s", island.name, st.state.value, st.message)
            if st.state not in (ResourceState.RUNNING, ResourceState.PROVISIONING):
                self.log.warning("island %s is not running: relaunching it", island.name)
                launch_island(island)
        except BackendError as exc:
            raise_backend_error(exc)
        self.defer(
            trigger=IslandTrigger(**self.trigger_kwargs(island)), method_name="execute_complete"
        )

    def trigger_kwargs(self, island: IslandEntry) -> dict[str, Any]:
        """The (serializable) arguments of the island's trigger, launched now."""
        from training.protocol import stall

        return dict(
            spec=island.spec.to_dict(),
            backend=island.backend,
            backend_kwargs=island.backend_kwargs,
            launched_at=time.time(),
            heartbeat_timeout_s=self.heartbeat_timeout_s
            or stall.wait_timeout_s(island.heartbeat_s),
            startup_timeout_s=self.startup_timeout_s,
            poll_s=self.poll_s,
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None):
        island = IslandEntry.of(self.island)
        context["island_label"] = island.label
        event = event or {}
        if event.get("status") == "done":
            self.log.info("island %s is done", island.name)
            return event
        message = event.get("message", f"unexpected event {event!r}")
        if event.get("stalled"):
            # alive but silent (hung, or chaos.stall_island): stop this copy now, so that the
            # retry finds the island not running and relaunches it from its checkpoint
            self.log.warning("island %s stalled: stopping it: %s", island.name, message)
            try:
                teardown_island(island)
            except Exception as exc:  # the retry's launch kills a leftover copy anyway
                self.log.warning("could not stop island %s: %s", island.name, exc)
        if event.get("retryable", True) is False:
            raise AirflowFailException(f"island {island.name}: {message}")
        raise RuntimeError(f"island {island.name}: {message}")
