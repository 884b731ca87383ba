"""Goodput, the way Google's ML Goodput defines it: productive step time over elapsed time.

Per island, a `GoodputAccountant` splits the island's elapsed time (from its first process's
start, across restarts) into:

    productive              inner steps whose work is kept (compute of a step, slow-down included)
    startup_and_compile     process start to the end of the process's first step (imports,
                            device init, tracing and compilation, the first step), less what is
                            charged to another category in that window (restore, data loading)
    data_loading            waiting for the next batch
    checkpoint_save         writing the island checkpoint
    checkpoint_restore      reading the checkpoint and adopting the newest global version on resume
    wasted_progress         steps whose work was lost when a process died: on restart, the steps
                            between the checkpoint it resumes from and the step the previous process
                            had reached per its last heartbeat, at its mean productive step time
    waiting_for_global      exchanging with the global model: pulling / adopting versions,
                            publishing pseudo-gradients, blocking in a synchronous round
    infrastructure_recovery time between the previous process's last sign of life (its last
                            heartbeat or checkpoint) and this process's start, after a crash
    other                   the rest (heartbeats, stop checks, Python overhead)

Goodput = productive / elapsed. The categories add up to the elapsed time. The accountant's
state travels in every heartbeat and checkpoint meta (`state()`), so it survives restarts
(`resume()`), and the experiment's goodput is chip-weighted over islands:
sum(chips_i * productive_i) / sum(chips_i * elapsed_i) (`experiment_goodput`). Chips come from the
island's hardware config (`chips_of`), default 1.

An island's elapsed time ends with it: its closing heartbeat holds its last state, which
`diloco status` and the page show as they are (never extrapolated to now), and a relaunch of an
island whose done marker is written trains nothing and writes nothing
(training/island/process.py `_run`), so a finished island's goodput is over its life.

Overhead: one clock read and a dict update per timed section; a few per inner step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from training.config.experiment import ExperimentConfig, IslandConfig
from training.config.hardware import chips_of_hardware

PRODUCTIVE = "productive"
BADPUT = (
    "startup_and_compile",
    "data_loading",
    "checkpoint_save",
    "checkpoint_restore",
    "wasted_progress",
    "waiting_for_global",
    "infrastructure_recovery",
    "other",
)
CATEGORIES = (PRODUCTIVE, *BADPUT)
TIMED = CATEGORIES[:-1]  # "other" is what is left of the elapsed time

_process_start_claimed = False


def process_age() -> float:
    """Seconds since this process started (Linux /proc), or 0.0 where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime in ticks
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


