"""Goodput simulator, the model: assumptions, the failure stream, and the two job models.

Goodput is

    sum of productive chip-seconds / sum of provisioned chip-seconds

over a simulated horizon. Every chip is interrupted on average once per ``mtbi_chip_years``; chips
are grouped into slices of ``slice_chips`` (the unit that fails and is replaced), so slice failures
form one Poisson process of rate ``n_slices / MTBI_slice`` with a uniformly chosen slice each time.
The same failure stream (same seed, same chips) drives every method, so methods are compared on
common random numbers.

The job models (`restart_job`, `elastic_job`) simulate one job, all chips or one island; the
methods built from them are in training/bench/goodput_methods.py, the report and CLI in
training/bench/goodput_sim.py (docs/GOODPUT_SIM.md: the assumptions in full).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SECONDS_PER_YEAR = 365.25 * 86_400.0

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
METHODS = (
    "dp",
    "elastic_dp",
    "decoupled_m2",
    "decoupled_m4",
    "decoupled_m8",
    "decoupled_m16",
)

# The paper's goodput table (2604.21428, secondary: third-party summaries, not checked against the
# PDF), as fractions. Chips: 150k / 300k / 600k / 1.2M / 2.4M; MTBI 1 year per chip.
PAPER_TABLE: dict[str, dict[int, float]] = {
    "dp": dict(zip(CHIPS, (0.72, 0.57, 0.38, 0.27, 0.18), strict=True)),
    "elastic_dp": dict(zip(CHIPS, (0.88, 0.80, 0.69, 0.58, 0.40), strict=True)),
    "decoupled_m2": dict(zip(CHIPS, (0.94, 0.88, 0.80, 0.70, 0.54), strict=True)),
    "decoupled_m4": dict(zip(CHIPS, (0.96, 0.93, 0.89, 0.82, 0.73), strict=True)),
    "decoupled_m8": dict(zip(CHIPS, (0.98, 0.96, 0.94, 0.88, 0.80), strict=True)),
    "decoupled_m16": dict(zip(CHIPS, (0.99, 0.98, 0.96, 0.93, 0.86), strict=True)),
}

# The one calibrated unknown: recovery_s, fitted by least squares (in percentage points) against
# the paper's DP column with every other assumption at its default (see `calibrate`, and
# `python -m training.bench.goodput_sim --calibrate`). Everything else is a prediction.
CALIBRATED_RECOVERY_S = 78.6
CALIBRATION_NOTE = (
    f"calibrated: recovery_s = {CALIBRATED_RECOVERY_S:g} s, least squares against the paper's DP "
    "column (the only fitted number); reshape_s and slice_chips are assumptions; all other "
    "columns are predictions"
)


@dataclass(frozen=True)
class SimAssumptions:
    """One set of assumptions for every method and scale.

    Fields:
        mtbi_chip_years: mean time between interruptions of one chip, in years (the paper: 1).
        slice_chips: chips per slice, the unit that fails, is recovered / replaced, and is dropped
            or re-admitted by an elastic re-shape (256: one TPU pod slice / a few hosts' worth).
            Islands are made of whole slices. Hardly matters at MTBI 1 year (a slice is down a
            fraction ``slice_chips * recovery_s / MTBI_chip`` of the time, < 0.1%).
        recovery_s: time from a failure until the failed slice is usable again AND a stopped job
            is training again (detect, swap in a spare, restart, restore, redo lost steps). The
            one calibrated number (against the DP column).
        reshape_s: time an elastic job (elastic DP, or an island with elastic island recovery)
            stalls to re-mesh when it drops a failed slice or re-admits a recovered one.
        horizon_s: simulated seconds; ``None`` = automatic: long enough for ``target_failures``
            failures at the given scale, at least ``min_horizon_s``, at most ``max_horizon_s``.
        target_failures: failures to simulate per (method, chips) cell when horizon_s is None.
        min_horizon_s, max_horizon_s: bounds of the automatic horizon.
        seed: seeds the numpy Generator; the failure stream depends on (seed, chips) only.
        island_recovery: ``"elastic"`` (default: a failed island re-shapes without the failed
            slice after reshape_s and keeps training, like a small elastic DP job) or
            ``"restart"`` (the island stops for recovery_s, like a small DP job).
        overlap: what a failure does while its job is already stopped. ``"absorb"`` (default):
            nothing more, the failed slice is swapped / dropped in the same restart or re-shape
            (spares are assumed plentiful). ``"extend"``: the stop restarts, ending recovery_s
            (restart) or reshape_s (re-shape) after the latest failure.
        quorum_k: minimum number of islands up for the merger to make progress (K = 1: none
            ever waits).
        readmit_wait_s: how long a recovered slice may wait, idle, for the next re-shape of its
            elastic job before it starts a re-shape of its own (0, the default: re-admit at once,
            every failure costs two re-shapes; > 0 lets re-admissions share the re-shape of a
            later failure, which matters when failures come every few seconds).
    """

    mtbi_chip_years: float = 1.0
    slice_chips: int = 256
    recovery_s: float = CALIBRATED_RECOVERY_S
    reshape_s: float = 15.0
    horizon_s: float | None = None
    target_failures: int = 30_000
    min_horizon_s: float = 86_400.0
    max_horizon_s: float = 365.0 * 86_400.0
    seed: int = 0
    island_recovery: str = "elastic"
    overlap: str = "absorb"
    quorum_k: int = 1
    readmit_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.mtbi_chip_years > 0:
            raise ValueError("mtbi_chip_years must be > 0")
        if self.slice_chips < 1:
            raise ValueError("slice_chips must be >= 1")
        if self.recovery_s < 0 or self.reshape_s < 0 or self.readmit_wait_s < 0:
            raise ValueError("recovery_s, reshape_s and readmit_wait_s must be >= 0")
        if self.horizon_s is not None and not self.horizon_s > 0:
            raise ValueError("horizon_s must be > 0 (or None for automatic)")
        if self.island_recovery not in ("elastic", "restart"):
            raise ValueError("island_recovery must be 'elastic' or 'restart'")
        if self.overlap not in ("absorb", "extend"):
            raise ValueError("overlap must be 'absorb' or 'extend'")
        if self.quorum_k < 1:
            raise ValueError("quorum_k must be >= 1")


# ---------------------------------------------------------------------------------------------
# failure stream


def n_slices(chips: int, a: SimAssumptions) -> int:
    """Number of slices: ``chips / slice_chips`` rounded, at least 1 (chips per slice may be
    fractional so that the total is exactly ``chips``)."""
    return max(1, round(chips / a.slice_chips))


def horizon(chips: int, a: SimAssumptions) -> float:
    """Simulated seconds for a job of ``chips`` chips (see SimAssumptions.horizon_s)."""
    if a.horizon_s is not None:
        return float(a.horizon_s)
    rate = chips / (a.mtbi_chip_years * SECONDS_PER_YEAR)  # failures per second, all chips
    return float(min(a.max_horizon_s, max(a.min_horizon_s, a.target_failures / rate)))


def failure_stream(chips: int, a: SimAssumptions) -> tuple[np.ndarray, np.ndarray, float]:
    """(sorted failure times, failed slice index per failure, horizon) for ``chips`` chips.

    Slice failures are independent exponential processes of rate 1 / MTBI_slice, where
    MTBI_slice = MTBI_chip / chips_per_slice; together one Poisson process of rate
    chips / MTBI_chip, each failure on a uniformly chosen slice. Depends on (seed, chips) only.
    """
    h = horizon(chips, a)
    n = n_slices(chips, a)
    rng = np.random.default_rng([a.seed, chips, n])
    rate = chips / (a.mtbi_chip_years * SECONDS_PER_YEAR)
    k = int(rng.poisson(rate * h))
    times = np.sort(rng.uniform(0.0, h, size=k))
    slices = rng.integers(0, n, size=k)
    return times, slices, h


# ---------------------------------------------------------------------------------------------
# one job (DP over all chips, or one island)
#
# Both job models return productive slice-seconds; ``timeline`` (if given) receives
# (time, productive slices) change points, starting with (0, n).


def restart_job(
    times: Sequence[float],
    n: int,
    recovery_s: float,
    h: float,
    extend: bool,
    timeline: list[tuple[float, float]] | None = None,
) -> float:
    """A job that stops entirely on any failure and trains again ``recovery_s`` later on all
    ``n`` slices (the failed one repaired or replaced by a spare)."""
    up_from = 0.0  # the job trains from here until the next failure (if up_from <= it)
    prod = 0.0
    for t in times:
        if t >= up_from:  # the job was training: it stops now
            prod += t - up_from
            if timeline is not None:
                timeline.append((t, 0.0))
                timeline.append((t + recovery_s, float(n)))
            up_from = t + recovery_s
        elif extend:  # already stopped: the restart has to start over
            up_from = t + recovery_s
            if timeline is not None:
                timeline[-1] = (up_from, float(n))
    if up_from < h:
        prod += h - up_from
    return prod * n


def elastic_job(
    times: Sequence[float],
    slices: Sequence[int],
    n: int,
    recovery_s: float,
    reshape_s: float,
    h: float,
    extend: bool,
    timeline: list[tuple[float, float]] | None = None,
    readmit_wait_s: float = 0.0,
) -> float:
    """A job that re-shapes. A member slice failing while the job trains stalls every slice for
    ``reshape_s`` (re-mesh without it); then the job trains on the remaining slices. A failed
    slice is back after ``recovery_s`` and is re-admitted by the next re-shape: at once
    (``readmit_wait_s = 0``), or at the latest ``readmit_wait_s`` later, when it starts a
    re-shape of its own. Changes during a stall join that re-shape (``extend``: they restart
    it). With no healthy slice the job idles until a slice is back."""
    back_at = [0.0] * n  # per slice: when it is healthy again
    recoveries: deque[float] = deque()  # FIFO: recovery_s is the same for every failure
    healthy = n  # slices in the mesh (training, or joining at the end of the current stall)
    pending = 0  # recovered slices waiting for the next re-shape
    admit_at = math.inf  # when the waiting slices start a re-shape of their own
    run_from = 0.0  # the job trains (on `healthy` slices) from here until the next change
    prod = 0.0
    i, k = 0, len(times)
    inf = math.inf
    while True:
        tf = times[i] if i < k else inf
        tr = recoveries[0] if recoveries else inf
        if tf <= tr and tf <= admit_at:
            t = tf
            if t >= h:
                break
            j = slices[i]
            i += 1
            if back_at[j] > t:  # that slice is already down: nothing changes
                continue
            # (a recovered slice still waiting for re-admission counts as a member here: it
            # makes the job re-shape a little early; rare, it is waiting <= readmit_wait_s)
            back_at[j] = t + recovery_s
            recoveries.append(t + recovery_s)
            delta = -1
        elif tr <= admit_at:
            t = tr
            if t >= h:
                break
            recoveries.popleft()
            if t >= run_from and healthy > 0 and readmit_wait_s > 0:
                pending += 1  # training: wait for the next re-shape
                admit_at = min(admit_at, t + readmit_wait_s)
                continue
            delta = 1
        else:
            t = admit_at
            if t >= h:
                break
            delta = 0
        if t >= run_from:  # the job was training (or idle with no slice): stall now
            prod += healthy * (t - run_from)
            if timeline is not None:
                timeline.append((t, 0.0))
            run_from = t + reshape_s
        elif extend:
            run_from = t + reshape_s
            if timeline is not None:
                timeline.pop()
        healthy += delta + pending  # the re-shape admits every waiting slice
        pending, admit_at = 0, inf
        if timeline is not None:
            timeline.append((run_from, float(healthy)))
    if run_from < h:
        prod += healthy * (h - run_from)
    return prod
