"""Scavenging benchmark: burst compute for a window, wall-clock to a target loss vs the base run.

The paper's table (2604.21428, secondary figures): with +25%, +50%, +100% and +300% burst
compute, wall-clock to the target loss is 0.90x, 0.83x, 0.75x, 0.62x of the base run for
Decoupled DiLoCo and 1.07x, 1.09x, 1.02x, 0.80x for data-parallel.

**Decoupled DiLoCo** is measured with the production `Island` and `Merger` on a virtual clock
(the chaos benchmark's approach: training/bench/chaos.py, helpers of training/bench/sim.py):
`N_BASE` islands of speed 1 train; the base run ends when the merged tokens reach the budget,
and its final eval loss is the target. Each burst run adds ``burst x N_BASE`` scavenged islands
for a window (opening ``window_open`` and lasting ``window_len`` of the base run's time), as the
`diloco_scavenge` DAG does: slots that were stopped join (their stop marker cleared) after
``join_s`` (provisioning, startup), start from the current global model on their own data
shards and, when the window closes, leave through their stop marker (publishing their last
partial interval, as `training/island/process.py` does on a stop). A slot reclaimed before that (spot
preemption; with ``--reclaim-mtbi-h H`` each slot's reclaim time after its join is Exp(H);
default: none, the capacity holds for the window) leaves at once: its steps since its last
publish are lost and it does not come back within the window.

**Data-parallel** comes from the goodput simulator's job model (training/bench/goodput_model.py):
one job whose throughput is proportional to its chips while it trains. Growing the mesh when
the burst chips arrive, shrinking it when the window closes and dropping a reclaimed slice
each restart the whole job (``recovery_s``, the simulator's calibrated 78.6 s); with
``dp_failures`` the base and burst chips also fail as in the simulator (MTBI 1 year per chip,
``chips`` base chips), each failure a restart. Its tokens to the target are assumed not to
depend on the batch size (optimistic for DP: a larger batch is never less efficient per token).
Both methods see the same window, join delay and reclaim times (common random numbers).

Virtual time maps onto real time through ``base_hours``: the base Decoupled run stands for that
many hours, which sets what ``join_s``, ``recovery_s`` and reclaims cost. Reported per row:
wall-clock to the target relative to the base run, goodput (productive / provisioned
chip-time) and system uptime (the fraction of the time the system advances a step).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from dataclasses import asdict, dataclass

import numpy as np

from training.bench.goodput_model import CALIBRATED_RECOVERY_S, SECONDS_PER_YEAR
from training.bench.quality import base_config, parse_sets
from training.bench.scavenge_compare import main_compare
from training.bench.scavenge_report import format_table, plot, ratio_text, write_json
from training.bench.sim import VirtualClock, eval_set
from training.config.experiment import ExperimentConfig, with_overrides
from training.island.process import Island
from training.merge import replay
from training.merge.merger import Merger, initial_version
from training.model.baseline import Curve
from training.model.runtime import loop_for
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

BURSTS = (0.25, 0.5, 1.0, 3.0)
PAPER = {
    "decoupled": dict(zip(BURSTS, (0.90, 0.83, 0.75, 0.62), strict=True)),
    "dp": dict(zip(BURSTS, (1.07, 1.09, 1.02, 0.80), strict=True)),
}
N_BASE = 2
STEPS_PER_ISLAND = {True: 48, False: 144}  # quick, default: the base run's steps per island


@dataclass(frozen=True)
class Assumptions:
    """The settings of the benchmark (see the module docstring)."""

    base_hours: float = 24.0  # real hours the base run stands for
    window_open: float = 0.1  # the window opens at this fraction of the base run ...
    window_len: float = 0.5  # ... and lasts this fraction of it
    join_s: float = 600.0  # provisioning + startup of scavenged capacity, seconds
    reclaim_mtbi_h: float = 0.0  # mean hours until a slot is reclaimed; 0: never (the window holds)
    recovery_s: float = CALIBRATED_RECOVERY_S  # DP: one restart (re-mesh), seconds
    chips: int = 150_000  # DP with failures: base chips (MTBI 1 year per chip)
    mtbi_chip_years: float = 1.0
    H: int = 4
    batch_size: int = 8
    seed: int = 0


def slots_for(burst: float) -> tuple[int, float]:
    """(scavenged islands, the speed of each) for `burst` x the base compute: whole islands
    of speed 1 where they fit, else one slower island (+25% of 2 islands: one at speed 0.5)."""
    extra = burst * N_BASE
    slots = max(1, math.ceil(extra - 1e-9))
    return slots, extra / slots


# A burst island slower than the base ones (+25% of 2: one at speed 0.5) finishes its round up
# to one of its long steps after the boundary, past the merger's grace window: every round then
# holds two partial merges (the base pair's, x 2/3 by outer.partial_scaling, and its own, x 1/3),
# and with the plain outer step each re-applies the whole momentum: 13 of its 18 lone merges
# made the eval loss worse (up to +0.07), +25% took 1.21x the base time (docs/BENCHMARKS.md).
# outer.fractional_momentum makes such a merge n/M of an outer step for the momentum too.
# An experiment setting: a scavenging experiment sets it when it is created (a join keeps the
# experiment's settings).
SCAVENGE_SETTINGS = {"outer.fractional_momentum": True}


def bench_config(
    quick: bool, a: Assumptions, burst: float, shards: int, sets: dict | None = None
) -> ExperimentConfig:
    """The base islands and `burst`'s slots; `shards` data shards in every run, so the base
    islands train on the same data in all of them. With SCAVENGE_SETTINGS (all runs, the base
    too: its two islands always merge together, share 1, so it does not change there), then
    `sets` (`--set`, every run)."""
    cfg = base_config(quick, None, None)
    slots, speed = slots_for(burst) if burst else (0, 1.0)
    islands = [{"name": f"island-{i}", "speed": 1.0} for i in range(N_BASE)]
    islands += [{"name": f"scav-{k}", "speed": speed} for k in range(slots)]
    budget = N_BASE * STEPS_PER_ISLAND[quick] * a.batch_size * cfg.data.seq_len
    return with_overrides(
        cfg,
        {
            "name": "bench-scavenge",
            "islands": islands,
            "inner.H": a.H,
            "data.batch_size": a.batch_size,
            "data.num_shards": shards,
            "token_budget": budget,
            "seed": a.seed,
            **SCAVENGE_SETTINGS,
            **(sets or {}),
        },
    )


def reclaim_offsets(slots: int, a: Assumptions) -> list[float]:
    """Per slot, seconds from its join until its capacity is reclaimed (common to both
    methods); infinite when `reclaim_mtbi_h` is 0 (the capacity holds for the window)."""
    if not a.reclaim_mtbi_h:
        return [math.inf] * slots
    rng = np.random.default_rng([a.seed, 29])
    return [float(rng.exponential(a.reclaim_mtbi_h * 3600.0)) for _ in range(slots)]


# -- Decoupled DiLoCo: the real harness ---------------------------------------------------------
def run_decoupled(
    cfg: ExperimentConfig,
    window: tuple[float, float] | None,
    join_delay: float,
    reclaims: list[float],
    eval_dt: float,
    target: float | None,
) -> dict:
    """One run; virtual seconds (a step takes 1). Ends at the token budget (target None) or
    when the eval loss reaches `target` (or at 4x the budget's time, then time_to_target None)."""
    clock = VirtualClock()
    store = ExperimentStore(open_store(f"memory://scav-{uuid.uuid4().hex[:8]}"), cfg.name)
    store.write_config(json.loads(cfg.to_json()))
    initial_version(cfg, store)
    base = [i.name for i in cfg.islands][:N_BASE]
    burst = [i.name for i in cfg.islands][N_BASE:]
    speed = {i.name: i.speed for i in cfg.islands}
    for n in burst:
        store.request_stop(n)  # slots of an earlier window: inactive until they join
    live = {n: Island(cfg, n, store, clock=clock) for n in base}
    for isl in live.values():
        isl.start()
    merger, loop, evals = Merger(cfg, store, clock=clock), loop_for(cfg), eval_set(cfg)
    next_t = dict.fromkeys(base, 1.0)
    events: list[tuple[float, str, str]] = []  # (time, kind, island)
    if window and burst:
        t_join = window[0] + join_delay
        for n, off in zip(burst, reclaims, strict=True):
            if t_join < window[1]:
                events.append((t_join, "join", n))
                events.append((min(window[1], t_join + off), "leave", n))
    events.sort()
    provisioned, stepping, merged = {n: (0.0, None) for n in base}, 0.0, 0
    left: dict[str, str] = {}
    curve, next_eval, wake = Curve(), eval_dt, None

    def merge() -> None:
        nonlocal merged, wake
        for r in merger.merge_all():
            merged = max(merged, r.tokens_merged or 0)
            wake = r.waiting_until

    def evaluate() -> float:
        params = store.load_params(store.current_snapshot(), replay.params_of(cfg, store))
        loss = loop.eval_loss(loop.put_params(params), evals)
        curve.add(clock.t, merged, float(loss))
        return float(loss)

    evaluate()
    limit = 4 * cfg.token_budget / (cfg.data.batch_size * cfg.data.seq_len) / N_BASE
    while True:
        if target is None and merged >= cfg.token_budget:
            break
        if clock.t > limit:
            break
        t_step = min(next_t[n] for n in live)
        t_event = events[0][0] if events else math.inf
        t_wake = math.inf if wake is None else wake
        t = min(t_step, t_event, t_wake, next_eval)
        clock.t = max(clock.t, t)
        if t == next_eval:
            next_eval += eval_dt
            if evaluate() <= (target if target is not None else -math.inf):
                break
        elif t == t_event:
            _, kind, n = events.pop(0)
            if kind == "join":
                store.clear_stop(n)
                live[n] = Island(cfg, n, store, clock=clock)
                live[n].start()  # the current global model
                next_t[n] = clock.t + 1.0 / speed[n]
                provisioned[n] = (clock.t, None)
            elif n in live:
                isl = live.pop(n)
                store.request_stop(n)
                clean = clock.t >= window[1]
                if clean:  # the window closed: its stop marker, its last interval published
                    isl.publish_remainder()
                    store.mark_done(n, {"step": isl.step_count})
                left[n] = "window closed" if clean else "reclaimed"
                provisioned[n] = (provisioned[n][0], clock.t)
                merge()
        elif t == t_wake:
            wake = None
            merge()
        else:
            n = min(live, key=lambda k: (next_t[k], k))
            result = live[n].step()
            stepping += 1.0  # chip-time: 1 / speed seconds on speed x the chips
            next_t[n] += 1.0 / speed[n]
            if result.published:
                merge()
    end = clock.t
    merge()
    if target is None:
        evaluate()
    prov = sum(((e if e is not None else end) - s) * speed[n] for n, (s, e) in provisioned.items())
    return dict(
        curve=curve,
        end=end,
        time_to_target=curve.time_to(target) if target is not None else None,
        final_loss=curve.losses[-1],
        goodput=stepping / prov if prov else None,
        uptime=1.0,  # K = 1 and the base islands never stop: some island always steps
        left=left,
        merged_tokens=merged,
    )


# -- data-parallel: the goodput simulator's job model --------------------------------------------
def run_dp(
    burst: float,
    base_s: float,
    a: Assumptions,
    window: tuple[float, float] | None,
    reclaims: list[float],
    failures: bool,
) -> dict:
    """Seconds until the DP job has done `base_s` seconds of base-chip work, with the burst's
    chips (``burst`` x base) from ``window[0] + join_s`` to a reclaim or ``window[1]``; every
    mesh change (and, with `failures`, every chip failure) restarts the job for recovery_s.
    Each of `burst`'s slots (`slots_for`) brings its share of the chips and is reclaimed
    `reclaims[k]` seconds after the join, at the latest when the window closes."""
    rng = np.random.default_rng([a.seed, 31])
    changes: list[tuple[float, float]] = []  # (time, rate change)
    if window and burst:
        slots, speed = slots_for(burst)
        t_join = window[0] + a.join_s
        if t_join < window[1]:
            changes.append((t_join, burst))
            for off in reclaims[:slots]:  # a slot's chips: speed / N_BASE of the base's
                changes.append((min(window[1], t_join + off), -speed / N_BASE))
    changes.sort()
    rate, t, work, up_s, prov, up_from = 1.0, 0.0, 0.0, 0.0, 0.0, 0.0
    fail_rate = a.chips / (a.mtbi_chip_years * SECONDS_PER_YEAR) if failures else 0.0
    while True:
        start = max(t, up_from)  # the job trains from here (after a restart)
        t_done = start + (base_s - work) / rate
        t_change = changes[0][0] if changes else math.inf
        t_fail = t + rng.exponential(1.0 / (fail_rate * rate)) if fail_rate else math.inf
        t_next = min(t_change, t_fail, t_done)
        if t_next > start:
            work += (t_next - start) * rate
            up_s += t_next - start
        prov += (t_next - t) * rate
        t = t_next
        if t == t_done:
            break
        if t == t_change:
            rate = max(1.0, rate + changes.pop(0)[1])
        if t >= up_from:  # restart (a new mesh, or a failure); absorbed while restarting
            up_from = t + a.recovery_s
    return dict(end=t, goodput=work / prov if prov else None, uptime=up_s / t if t else None)


# -- the table ------------------------------------------------------------------------------------
def run(
    quick: bool, a: Assumptions, bursts=BURSTS, progress=print, sets: dict | None = None
) -> dict:
    started = time.perf_counter()
    shards = N_BASE + max(slots_for(b)[0] for b in bursts)
    steps = STEPS_PER_ISLAND[quick]
    eval_dt = max(1.0, steps / 48)
    base = run_decoupled(bench_config(quick, a, 0.0, shards, sets), None, 0.0, [], eval_dt, None)
    target = base["final_loss"]
    t_base = base["curve"].time_to(target)
    scale = a.base_hours * 3600.0 / t_base  # real seconds per virtual second
    window_v = (a.window_open * t_base, (a.window_open + a.window_len) * t_base)
    progress(
        f"base: {N_BASE} islands, target loss {target:.4f} at {t_base:.1f} steps "
        f"(= {a.base_hours:g} h) [{time.perf_counter() - started:.0f} s]"
    )
    dp_base = {f: run_dp(0.0, a.base_hours * 3600.0, a, None, [], f) for f in (False, True)}
    rows = []
    for b in bursts:
        slots = slots_for(b)[0]
        reclaims = reclaim_offsets(slots, a)
        cfg = bench_config(quick, a, b, shards, sets)
        r = run_decoupled(
            cfg, window_v, a.join_s / scale, [x / scale for x in reclaims], eval_dt, target
        )
        rel = None if r["time_to_target"] is None else r["time_to_target"] / t_base
        rows.append(
            dict(
                method="decoupled",
                burst=b,
                islands=N_BASE + slots,
                time_to_target_rel=rel,
                paper=PAPER["decoupled"][b],
                goodput=r["goodput"],
                uptime=r["uptime"],
                reclaimed=sum(v == "reclaimed" for v in r["left"].values()),
                curve=r["curve"].to_dict(),  # to the target: other targets read off it
            )
        )
        progress(f"decoupled +{b:.0%}: {ratio_text(rel)} [{time.perf_counter() - started:.0f} s]")
        window_s = (window_v[0] * scale, window_v[1] * scale)
        for failures in (False, True):
            d = run_dp(b, a.base_hours * 3600.0, a, window_s, reclaims, failures)
            base_end = dp_base[failures]["end"]
            rows.append(
                dict(
                    method="dp_failures" if failures else "dp",
                    burst=b,
                    islands=None,
                    time_to_target_rel=d["end"] / base_end,
                    paper=PAPER["dp"][b],
                    goodput=d["goodput"],
                    uptime=d["uptime"],
                    reclaimed=sum(1 for x in reclaims if window_s[0] + a.join_s + x < window_s[1]),
                )
            )
    return dict(
        assumptions=asdict(a),
        sets=sets or {},
        quick=quick,
        base=dict(
            islands=N_BASE,
            target_loss=target,
            time_to_target_steps=t_base,
            curve=base["curve"].to_dict(),
            dp_goodput=dp_base[False]["goodput"],
            dp_failures_goodput=dp_base[True]["goodput"],
            dp_failures_uptime=dp_base[True]["uptime"],
        ),
        rows=rows,
        seconds=time.perf_counter() - started,
    )


def main(argv: list[str]) -> int:
    d = Assumptions()
    p = argparse.ArgumentParser(
        prog="diloco bench scavenge",
        description="Burst compute for a window (+25%..+300%): wall-clock to the target loss "
        "relative to the base run, Decoupled DiLoCo (real harness) and data-parallel (goodput "
        "simulator), beside the paper's figures.",
    )
    p.add_argument("--quick", action="store_true", help="a short base run (a test)")
    p.add_argument("--json", metavar="OUT", help="write {assumptions, base, rows}")
    p.add_argument("--plot", metavar="PNG", help="wall-clock ratio against the burst")
    p.add_argument("--bursts", default=",".join(str(b) for b in BURSTS))
    for f in ("base_hours", "window_open", "window_len", "join_s", "reclaim_mtbi_h"):
        p.add_argument(f"--{f.replace('_', '-')}", type=float, default=getattr(d, f))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every Decoupled run, e.g. outer.staleness=age",
    )
    p.add_argument(
        "--compare",
        metavar="JSON[,JSON...]",
        help="run nothing: compare these runs (the baseline, one JSON per seed) with --against's",
    )
    p.add_argument("--against", metavar="JSON[,JSON...]", help="the candidate's runs, per seed")
    args = p.parse_args(argv)
    if args.compare or args.against:
        return main_compare(p, args)
    sets = parse_sets(args.set, p)
    a = Assumptions(
        base_hours=args.base_hours,
        window_open=args.window_open,
        window_len=args.window_len,
        join_s=args.join_s,
        reclaim_mtbi_h=args.reclaim_mtbi_h,
        seed=args.seed,
    )
    bursts = tuple(float(b) for b in args.bursts.split(","))
    unknown = [b for b in bursts if b not in PAPER["decoupled"]]
    if unknown:
        p.error(f"--bursts: the paper has {list(BURSTS)}, not {unknown}")
    out = run(args.quick, a, bursts, sets=sets)
    print()
    print(format_table(out))
    print(f"\n{out['seconds']:.0f} s; assumptions: {out['assumptions']}")
    if args.json:
        write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return 0
