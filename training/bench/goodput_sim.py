"""Goodput simulator: data-parallel vs elastic data-parallel vs Decoupled DiLoCo at scale.

A discrete-event simulation of chip interruptions for a training job of 150k .. 2.4M chips, as in
the goodput table of Decoupled DiLoCo (arXiv 2604.21428, secondary figures). Goodput is

    sum of productive chip-seconds / sum of provisioned chip-seconds

over a simulated horizon. Every chip is interrupted on average once per ``mtbi_chip_years``; chips
are grouped into slices of ``slice_chips`` (the unit that fails and is replaced), so slice failures
form one Poisson process of rate ``n_slices / MTBI_slice`` with a uniformly chosen slice each time.
The same failure stream (same seed, same chips) drives every method, so methods are compared on
common random numbers.

Methods (see docs/GOODPUT_SIM.md for the full list of assumptions):

``dp``
    One data-parallel job over all chips. A failure anywhere stops every chip for ``recovery_s``
    (detect, swap in a spare slice, restart, restore, redo lost steps); then all chips train again.
``elastic_dp``
    One data-parallel job that re-shapes: a failure stalls every chip for ``reshape_s`` while the
    job re-meshes without the failed slice, and the job trains on the remaining slices; the failed
    slice is back after ``recovery_s`` and is re-admitted with another ``reshape_s`` stall (at once
    by default; ``readmit_wait_s`` lets it wait for a re-shape to share).
``decoupled_m<M>``
    The chips are split into M islands of whole slices; each island is its own job (elastic within
    the island by default, ``island_recovery="restart"`` for the plain "stop the island for
    ``recovery_s``" model). Islands never wait for each other; the merger (CPU-only, assumed not to
    fail) needs a quorum of ``quorum_k`` islands. With K = 1 there is never a global stall: while at
    least one island is up, its chips are productive. If *all* islands are down at once, nothing is
    productive (every chip is idle anyway); the merger keeps the last committed global parameters
    and the first island back resumes from them, so no merged progress is lost. With K > 1, the up
    islands count as unproductive whenever fewer than K islands are up (they are blocked on the
    quorum; the overlap slack of tau steps is ignored).

Run ``python -m training.bench.goodput_sim --help`` (or ``diloco bench goodput-sim``).

Length: the simulator, its calibration and its report in one benchmark module (past 500 lines;
nothing outside the benchmark imports it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

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

_DECOUPLED = re.compile(r"^decoupled_m([1-9][0-9]*)$")


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


def _restart_job(
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


def _elastic_job(
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


# ---------------------------------------------------------------------------------------------
# methods


def _islands(method: str) -> int:
    if method == "dp" or method == "elastic_dp":
        return 0
    m = _DECOUPLED.match(method)
    if not m:
        raise ValueError(
            f"unknown method {method!r}: expected 'dp', 'elastic_dp' or 'decoupled_m<M>'"
        )
    return int(m.group(1))


def goodput_from_failures(
    method: str,
    chips: int,
    times: np.ndarray | Sequence[float],
    slices: np.ndarray | Sequence[int],
    a: SimAssumptions,
    horizon_s: float,
) -> float:
    """Goodput of ``method`` for an explicit failure stream (``times`` sorted, ``slices`` the
    failed slice index per failure, ``0 <= slice < n_slices(chips, a)``) over ``horizon_s``."""
    n = n_slices(chips, a)  # every slice has chips / n chips, so slice-seconds are enough
    times_l = [float(t) for t in times]
    slices_l = [int(s) for s in slices]
    if len(times_l) != len(slices_l):
        raise ValueError("times and slices differ in length")
    if any(s < 0 or s >= n for s in slices_l):
        raise ValueError(f"slice index out of range [0, {n})")
    extend = a.overlap == "extend"
    m = _islands(method)
    if m == 0:
        if method == "dp":
            prod = _restart_job(times_l, n, a.recovery_s, horizon_s, extend)
        else:
            prod = _elastic_job(
                times_l,
                slices_l,
                n,
                a.recovery_s,
                a.reshape_s,
                horizon_s,
                extend,
                readmit_wait_s=a.readmit_wait_s,
            )
        return prod / (n * horizon_s)

    if m > n:
        raise ValueError(f"{method}: {n} slices of {a.slice_chips} chips cannot form {m} islands")
    if a.quorum_k > m:
        raise ValueError(f"quorum_k={a.quorum_k} > {m} islands")
    # island i owns slices i, i + m, i + 2m, ...; local index = slice // m
    island_times: list[list[float]] = [[] for _ in range(m)]
    island_slices: list[list[int]] = [[] for _ in range(m)]
    for t, s in zip(times_l, slices_l, strict=True):
        island_times[s % m].append(t)
        island_slices[s % m].append(s // m)
    sizes = [len(range(i, n, m)) for i in range(m)]
    need_timeline = a.quorum_k > 1
    timelines: list[list[tuple[float, float]]] = []
    prod = 0.0
    for i in range(m):
        tl: list[tuple[float, float]] | None = [(0.0, float(sizes[i]))] if need_timeline else None
        if a.island_recovery == "elastic":
            prod += _elastic_job(
                island_times[i],
                island_slices[i],
                sizes[i],
                a.recovery_s,
                a.reshape_s,
                horizon_s,
                extend,
                tl,
                a.readmit_wait_s,
            )
        else:
            prod += _restart_job(island_times[i], sizes[i], a.recovery_s, horizon_s, extend, tl)
        if tl is not None:
            timelines.append(tl)
    if need_timeline:
        prod = _quorum_productive(timelines, a.quorum_k, horizon_s)
    return prod / (n * horizon_s)


def _quorum_productive(timelines: list[list[tuple[float, float]]], k: int, h: float) -> float:
    """Productive slice-seconds when islands count only while at least ``k`` of them are up."""
    cuts = np.unique(np.concatenate([np.array([p[0] for p in tl]) for tl in timelines] + [[h]]))
    cuts = cuts[cuts <= h]
    levels = np.empty((len(timelines), len(cuts)))
    for r, tl in enumerate(timelines):
        ts = np.array([p[0] for p in tl])
        lv = np.array([p[1] for p in tl])
        # change points are appended in time order; a later entry at the same time wins
        idx = np.searchsorted(ts, cuts, side="right") - 1
        levels[r] = lv[idx]
    up = (levels > 0).sum(axis=0)
    rate = np.where(up >= k, levels.sum(axis=0), 0.0)
    return float(np.sum(rate[:-1] * np.diff(cuts)))


def uptime_from_failures(
    method: str,
    chips: int,
    times: np.ndarray | Sequence[float],
    slices: np.ndarray | Sequence[int],
    a: SimAssumptions,
    horizon_s: float,
) -> float:
    """System uptime of ``method`` (the paper's figure next to goodput): the fraction of
    ``horizon_s`` in which the system advances a step. DP and elastic DP: the job trains.
    Decoupled: at least ``quorum_k`` islands train (K = 1: any island)."""
    return goodput_and_uptime(method, chips, times, slices, a, horizon_s)[1]


def goodput_and_uptime(
    method: str,
    chips: int,
    times: np.ndarray | Sequence[float],
    slices: np.ndarray | Sequence[int],
    a: SimAssumptions,
    horizon_s: float,
) -> tuple[float, float]:
    """(`goodput_from_failures`, `uptime_from_failures`) from one pass over the jobs."""
    n = n_slices(chips, a)
    extend = a.overlap == "extend"
    times_l, slices_l = [float(t) for t in times], [int(s) for s in slices]
    m = _islands(method)
    if m == 0:
        tl = [(0.0, float(n))]
        if method == "dp":
            prod = _restart_job(times_l, n, a.recovery_s, horizon_s, extend, tl)
        else:
            prod = _elastic_job(
                times_l, slices_l, n, a.recovery_s, a.reshape_s, horizon_s, extend, tl,
                a.readmit_wait_s,
            )  # fmt: skip
        return prod / (n * horizon_s), _up_fraction([tl], 1, horizon_s)
    island_times: list[list[float]] = [[] for _ in range(m)]
    island_slices: list[list[int]] = [[] for _ in range(m)]
    for t, s in zip(times_l, slices_l, strict=True):  # island i owns slices i, i + m, ...
        island_times[s % m].append(t)
        island_slices[s % m].append(s // m)
    timelines, prod = [], 0.0
    for i in range(m):
        size = len(range(i, n, m))
        tl = [(0.0, float(size))]
        if a.island_recovery == "elastic":
            prod += _elastic_job(
                island_times[i], island_slices[i], size, a.recovery_s, a.reshape_s,
                horizon_s, extend, tl, a.readmit_wait_s,
            )  # fmt: skip
        else:
            prod += _restart_job(island_times[i], size, a.recovery_s, horizon_s, extend, tl)
        timelines.append(tl)
    if a.quorum_k > 1:
        prod = _quorum_productive(timelines, a.quorum_k, horizon_s)
    return prod / (n * horizon_s), _up_fraction(timelines, a.quorum_k, horizon_s)


def _up_fraction(timelines: list[list[tuple[float, float]]], k: int, h: float) -> float:
    """Fraction of [0, h] in which at least ``k`` of the timelines are above zero."""
    arrays = [np.array(tl, dtype=float).reshape(-1, 2) for tl in timelines]
    cuts = np.unique(np.concatenate([x[:, 0] for x in arrays] + [np.array([h])]))
    cuts = cuts[cuts <= h]
    up = np.zeros(len(cuts))
    for x in arrays:  # change points in time order; a later entry at the same time wins
        up += x[np.searchsorted(x[:, 0], cuts, side="right") - 1, 1] > 0
    return float(np.sum((up[:-1] >= k) * np.diff(cuts)) / h)


def simulate(method: str, chips: int, a: SimAssumptions | None = None) -> float:
    """Goodput fraction of ``method`` ('dp', 'elastic_dp', 'decoupled_m<M>') at ``chips`` chips."""
    a = a or SimAssumptions()
    _islands(method)  # validate the name before the work
    times, slices, h = failure_stream(chips, a)
    return goodput_from_failures(method, chips, times, slices, a, h)


def run_table(
    chips_list: Iterable[int] = CHIPS,
    methods: Iterable[str] = METHODS,
    a: SimAssumptions | None = None,
    progress: Callable[[str, list[dict]], None] | None = None,
) -> list[dict]:
    """Rows ``{"method", "chips", "goodput", "uptime"}`` (fractions; uptime:
    `uptime_from_failures`), method-major. ``progress(method, rows_of_that_method)`` is called
    after each method."""
    a = a or SimAssumptions()
    chips_list = list(chips_list)
    streams = {c: failure_stream(c, a) for c in chips_list}
    rows: list[dict] = []
    for method in methods:
        mrows = []
        for c in chips_list:
            times, slices, h = streams[c]
            g, u = goodput_and_uptime(method, c, times, slices, a, h)
            mrows.append({"method": method, "chips": int(c), "goodput": float(g), "uptime": u})
        rows.extend(mrows)
        if progress is not None:
            progress(method, mrows)
    return rows


def calibrate(
    field: str = "recovery_s",
    column: str = "dp",
    a: SimAssumptions | None = None,
    lo: float = 1.0,
    hi: float = 600.0,
    tol: float = 0.05,
) -> tuple[float, float]:
    """Fit ONE assumption (a float field) by least squares, in percentage points, against ONE
    column of PAPER_TABLE; returns (value, rms error in pp). Golden-section search on [lo, hi];
    the failure streams are fixed (common random numbers) so the objective is smooth enough."""
    a = a or SimAssumptions()
    chips_list = sorted(PAPER_TABLE[column])
    streams = {c: failure_stream(c, a) for c in chips_list}

    def sse(x: float) -> float:
        b = replace(a, **{field: x})
        err = 0.0
        for c in chips_list:
            times, slices, h = streams[c]
            g = goodput_from_failures(column, c, times, slices, b, h)
            err += (100.0 * (g - PAPER_TABLE[column][c])) ** 2
        return err

    phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - phi * (hi - lo), lo + phi * (hi - lo)
    f1, f2 = sse(x1), sse(x2)
    while hi - lo > tol:
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - phi * (hi - lo)
            f1 = sse(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + phi * (hi - lo)
            f2 = sse(x2)
    x = (lo + hi) / 2.0
    return x, math.sqrt(sse(x) / len(chips_list))


# ---------------------------------------------------------------------------------------------
# output

_LABELS = {"dp": "DP", "elastic_dp": "elastic DP"}


def _label(method: str) -> str:
    m = _DECOUPLED.match(method)
    return f"Decoupled M={m.group(1)}" if m else _LABELS.get(method, method)


def _chips_label(c: int) -> str:
    if c >= 1_000_000 and c % 100_000 == 0:
        return f"{c / 1_000_000:g}M"
    if c >= 1000 and c % 1000 == 0:
        return f"{c // 1000}k"
    return str(c)


def format_table(rows: list[dict]) -> str:
    """Markdown table, one row per method, one column per chip count: ``ours (paper)`` in
    percent, plus the mean absolute error against the paper in percentage points."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    chips = sorted({r["chips"] for r in rows})
    g = {(r["method"], r["chips"]): r["goodput"] for r in rows}
    head = "| method | " + " | ".join(_chips_label(c) for c in chips) + " | mean abs. error |"
    lines = [head, "|---|" + "---:|" * (len(chips) + 1)]
    for m in methods:
        cells, errs = [], []
        for c in chips:
            if (m, c) not in g:
                cells.append("")
                continue
            ours = 100.0 * g[(m, c)]
            paper = PAPER_TABLE.get(m, {}).get(c)
            if paper is None:
                cells.append(f"{ours:.0f}")
            else:
                cells.append(f"{ours:.0f} ({100.0 * paper:.0f})")
                errs.append(abs(ours - 100.0 * paper))
        mae = f"{sum(errs) / len(errs):.1f} pp" if errs else ""
        lines.append(f"| {_label(m)} | " + " | ".join(cells) + f" | {mae} |")
    return "\n".join(lines)


def format_uptime(rows: list[dict]) -> str:
    """Markdown table of system uptime (%), one row per method, one column per chip count."""
    chips = sorted({r["chips"] for r in rows})
    u = {(r["method"], r["chips"]): r["uptime"] for r in rows}
    lines = ["| method | " + " | ".join(_chips_label(c) for c in chips) + " |"]
    lines.append("|---|" + "---:|" * len(chips))
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = [f"{100.0 * u[(m, c)]:.1f}" if (m, c) in u else "" for c in chips]
        lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: str | Path, title: str = "") -> None:
    """Goodput vs chips per method: ours solid with markers, the paper's dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(methods))]
    for color, m in zip(colors, methods, strict=True):
        mr = sorted((r for r in rows if r["method"] == m), key=lambda r: r["chips"])
        xs = [r["chips"] for r in mr]
        ax.plot(xs, [100 * r["goodput"] for r in mr], "-o", color=color, label=f"{_label(m)}")
        if m in PAPER_TABLE:
            px = sorted(PAPER_TABLE[m])
            ax.plot(px, [100 * PAPER_TABLE[m][c] for c in px], "--", color=color, alpha=0.8)
    ax.plot([], [], "k-", label="ours (simulated)")
    ax.plot([], [], "k--", label="paper (secondary)")
    ax.set_xscale("log")
    chips = sorted({r["chips"] for r in rows})
    ax.set_xticks(chips, [_chips_label(c) for c in chips])
    ax.minorticks_off()
    ax.set_xlabel("chips (MTBI 1 year per chip)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "Goodput vs scale: simulated (solid) vs paper (dashed)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def describe(a: SimAssumptions) -> str:
    """One line per assumption, for the printed output."""
    parts = [f"{f.name}={getattr(a, f.name)!r}" for f in fields(a)]
    return "assumptions: " + ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="diloco bench goodput-sim",
        description="Simulate goodput of DP, elastic DP and Decoupled DiLoCo (M islands) at "
        "150k..2.4M chips with MTBI 1 year per chip, beside the paper's (secondary) table.",
    )
    d = SimAssumptions()
    p.add_argument("--json", metavar="OUT", help="write the rows {method, chips, goodput}")
    p.add_argument("--plot", metavar="OUT.png", help="plot goodput vs chips (ours vs paper)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--recovery-s", type=float, default=d.recovery_s)
    p.add_argument("--slice-chips", type=int, default=d.slice_chips)
    p.add_argument("--reshape-s", type=float, default=d.reshape_s)
    p.add_argument("--horizon-s", type=float, default=None, help="default: automatic")
    p.add_argument("--mtbi-chip-years", type=float, default=d.mtbi_chip_years)
    p.add_argument("--island-recovery", choices=("elastic", "restart"), default=d.island_recovery)
    p.add_argument("--overlap", choices=("absorb", "extend"), default=d.overlap)
    p.add_argument("--quorum-k", type=int, default=d.quorum_k)
    p.add_argument("--readmit-wait-s", type=float, default=d.readmit_wait_s)
    p.add_argument("--target-failures", type=int, default=d.target_failures)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="first fit recovery_s against the paper's DP column, then use it",
    )
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    a = SimAssumptions(
        mtbi_chip_years=args.mtbi_chip_years,
        slice_chips=args.slice_chips,
        recovery_s=args.recovery_s,
        reshape_s=args.reshape_s,
        horizon_s=args.horizon_s,
        seed=args.seed,
        island_recovery=args.island_recovery,
        overlap=args.overlap,
        quorum_k=args.quorum_k,
        readmit_wait_s=args.readmit_wait_s,
        target_failures=args.target_failures,
    )
    start = time.perf_counter()
    if args.calibrate:
        r, rms = calibrate("recovery_s", "dp", a)
        print(f"calibration: recovery_s = {r:.1f} s fits the paper's DP column, rms {rms:.1f} pp")
        a = replace(a, recovery_s=r)
        note = f"calibrated now: recovery_s = {r:.1f} s against the paper's DP column"
    elif a.recovery_s == CALIBRATED_RECOVERY_S:
        changed = [
            f.name
            for f in fields(a)
            if f.name not in ("seed", "horizon_s", "target_failures")
            and getattr(a, f.name) != getattr(d, f.name)
        ]
        note = CALIBRATION_NOTE + (
            f" (changed from defaults: {', '.join(changed)})" if changed else ""
        )
    else:
        note = f"recovery_s = {a.recovery_s:g} s given (not the calibrated {CALIBRATED_RECOVERY_S:g} s)"
    print(describe(a))
    print(note)

    def progress(method: str, mrows: list[dict]) -> None:
        cells = "  ".join(f"{_chips_label(r['chips'])}: {100 * r['goodput']:5.1f}%" for r in mrows)
        print(f"  {method:<14} {cells}   [{time.perf_counter() - start:.2f} s]", flush=True)

    rows = run_table(CHIPS, METHODS, a, progress=progress)
    print()
    print("goodput, % — ours (paper, secondary)")
    print(format_table(rows))
    print("\nsystem uptime, % (the fraction of time the system advances a step)")
    print(format_uptime(rows))
    print(f"\n{note}. Total {time.perf_counter() - start:.2f} s.")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {out}")
    if args.plot:
        fitted = args.calibrate or a.recovery_s == CALIBRATED_RECOVERY_S
        title = (
            "Goodput vs scale, MTBI 1 year/chip: solid = simulated, dashed = paper (secondary)\n"
            f"recovery {a.recovery_s:.1f} s{' (fitted on DP)' if fitted else ''}, "
            f"reshape {a.reshape_s:g} s, slice {a.slice_chips} chips, "
            f"islands {a.island_recovery}, readmit wait {a.readmit_wait_s:g} s, K={a.quorum_k}"
        )
        plot(rows, args.plot, title=title)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
