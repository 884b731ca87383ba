"""When an island counts as stalled: its process runs, its heartbeat has stopped. And the words
for an island's state that every reader shows (`ISLAND_STATES`, `island_state`).

One rule, its users: the island's wait task (through `IslandTrigger`) stops a stalled island
after `wait_timeout_s` so that its retry relaunches it; the maintenance DAG, a backstop for an
island whose wait task is not running, after `maintenance_timeout_s` (twice as long, so that it
never races the wait task); `diloco delete` refuses while an island's heartbeat is younger than
`wait_timeout_s` (it may still be running); the DiLoCo page and `diloco status` call an island
"stalled" (`island_state`) exactly when the wait task would stop it, so neither calls an island
stalled that Airflow leaves alone. Pure, no imports: the Airflow layer (plugins/diloco_airflow)
and the library use it alike. ``DILOCO_HEARTBEAT_TIMEOUT_S`` (`knobs`) overrides the wait's
limit (the page is given it too: `limit_s`). An island that never beat is stalled
`startup_timeout_s` after its launch (the trigger's argument: compiling a large model takes a
while); the page and `diloco status` call it "not started".
"""

from __future__ import annotations

MIN_TIMEOUT_S = 60.0
"""The shortest heartbeat timeout, whatever the heartbeat interval."""

MISSED_BEATS = 12
"""Heartbeat intervals without a beat after which a running island is stalled."""

MAINTENANCE_FACTOR = 2.0
"""How much longer than the wait task the maintenance DAG waits before it stops an island."""


def wait_timeout_s(heartbeat_s: float) -> float:
    """The wait task's limit on a heartbeat's age: max(60, 12 x heartbeat_s)."""
    return max(MIN_TIMEOUT_S, MISSED_BEATS * float(heartbeat_s))


def maintenance_timeout_s(heartbeat_s: float) -> float:
    """The maintenance DAG's limit on a heartbeat's age: twice the wait task's."""
    return MAINTENANCE_FACTOR * wait_timeout_s(heartbeat_s)


def beat_too_old(beat_time: float, now: float, limit_s: float) -> bool:
    """Whether a heartbeat written at `beat_time` is older than `limit_s` at `now`."""
    return now - beat_time > limit_s


ISLAND_STATES = (
    "not started",  # no heartbeat yet
    "running",  # beating: its heartbeat no older than the limit
    "stalled",  # its process runs, its heartbeat is older than the limit (`stalled`)
    "stopping",  # beating, and a stop was asked of it (control/stop/{island})
    "retrying",  # its Airflow wait task waits for its retry (known to the page only)
    "dead",  # its Airflow wait task failed (known to the page only)
    "done",  # its done marker is written
    "left",  # a scavenged island after its window (training/config/scavenge.py)
)
"""The words for an island's state: the page's and `diloco status`'s (`island_state`)."""

RETRYING_TASK_STATES = ("up_for_retry", "up_for_reschedule")
DEAD_TASK_STATES = ("failed", "upstream_failed")


def stalled(heartbeat_age_s: float, heartbeat_s: float, limit_s: float | None = None) -> bool:
    """Whether a running island whose heartbeat is `heartbeat_age_s` old is stalled: older than
    `limit_s`, by default the wait task's `wait_timeout_s(heartbeat_s)` (`beat_too_old`'s
    comparison)."""
    limit = wait_timeout_s(heartbeat_s) if limit_s is None else float(limit_s)
    return heartbeat_age_s > limit


def island_state(
    done: bool,
    heartbeat_age_s: float | None,
    heartbeat_s: float,
    *,
    stop_requested: bool = False,
    task_state: str | None = None,
    left: bool = False,
    limit_s: float | None = None,
) -> str:
    """One word of `ISLAND_STATES` for an island. The store says left (a scavenged island after
    its window), done, not started (no heartbeat: `heartbeat_age_s` None), stalled (`stalled`,
    `limit_s` as there), stopping or running; the island's Airflow wait task, where the caller
    knows its state (the page), says retrying (up for retry) or dead (failed) first."""
    if left:
        return "left"
    if done:
        return "done"
    if task_state in RETRYING_TASK_STATES:
        return "retrying"
    if task_state in DEAD_TASK_STATES:
        return "dead"
    if heartbeat_age_s is None:
        return "not started"
    if stalled(heartbeat_age_s, heartbeat_s, limit_s):
        return "stalled"
    return "stopping" if stop_requested else "running"
