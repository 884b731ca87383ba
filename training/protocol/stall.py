"""When an island counts as stalled: its process runs, its heartbeat has stopped.

One rule, its users: the island's wait task (through `IslandTrigger`) stops a stalled island
after `wait_timeout_s` so that its retry relaunches it; the maintenance DAG, a backstop for an
island whose wait task is not running, after `maintenance_timeout_s` (twice as long, so that it
never races the wait task); `diloco delete` refuses while an island's heartbeat is younger than
`wait_timeout_s` (it may still be running). Pure, no imports: the Airflow layer
(plugins/diloco_airflow) and the library use it alike. ``DILOCO_HEARTBEAT_TIMEOUT_S`` (`knobs`) overrides the wait's.
An island that never beat is stalled `startup_timeout_s` after its launch (the trigger's
argument: compiling a large model takes a while).
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
