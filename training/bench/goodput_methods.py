"""Goodput simulator, the methods: data-parallel, elastic data-parallel and Decoupled DiLoCo.

Each method turns one failure stream (training/bench/goodput_model.py) into goodput and system
uptime (see docs/GOODPUT_SIM.md for the full list of assumptions):

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

Also here: `run_table` (every method at every scale) and `calibrate` (the one fitted number).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from training.bench.goodput_model import (
    CHIPS,
    METHODS,
    PAPER_TABLE,
    SimAssumptions,
    elastic_job,
    failure_stream,
    n_slices,
    restart_job,
)

DECOUPLED = re.compile(r"^decoupled_m([1-9][0-9]*)$")
"""A Decoupled method's name; group 1 is M, the number of islands."""


def _islands(method: str) -> int:
    if method == "dp" or method == "elastic_dp":
        return 0
    m = DECOUPLED.match(method)
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
            prod = restart_job(times_l, n, a.recovery_s, horizon_s, extend)
        else:
            prod = elastic_job(
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
            prod += elastic_job(
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
            prod += restart_job(island_times[i], sizes[i], a.recovery_s, horizon_s, extend, tl)
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
            prod = restart_job(times_l, n, a.recovery_s, horizon_s, extend, tl)
        else:
            prod = elastic_job(
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
            prod += elastic_job(
                island_times[i], island_slices[i], size, a.recovery_s, a.reshape_s,
                horizon_s, extend, tl, a.readmit_wait_s,
            )  # fmt: skip
        else:
            prod += restart_job(island_times[i], size, a.recovery_s, horizon_s, extend, tl)
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