class GoodputAccountant:
    """Seconds per category for one island process, continued across restarts.

    `clock` times sections (monotonic in production); `wall` stamps snapshots (unix seconds) so
    the next process can tell how long the island was down. `process_age` is how long the process
    ran before the accountant was created (counted as startup).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        process_age: float = 0.0,
    ):
        self.clock = clock
        self.wall = wall
        self.t0 = clock() - process_age
        self.wall0 = wall() - process_age
        self.prior_elapsed = 0.0
        self.seconds = dict.fromkeys(TIMED, 0.0)
        self.steps = 0  # steps charged as productive (kept), all processes
        self.lost_steps = 0
        self.restarts = 0
        self.started = False  # this process finished its first step
        self.closed = False  # this process ended cleanly (set before the last heartbeat)
        self._charged = 0.0  # seconds charged by this process

    @classmethod
    def for_clock(cls, clock: Callable[[], float]) -> GoodputAccountant:
        """Production (`clock` is time.time): monotonic timers, and the first accountant of the
        process counts the time since process start. Any other clock (a virtual one) is used as
        is, with no process age."""
        global _process_start_claimed
        if clock is not time.time:
            return cls(clock=clock, wall=clock)
        age = 0.0 if _process_start_claimed else process_age()
        _process_start_claimed = True
        return cls(process_age=age)

    # -- timing ---------------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def charge(self, category: str, since: float) -> float:
        """Add `now - since` to `category`; returns now (the start of the next section)."""
        now = self.clock()
        spent = now - since
        self.seconds[category] += spent
        self._charged += spent
        return now

    def step(self, since: float) -> float:
        """An inner step computed from `since` to now. The process's first step ends its startup:
        everything since process start not charged elsewhere is startup_and_compile."""
        now = self.clock()
        if not self.started:
            self.started = True
            startup = max(0.0, (now - self.t0) - self._charged)
            self.seconds["startup_and_compile"] += startup
            self._charged += startup
        else:
            spent = now - since
            self.seconds[PRODUCTIVE] += spent
            self._charged += spent
            self.steps += 1
        return now

    # -- snapshots --------------------------------------------------------------------------

    def elapsed(self, now: float | None = None) -> float:
        return self.prior_elapsed + ((self.clock() if now is None else now) - self.t0)

    def breakdown(self, now: float | None = None) -> dict[str, float]:
        """Seconds per category (every category; they add up to `elapsed()`)."""
        now = self.clock() if now is None else now
        out = dict(self.seconds)
        if not self.started:  # still starting up: the uncharged time so far is startup
            out["startup_and_compile"] += max(0.0, (now - self.t0) - self._charged)
        out["other"] = max(0.0, self.elapsed(now) - sum(out.values()))
        return out

    def goodput(self) -> float | None:
        elapsed = self.elapsed()
        return self.seconds[PRODUCTIVE] / elapsed if elapsed > 0 else None

    def state(self) -> dict[str, Any]:
        """JSON-able snapshot for heartbeats and checkpoint meta (one clock reading)."""
        now = self.clock()
        elapsed = self.elapsed(now)
        return dict(
            elapsed_s=elapsed,
            seconds=self.breakdown(now),
            goodput=self.seconds[PRODUCTIVE] / elapsed if elapsed > 0 else None,
            steps=self.steps,
            lost_steps=self.lost_steps,
            restarts=self.restarts,
            closed=self.closed,
            wall=self.wall(),
        )

    # -- restarts ---------------------------------------------------------------------------

    def resume(
        self,
        checkpoint: Mapping[str, Any] | None,
        checkpoint_step: int | None,
        heartbeat: Mapping[str, Any] | None,
        heartbeat_step: int | None,
    ) -> int:
        """Continue from the previous processes' accounting; returns the steps found lost.

        `checkpoint` / `heartbeat` are `state()` snapshots from the checkpoint this process resumes
        from and from the island's last heartbeat (either may be None), with the island step each
        was taken at. The newer snapshot is the base. Steps between the checkpoint and the base's
        step were computed but lost: their time moves from productive to wasted_progress. If the
        previous process did not end cleanly, the time from the base snapshot to this process's
        start is infrastructure_recovery.
        """
        snaps = [
            (s, step)
            for s, step in ((checkpoint, checkpoint_step), (heartbeat, heartbeat_step))
            if _valid_state(s)
        ]
        if not snaps:
            return 0
        base, base_step = max(snaps, key=lambda sn: float(sn[0]["wall"]))
        seconds = base["seconds"]
        for c in TIMED:
            self.seconds[c] += float(seconds.get(c, 0.0))
        self.prior_elapsed = float(base["elapsed_s"])
        self.steps += int(base.get("steps", 0))
        self.lost_steps += int(base.get("lost_steps", 0))
        self.restarts += int(base.get("restarts", 0))
        lost = max(0, int(base_step or 0) - int(checkpoint_step or 0))
        if lost:
            per_step = self.seconds[PRODUCTIVE] / self.steps if self.steps else 0.0
            moved = min(self.seconds[PRODUCTIVE], lost * per_step)
            self.seconds[PRODUCTIVE] -= moved
            self.seconds["wasted_progress"] += moved
            self.steps = max(0, self.steps - lost)
            self.lost_steps += lost
        if not base.get("closed"):
            gap = max(0.0, self.wall0 - float(base["wall"]))
            self.seconds["infrastructure_recovery"] += gap
            self.prior_elapsed += gap
            self.restarts += 1
        return lost


def _valid_state(s: Any) -> bool:
    return (
        isinstance(s, Mapping)
        and isinstance(s.get("seconds"), Mapping)
        and isinstance(s.get("elapsed_s"), int | float)
        and isinstance(s.get("wall"), int | float)
    )


# -- experiment -------------------------------------------------------------------------------


def chips_of(island: IslandConfig) -> int:
    """Chips of an island from its hardware config (`training.config.hardware.chips_of_hardware`)."""
    return chips_of_hardware(island.hardware)


def experiment_goodput(
    cfg: ExperimentConfig, states: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, Any] | None:
    """Chip-weighted goodput over the islands that have a state (`state()` snapshots by island).

    Returns {"goodput", "badput": {category: fraction}, "productive_chip_s", "elapsed_chip_s",
    "chips", "islands"}, or None when no island has reported.
    """
    productive = elapsed = 0.0
    badput = dict.fromkeys(BADPUT, 0.0)
    chips = islands = 0
    for isl in cfg.islands:
        s = states.get(isl.name)
        if not _valid_state(s):
            continue
        n = chips_of(isl)
        chips += n
        islands += 1
        elapsed += n * float(s["elapsed_s"])
        productive += n * float(s["seconds"].get(PRODUCTIVE, 0.0))
        for c in BADPUT:
            badput[c] += n * float(s["seconds"].get(c, 0.0))
    if not islands or elapsed <= 0:
        return None
    return dict(
        goodput=productive / elapsed,
        badput={c: v / elapsed for c, v in badput.items()},
        productive_chip_s=productive,
        elapsed_chip_s=elapsed,
        chips=chips,
        islands=islands,
    )
