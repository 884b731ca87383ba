"""Triggers (run in the triggerer): async, serializable kwargs only, one event each.

Every trigger of this project polls through one loop, `PollingTrigger.run`: every blocking store
or backend call runs in a thread (`asyncio.to_thread`) so the event loop is never blocked, and
`MAX_POLL_ERRORS` failed polls in a row end it with a failure event. A trigger may run twice
(triggerer restart, HA): they only read, never write.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from diloco_airflow import store
from training.protocol import stall

# how many consecutive failed polls (store or backend unreachable) before giving up
MAX_POLL_ERRORS = 10
PROGRESS_EVERY_S = 10.0  # a progress line in the wait task's log this often (from the heartbeat)


def _one_line(exc: BaseException) -> str:
    """The error's message on one line (a cloud API's may span several), bounded."""
    from training.store.safejson import one_line

    return one_line(exc)


class PollingTrigger(BaseTrigger):
    """The polling loop of every trigger here: from `settle_until` on (default: at once), calls
    the blocking `poll()` in a thread every `poll_s` seconds until it returns an event payload,
    and yields that one event.

    A poll that raises (the store or the cloud API blinked: transient until proven not) is
    logged on one line and retried; the `MAX_POLL_ERRORS`-th in a row yields
    `poll_failed(<the last error, on one line>)` instead. Subclasses set `poll_s` (and
    `settle_until`) in `__init__`, serialize them, and define `poll()`, `label` and, for
    another failure payload than ``{"status": "error", "message"}``, `poll_failed`.
    """

    poll_s: float = 5.0
    settle_until: float = 0.0

    @property
    def label(self) -> str:
        """Who polls, for the log line of a failed poll."""
        return type(self).__name__

    def poll(self) -> dict[str, Any] | None:  # pragma: no cover - overridden
        """One blocking poll (in a thread): the event payload, or None to keep waiting."""
        raise NotImplementedError

    def poll_failed(self, error: str) -> dict[str, Any]:
        """The event payload after `MAX_POLL_ERRORS` failed polls in a row."""
        return {"status": "error", "message": f"cannot poll the store: {error}"}

    async def run(self):
        errors = 0
        if self.settle_until > time.time():
            await asyncio.sleep(self.settle_until - time.time())
        while True:
            try:
                event = await asyncio.to_thread(self.poll)
                errors = 0
            except Exception as exc:
                errors += 1
                error = _one_line(exc)
                self.log.warning(
                    "%s: poll failed (%d/%d): %s", self.label, errors, MAX_POLL_ERRORS, error
                )
                event = self.poll_failed(error) if errors >= MAX_POLL_ERRORS else None
            if event is not None:
                yield TriggerEvent(event)
                return
            await asyncio.sleep(self.poll_s)


def average_rate(before: dict[str, Any] | None, beat: dict[str, Any]) -> float | None:
    """Tokens/s between two heartbeats of one island (the progress lines' rate, about
    `PROGRESS_EVERY_S` apart: a heartbeat's own rate covers one heartbeat interval and swings
    with every publish, adopt and checkpoint); the heartbeat's own rate when there is no
    earlier one, or when the island restarted (fewer tokens) or the clock did not move."""
    if before:
        try:
            dt = float(beat["time"]) - float(before["time"])
            dtokens = int(beat["tokens"]) - int(before["tokens"])
        except (KeyError, TypeError, ValueError):
            return beat.get("tokens_per_s")
        if dt > 0 and dtokens >= 0:
            return dtokens / dt
    return beat.get("tokens_per_s")


class IslandTrigger(PollingTrigger):
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
        self._progress_beat: dict[str, Any] | None = None  # the heartbeat it showed (same)
        self._opened = None  # (store, backend, spec) from the first poll on (not serialized)

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
        from diloco_airflow.backends import ResourceState

        island = spec.island
        if island in estore.done():
            return {"status": "done", "island": island}
        st = backend.status(spec, {})
        if st.state == ResourceState.SUCCEEDED:
            if island in estore.done():  # marked done just before exiting
                return {"status": "done", "island": island}
            return _failed(island, f"island exited without a done marker: {st.message}", True)
        if st.state.terminal:
            if island in estore.done():
                return {"status": "done", "island": island}
            return _failed(island, f"island {st.state.value}: {st.message}", st.retryable)
        if st.state != ResourceState.RUNNING:
            return None  # PENDING / PROVISIONING: the execution timeout bounds this
        beat = estore.heartbeats().get(island) or {}
        if beat and now - self._progress_at >= PROGRESS_EVERY_S:
            from training.views.dashboard import progress_line

            self._progress_at = now
            shown = {**beat, "tokens_per_s": average_rate(self._progress_beat, beat)}
            self._progress_beat = beat
            self.log.info("%s", progress_line(island, shown))
        beat_time = float(beat.get("time") or 0.0)
        if beat_time >= self.launched_at - 1.0:
            if stall.beat_too_old(beat_time, now, self.heartbeat_timeout_s):
                message = f"heartbeat stopped {now - beat_time:.0f}s ago (process alive)"
                return {**_failed(island, message, True), "stalled": True}
        elif now - self.launched_at > self.startup_timeout_s:
            message = f"no heartbeat {now - self.launched_at:.0f}s after launch"
            return {**_failed(island, message, True), "stalled": True}
        return None

    @property
    def label(self) -> str:
        return f"island {self.spec.get('island')}"

    def poll(self) -> dict[str, Any] | None:
        """Opens the store and the backend at the first poll, then `check`s at the time now."""
        from diloco_airflow.backends import IslandSpec, get_backend

        if self._opened is None:
            spec = IslandSpec.from_dict(self.spec)
            estore = store.open_experiment(spec.store_url, spec.experiment)
            self._opened = (estore, get_backend(self.backend, **self.backend_kwargs), spec)
        estore, backend, spec = self._opened
        return self.check(estore, backend, spec, time.time())

    def poll_failed(self, error: str) -> dict[str, Any]:
        return _failed(self.spec.get("island"), f"cannot poll the island: {error}", True)


def _failed(island: str, message: str, retryable: bool) -> dict[str, Any]:
    return {"status": "failed", "island": island, "message": message, "retryable": retryable}
