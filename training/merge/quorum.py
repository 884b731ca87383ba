"""`outer.quorum = "auto"`: the syncer chooses the quorum K per fragment merge from what it
measures (issue 26; pure functions, the merger gathers the facts).

Why: with K = 1 every island's contribution to a fragment makes a version of its own, and every
island downloads every version. On a thin downlink M versions per fragment and round fill it
(the WAN bench at 2 Gbps-eq: never reached the target with K = 1, 44x data-parallel with
K = M = 2); where the slowest island, not the link, is the bottleneck, K = 1 with the grace
window is best (the quality and mixed-hardware benches), and a quorum must never wait for an
island that is dead.

The rule (`auto_quorum`), per fragment merge:
- `live`: the islands whose heartbeat is younger than `live_window` (max(3 heartbeats, 2
  rounds)) and that are not done or asked to stop. K is never above it: a dead island is not
  waited for.
- `fit = floor(DOWNLINK_SHARE x round_s / (P x download_s))`: the versions per fragment and
  round that the slowest live island's downlink carries in half a round (each island reads
  every version of each of the P fragments: P x V x download_s seconds per round for V
  versions a fragment). `download_s` is the largest of the live islands' heartbeats'
  `download_s` (their measured seconds per fragment version read, training/island/adopt.py).
- K = 1 when the downlink carries one version per island (`fit >= live`) or nothing is known
  yet (no round, no download time): the configured grace window then gathers what arrives
  together. Else K = ceil(live / max(fit, 1)): the fewest versions per round that fit.
- A merge that waits for K islands waits at most `quorum_wait_s` = one round from when the
  merger first saw a contribution of it (not from its publish: over a thin link the upload
  takes most of a round, and the others' as long); then it merges what it has (an island that dies mid-round costs one round of
  that fragment, never the run).

Each change of a fragment's K is logged by the merger with the facts that made it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DOWNLINK_SHARE = 0.5  # the share of a round that downloading the new versions may take


@dataclass(frozen=True)
class QuorumFacts:
    """What the merger measured for one fragment merge."""

    live: int  # islands heard from within the live window, not done or stopped
    round_s: float | None  # the round period (the shared clock's, else H x median step time)
    download_s: float | None  # the slowest live island's seconds per fragment version read
    fragments: int  # P


def auto_quorum(f: QuorumFacts) -> int:
    """K for one fragment merge (module docstring). At least 1, at most `f.live` (1 if none)."""
    if f.live <= 1 or not f.round_s or not f.download_s or f.download_s <= 0:
        return 1
    fit = math.floor(DOWNLINK_SHARE * f.round_s / (f.fragments * f.download_s))
    if fit >= f.live:
        return 1
    return min(f.live, math.ceil(f.live / max(fit, 1)))


def round_period(H: int, clock_period_s: float | None, step_s: float) -> float | None:
    """The round period: the shared round clock's (`clock_period_s`), else H times the
    candidates' median step time `step_s` (None when no step time is known)."""
    if clock_period_s is not None:
        return clock_period_s
    return H * step_s if step_s > 0 else None


def facts_of(
    heartbeats: Mapping[str, Mapping[str, Any]],
    active: set[str],
    now: float,
    heartbeat_s: float,
    round_s: float | None,
    fragments: int,
) -> QuorumFacts:
    """The facts of one fragment merge from the islands' heartbeats as the merger read them:
    the `active` islands live within `live_window`, the slowest one's download time."""
    live = live_islands(heartbeats, active, now, live_window(heartbeat_s, round_s))
    return QuorumFacts(len(live), round_s, slowest_download_s(live), fragments)


def live_window(heartbeat_s: float, round_s: float | None) -> float:
    """How old a heartbeat may be for its island to count as live."""
    return max(3.0 * heartbeat_s, 2.0 * (round_s or 0.0))


def live_islands(
    heartbeats: Mapping[str, Mapping[str, Any]], active: set[str], now: float, window: float
) -> dict[str, Mapping[str, Any]]:
    """island -> heartbeat, of the `active` islands (not done, not stopped) whose heartbeat's
    `time` (the island's clock) is at most `window` seconds before `now` (the merger's)."""
    out = {}
    for island in sorted(active):
        hb = heartbeats.get(island)
        t = None if hb is None else hb.get("time")
        if isinstance(t, int | float) and now - window <= t:
            out[island] = hb
    return out


def slowest_download_s(live: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The largest `download_s` the live islands report (None when none does)."""
    values = [
        float(hb["download_s"])
        for hb in live.values()
        if isinstance(hb.get("download_s"), int | float) and math.isfinite(hb["download_s"])
    ]
    return max(values) if values else None
