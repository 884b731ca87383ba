"""Triggers (run in the triggerer): async, serializable kwargs only, one event each.

Every blocking store or backend call runs in a thread (`asyncio.to_thread`) so the event loop is
never blocked. A trigger may run twice (triggerer restart, HA): they only read, never write.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from diloco_airflow import stall, store

# how many consecutive failed polls (store or backend unreachable) before giving up
MAX_POLL_ERRORS = 10
PROGRESS_EVERY_S = 10.0  # a progress line in the wait task's log this often (from the heartbeat)


class IslandTrigger(BaseTrigger):
    """Watches one island: its done marker, its backend state and its heartbeat.

    Event payloads: ``{"status": "done"}``; ``{"status": "failed", "message", "retryable"}`` when
    the island's process is gone without a done marker, its heartbeat stopped for
    ``heartbeat_timeout_s`` (or none arrived ``startup_timeout_s`` after ``launched_at``), or the
    backend could not be asked ``MAX_POLL_ERRORS`` times in a row. The two heartbeat failures
    (process alive but silent: a stalled island) also carry ``"stalled": true``; the wait
    operator then stops the stalled copy so that its retry relaunches the island.
    """

    def __init__(
        self,
        spec: dict[str, Any],
        backend: str,
        backend_kwargs: dict[str, Any] | None = None,
        launched_at: float | None = None,
        heartbeat_timeout_s: float = 120.0,
        startup_timeout_s: float = 600.0,
        poll_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.backend_kwargs = dict(backend_kwargs or {})
        self.launched_at = float(launched_at if launched_at is not None else time.time())
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.poll_s = float(poll_s)
        self._progress_at = 0.0  # when the last progress line was logged (not serialized)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "diloco_airflow.triggers.IslandTrigger",
            {
                "spec": self.spec,
                "backend": self.backend,
                "backend_kwargs": self.backend_kwargs,
                "launched_at": self.launched_at,
                "heartbeat_timeout_s": self.heartbeat_timeout_s,
                "startup_timeout_s": self.startup_timeout_s,
                "poll_s": self.poll_s,
            },
        )

    def check(self, estore, backend, spec, now: float) -> dict[str, Any] | None:
        """One blocking poll: the event payload, or None to keep waiting."""
        from diloco_airflow.backends import IslandState

        island = spec.island
        if island in estore.done():
            return {"status": "done", "island": island}
        st = backend.status(spec, {})
        if st.state == IslandState.SUCCEEDED:
            if island in estore.done():  # marked done just before exiting
                return {"status": "done", "island": island}
            return _failed(island, f"island exited without a done marker: {st.message}", True)
        if st.state.terminal:
            if island in estore.done():
                return {"status": "done", "island": island}
            return _failed(island, f"island {st.state.value}: {st.message}", st.retryable)
        if st.state != IslandState.RUNNING:
            return None  # PENDING / PROVISIONING: the execution timeout bounds this
        beat = estore.heartbeats().get(island) or {}
        if beat and now - self._progress_at >= PROGRESS_EVERY_S:
            from training.views.dashboard import progress_line

            self._progress_at = now
            self.log.info("%s", progress_line(island, beat))
        beat_time = float(beat.get("time") or 0.0)
        if beat_time >= self.launched_at - 1.0:
            if stall.beat_too_old(beat_time, now, self.heartbeat_timeout_s):
                message = f"heartbeat stopped {now - beat_time:.0f}s ago (process alive)"
                return {**_failed(island, message, True), "stalled": True}
        elif now - self.launched_at > self.startup_timeout_s:
            message = f"no heartbeat {now - self.launched_at:.0f}s after launch"
            return {**_failed(island, message, True), "stalled": True}
        return None

    async def run(self):
        from diloco_airflow.backends import IslandSpec, get_backend

        spec = IslandSpec.from_dict(self.spec)
        errors = 0
        estore = backend = None
        while True:
            try:
                if estore is None:
                    estore = await asyncio.to_thread(
                        store.open_experiment, spec.store_url, spec.experiment
                    )
                    backend = get_backend(self.backend, **self.backend_kwargs)
                event = await asyncio.to_thread(self.check, estore, backend, spec, time.time())
                errors = 0
            except Exception as exc:  # the store or the cloud API: transient until proven not
                errors += 1
                self.log.warning("island %s: poll failed (%d): %s", spec.island, errors, exc)
                event = None
                if errors >= MAX_POLL_ERRORS:
                    event = _failed(spec.island, f"cannot poll the island: {exc}", True)
            if event is not None:
                yield TriggerEvent(event)
                return
            await asyncio.sleep(self.poll_s)


def _failed(island: str, message: str, retryable: bool) -> dict[str, Any]:
    return {"status": "failed", "island": island, "message": message, "retryable": retryable}
