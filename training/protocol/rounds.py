"""When an island's rounds end: on its own step counter, or on a clock all islands share.

`outer.rounds = "steps"`: fragment p is published every H_m of the island's own inner steps, on
its staggered offset (`training.protocol.fragments.fragments_due`). Islands start in phase, but a kill, a
slow restart or jitter shifts one island's rounds for good: nothing brings it back, every merge
then holds a single island, and the outer momentum, stepped once per partial merge on updates a
few versions stale, degrades the model (docs/QUALITY_FAULTS.md: +14% to +29% eval loss under
kills).

`outer.rounds = "clock"` (the default for the asynchronous methods): round k ends at
`T_k = t0 + k * period`, the same instants for every island. Fragment p is due at the island's
inner step whose end is nearest `T_k + offset_p` (offset_p = the step offset of
`fragment_offsets` as a share of the period): the first step that ends at or after the boundary
less half the island's mean step time. (With "at or after the boundary" the island whose
contribution set the clock, whose step ends fall on the boundaries, published on time or a whole
step late by a rounding error or a jitter: in the quality bench the speed-0.25 island lost its
boundary at t = 96 that way and was 4 virtual s late, merging alone, every round after.
Nearest-end bounds every island's offset from the boundary by half its step, and the
grace floor, grace_min_steps steps, covers that.) An interval of fewer than `H_m // 2` steps rolls
over to the next boundary; an interval that reaches `2 * H_m` steps is published at once (a
period that is too long, or a hostile clock record, cannot stall an island). A restarted island
therefore publishes its partial interval at the next boundary and is back in phase; token
weighting weighs the partial interval down.

The clock record, `control/rounds.json` (docs/STORE.md), is written once (create-only) by the
syncer shard that owns fragment 0, when it first sees a valid contribution to it (islands never
write shared objects): `t0` is that contribution's publish time and the period is
`outer.round_s` or, when unset, the contributor's H_m times its mean step time (its first step
after a start, the compile, left out). DyLU sizes H_m so that every island's round takes about
the same time. Until an island has read the record it follows the step rule; it looks for it at
start and at each publish round until it finds it, then never again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from training.config.experiment import MAX_ROUND_S
from training.protocol.fragments import fragment_offsets

MIN_SHARE_DIV = 2  # an interval shorter than H_m // 2 steps rolls over to the next boundary
MAX_ROUND_MULT = 2  # an interval of 2 * H_m steps is published whatever the clock says


@dataclass(frozen=True)
class RoundClock:
    """The shared round grid: boundaries at t0 + k * period_s (unix seconds)."""

    t0: float
    period_s: float

    def boundary_after(self, t: float, offset_s: float = 0.0) -> float:
        """The first boundary `t0 + k * period_s + offset_s` (k >= 0) strictly after `t`."""
        start = self.t0 + offset_s
        if t < start:
            return start
        return start + (math.floor((t - start) / self.period_s) + 1) * self.period_s


def offsets_s(clock: RoundClock, H: int, P: int) -> list[float]:
    """Each fragment's offset within a round, in seconds: its step offset as a share of H."""
    return [off * clock.period_s / H for off in fragment_offsets(H, P)]


def min_steps(H_m: int) -> int:
    """The fewest steps an interval may hold and still be published at a boundary."""
    return max(1, H_m // MIN_SHARE_DIV)


def first_boundaries(clock: RoundClock, H: int, P: int, after: float) -> list[float]:
    """Each fragment's first boundary after `after` (an island that starts, resumes or has just
    learnt the clock)."""
    return [clock.boundary_after(after, off) for off in offsets_s(clock, H, P)]


def clock_due(
    clock: RoundClock,
    now: float,
    next_at: Sequence[float],
    steps_since: Sequence[int],
    H: int,
    H_m: int,
    step_s: float = 0.0,
) -> tuple[list[int], list[float]]:
    """The fragments due after an inner step that ended at `now`, and each fragment's next
    boundary. `next_at[p]` is fragment p's pending boundary, `steps_since[p]` the steps trained
    since p was last published (after this step), H the experiment's H (it sets the offsets),
    H_m this island's and `step_s` its mean step time (0: not known yet; then a boundary is
    reached only at or after it). A step that ends less than step_s / 2 before a boundary is the
    nearest to it: the boundary is reached (and the next one is the one after it)."""
    due: list[int] = []
    out = list(next_at)
    offs = offsets_s(clock, H, len(next_at))
    early = max(0.0, float(step_s)) / 2 if math.isfinite(step_s) else 0.0
    for p, (at, steps) in enumerate(zip(next_at, steps_since, strict=True)):
        if steps >= MAX_ROUND_MULT * H_m:
            due.append(p)
            out[p] = clock.boundary_after(now, offs[p])
        elif now >= at - early:
            out[p] = clock.boundary_after(max(now, at), offs[p])
            if steps >= min_steps(H_m):
                due.append(p)
    return due, out


def clock_rounds(cfg) -> bool:
    """Whether this experiment's islands end their rounds on the shared clock."""
    return cfg.outer.rounds == "clock" and cfg.outer.method != "sync"


def clock_from_first(
    cfg, island: str, published_at: float, step_time_s: float, now: float
) -> tuple[float, float] | None:
    """The round clock set by the first contribution of fragment 0 (island, its publish time
    and mean step time): t0 = its publish time (never after `now`), the period `outer.round_s`
    or the island's H_m times its step time, at most a day. Returns (t0, period_s), or None
    when neither a period nor a measured step time is known (an interval of one untimed step)."""
    if cfg.outer.round_s:
        period = float(cfg.outer.round_s)
    elif step_time_s > 0:
        period = cfg.inner_steps(island) * float(step_time_s)
    else:
        return None
    return min(published_at, now), float(min(period, MAX_ROUND_S))
