"""Chaos benchmark: goodput and final eval loss as islands are killed more often.

The same small experiment (4 islands of equal speed, the quality benchmark's model and data) runs
at increasing interruption rates, Decoupled DiLoCo against synchronous DiLoCo, through the
production `Island` and `Merger` classes on a virtual clock (training/bench/quality.py's approach
and helpers). An inner step takes `step_s` virtual seconds; merges take none.

Interruptions: kill times are a Poisson process of the given rate (kills per 1000 virtual seconds,
for the whole experiment: `training.faults.chaos.kill_times`, the chaos monkey's schedule), each killing
one live island chosen uniformly (`victim_chooser`); both methods see the same schedule. A kill
discards the island object: the steps since its last checkpoint are lost. After `recovery_s`
virtual seconds (restart, startup, restore) a new `Island(...).start()` resumes from its checkpoint
and the newest global version. Decoupled islands never wait for each other; under synchronous
DiLoCo the others block at the end of their round until the dead island is back and has published
its contribution.

Goodput = productive island-seconds / provisioned island-seconds (4 x the virtual run time); the
badput split uses training/island/goodput.py's categories: wasted_progress (lost steps),
infrastructure_recovery (down time), waiting_for_global (blocked in a synchronous round), other
(a step in progress at the end).

The run ends when the tokens in the global model (merged pseudo-gradients) reach the budget, so
eval losses compare equal tokens; `--stop-on kept` ends it when the islands' kept tokens (merged
or still on the islands) do, as before 2026-12: then a faulty Decoupled run ends with up to one
interval per island unmerged (12.5% of the quick budget at 8 kills / 1000 s).
`--stagger-s S` starts island i i x S virtual seconds late (desynchronized without a fault).
`--trace N` records a per-merge trace (training/bench/trace.py) and evaluates every N-th version.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from training.bench.quality import base_config, method_config, parse_sets
from training.bench.sim import VirtualClock, eval_set
from training.bench.trace import MergeTracer, format_trace, merges
from training.config.experiment import ExperimentConfig, with_overrides
from training.faults.chaos import kill_times, victim_chooser
from training.island.goodput import BADPUT, experiment_goodput
from training.island.process import Island
from training.merge import replay
from training.merge.merger import Merger, initial_version
from training.model.runtime import loop_for
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

METHODS = ("decoupled", "sync")
LABELS = {"decoupled": "Decoupled DiLoCo", "sync": "synchronous DiLoCo"}
RATES = (0.0, 2.0, 4.0, 8.0)  # kills per 1000 virtual seconds
N_ISLANDS = 4
STEPS_PER_ISLAND = {True: 96, False: 480}  # quick, full


@dataclass(frozen=True)
class BenchParams:
    step_s: float = 10.0  # virtual seconds per inner step
    recovery_s: float = 60.0  # virtual seconds from a kill until the island runs again
    H: int = 16
    batch_size: int = 8
    seed: int = 0
    stagger_s: float = 0.0  # island i starts i x stagger_s virtual seconds late (desynchronizes)
    stop_on: str = "merged"  # end when the "merged" tokens (in the global model) or the islands'
    # "kept" tokens (merged or not) reach the budget


def bench_config(
    quick: bool,
    p: BenchParams,
    data: str | None = None,
    tokens: int | None = None,
    overrides: dict | None = None,
) -> ExperimentConfig:
    cfg = base_config(quick, data, None)
    budget = tokens or N_ISLANDS * STEPS_PER_ISLAND[quick] * p.batch_size * cfg.data.seq_len
    cfg = with_overrides(
        cfg,
        {
            "name": "bench-chaos",
            "islands": [{"name": f"island-{i}", "speed": 1.0} for i in range(N_ISLANDS)],
            "inner.H": p.H,
            "data.batch_size": p.batch_size,
            "token_budget": budget,
        },
    )
    return with_overrides(cfg, overrides or {})


def run_one(cfg: ExperimentConfig, rate: float, p: BenchParams, trace_every: int = 0) -> dict:
    """One method (cfg.outer.method) at one kill rate; returns goodput, badput, eval loss, ...

    With `trace_every` > 0 the result has a `trace` (training/bench/trace.py): one row per merge,
    evaluated every `trace_every`-th version, and the kills and restarts between them.
    """
    clock = VirtualClock()
    store = ExperimentStore(open_store(f"memory://bench-chaos-{uuid.uuid4().hex[:8]}"), cfg.name)
    store.write_config(json.loads(cfg.to_json()))
    initial_version(cfg, store)
    tracer = None
    if trace_every:
        loop, evals = loop_for(cfg), eval_set(cfg)
        tracer = MergeTracer(
            store, lambda params: loop.eval_loss(loop.put_params(params), evals), trace_every, clock
        )
    names = [i.name for i in cfg.islands]
    pace = {i.name: p.step_s / cfg.step_rate(i.name) for i in cfg.islands}
    live: dict[str, Island] = {}
    for n in names:
        live[n] = Island(cfg, n, store, clock=clock)
        live[n].start()
    merger = Merger(cfg, store, clock=clock)
    next_t = {n: pace[n] + i * p.stagger_s for i, n in enumerate(names)}
    acct = {
        n: dict.fromkeys(
            ("productive", "wasted_progress", "infrastructure_recovery", "waiting_for_global"), 0.0
        )
        for n in names
    }
    down_until: dict[str, float] = {}
    killed_at_step: dict[str, int] = {}
    ckpt_tokens = dict.fromkeys(names, 0)  # tokens at each island's last checkpoint
    blocked_since: dict[str, float] = {}
    schedule = kill_times(1000.0 / rate, p.seed) if rate > 0 else None
    next_kill = next(schedule) if schedule else math.inf
    choose = victim_chooser(p.seed)
    kills: list[dict] = []
    wake: float | None = None
    n_merges = merged = 0
    horizon = cfg.token_budget / (cfg.data.batch_size * cfg.data.seq_len) / len(names) * p.step_s

    def tokens() -> int:
        return sum(live[n].tokens if n in live else ckpt_tokens[n] for n in names)

    def done() -> bool:
        return (merged if p.stop_on == "merged" else tokens()) >= cfg.token_budget

    def merge() -> None:
        nonlocal wake, n_merges, merged
        if tracer:
            tracer.before_merge()
        results = merger.merge_all()
        if tracer:
            tracer.after_merge(results, live)
        for r in results:
            n_merges += r.version is not None
            merged = max(merged, r.tokens_merged or 0)
            wake = r.waiting_until
        for n, isl in live.items():
            if isl.blocked() and isl.poll_merged():
                acct[n]["waiting_for_global"] += clock.t - blocked_since.pop(n)
                next_t[n] = clock.t + pace[n]

    while not done():
        if clock.t > 50 * horizon:
            raise RuntimeError(f"no progress by virtual time {clock.t:.0f}")
        ready = [n for n in live if not live[n].blocked()]
        t_island = min((next_t[n] for n in ready), default=math.inf)
        t_restart = min(down_until.values(), default=math.inf)
        t_wake = math.inf if wake is None else wake
        t = min(t_island, t_restart, t_wake, next_kill)
        if t == math.inf:  # everyone waits for a merge that cannot happen yet
            merge()
            if not any(not isl.blocked() for isl in live.values()):
                raise RuntimeError("synchronous round cannot complete: no merge possible")
            continue
        clock.t = max(clock.t, t)
        if t == t_restart:
            n = min(down_until, key=lambda k: (down_until[k], k))
            del down_until[n]
            ckpt = store.load_checkpoint(n) if tracer else None
            isl = live[n] = Island(cfg, n, store, clock=clock)
            isl.start()  # resumes from its checkpoint and the newest global version
            lost = killed_at_step[n] - isl.step_count
            acct[n]["productive"] -= lost * pace[n]
            acct[n]["wasted_progress"] += lost * pace[n]
            kills[-[k["island"] for k in reversed(kills)].index(n) - 1]["lost_steps"] = lost
            next_t[n] = clock.t + pace[n]
            if tracer:
                tracer.event(
                    "restart",
                    island=n,
                    step=isl.step_count,
                    lost_steps=lost,
                    head=sum(store.current_snapshot().versions),
                    ckpt_base=max(ckpt[1]["base_version"]) if ckpt else None,
                )
        elif t == next_kill:
            next_kill = next(schedule)
            if not live:
                continue
            n = choose(list(live))
            isl = live.pop(n)
            if n in blocked_since:
                acct[n]["waiting_for_global"] += clock.t - blocked_since.pop(n)
            killed_at_step[n] = isl.step_count
            down_until[n] = clock.t + p.recovery_s
            acct[n]["infrastructure_recovery"] += p.recovery_s
            kills.append(dict(t=clock.t, island=n, step=isl.step_count))
            if tracer:
                tracer.event(
                    "kill",
                    island=n,
                    step=isl.step_count,
                    head=sum(store.current_snapshot().versions),
                )
        elif t == t_wake:
            wake = None
            merge()
        else:
            n = min(ready, key=lambda k: (next_t[k], k))
            isl = live[n]
            result = isl.step()
            acct[n]["productive"] += pace[n]
            next_t[n] += pace[n]
            if isl.checkpointed_step == isl.step_count:  # as its checkpoint policy says
                ckpt_tokens[n] = isl.tokens
            if result.published:
                if isl.blocked():
                    blocked_since[n] = clock.t
                merge()
    merge()
    end = clock.t
    for n, until in down_until.items():  # still down at the end: count only until the end
        acct[n]["infrastructure_recovery"] -= until - end
    for n, since in blocked_since.items():
        acct[n]["waiting_for_global"] += end - since
    states = {}
    for n in names:
        seconds = dict.fromkeys(BADPUT, 0.0) | acct[n]
        seconds["other"] = max(0.0, end - sum(acct[n].values()))
        states[n] = dict(elapsed_s=end, seconds=seconds, wall=end)
    g = experiment_goodput(cfg, states)
    loop = loop_for(cfg)
    snapshot = store.current_snapshot()
    params = store.load_params(snapshot, replay.params_of(cfg, store))
    eval_loss = loop.eval_loss(loop.put_params(params), eval_set(cfg))
    return dict(
        goodput=g["goodput"],
        badput=g["badput"],
        eval_loss=float(eval_loss),
        kills=len(kills),
        lost_steps=sum(k.get("lost_steps", 0) for k in kills),
        virtual_time=end,
        tokens=tokens(),
        merges=n_merges,
        final_version=list(snapshot.versions),
        tokens_merged=snapshot.tokens_merged,
        quarantined=len(store.quarantined()),
        kill_log=kills,
        **({"trace": tracer.records} if tracer else {}),
    )


def run(
    quick: bool = True,
    rates=RATES,
    methods=METHODS,
    p: BenchParams | None = None,
    data: str | None = None,
    tokens: int | None = None,
    overrides: dict | None = None,
    trace_every: int = 0,
) -> dict:
    p = p or BenchParams()
    cfg = bench_config(quick, p, data, tokens, overrides)
    rows = []
    for rate in rates:
        for method in methods:
            started = time.time()
            out = run_one(method_config(cfg, method), rate, p, trace_every)
            out.update(rate=rate, method=method, label=LABELS[method], wall_s=time.time() - started)
            rows.append(out)
            print(
                f"  rate {rate:4g}/1000s  {method:9s}  goodput {out['goodput']:6.1%}  "
                f"eval loss {out['eval_loss']:.4f}  kills {out['kills']:2d}  "
                f"lost steps {out['lost_steps']:3d}  virtual {out['virtual_time']:6.0f}s  "
                f"({out['wall_s']:.0f}s)",
                flush=True,
            )
    return dict(
        params=asdict(p),
        quick=quick,
        islands=N_ISLANDS,
        token_budget=cfg.token_budget,
        model=cfg.model.preset,
        data=cfg.data.source,
        codec=cfg.codec,
        rates=list(rates),
        overrides=overrides or {},
        rows=rows,
    )


def format_table(summary: dict) -> str:
    by = {(r["rate"], r["method"]): r for r in summary["rows"]}
    methods = [m for m in METHODS if any(k[1] == m for k in by)]
    head = ["kills / 1000 s"]
    for m in methods:
        head += [f"{LABELS[m]} goodput", "eval loss", "kills", "merges"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in summary["rates"]:
        cells = [f"{rate:g}"]
        for m in methods:
            r = by.get((rate, m))
            cells += (
                [f"{r['goodput']:.1%}", f"{r['eval_loss']:.4f}", f"{r['kills']}", f"{r['merges']}"]
                if r
                else ["-"] * 4
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_badput(summary: dict) -> str:
    cats = ["wasted_progress", "infrastructure_recovery", "waiting_for_global", "other"]
    lines = [
        "| kills / 1000 s | method | goodput | " + " | ".join(cats) + " | virtual time |",
        "|" + "---|" * (len(cats) + 4),
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['rate']:g} | {r['label']} | {r['goodput']:.1%} | "
            + " | ".join(f"{r['badput'][c]:.1%}" for c in cats)
            + f" | {r['virtual_time']:.0f} s |"
        )
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in METHODS:
        rows = [r for r in summary["rows"] if r["method"] == m]
        if not rows:
            continue
        x = [r["rate"] for r in rows]
        ax1.plot(x, [100 * r["goodput"] for r in rows], "o-", label=LABELS[m])
        ax2.plot(x, [r["eval_loss"] for r in rows], "o-", label=LABELS[m])
    ax1.set_xlabel("island kills per 1000 virtual s")
    ax1.set_ylabel("goodput (%)")
    ax1.set_ylim(0, 102)
    ax2.set_xlabel("island kills per 1000 virtual s")
    ax2.set_ylabel("final eval loss (nats/byte)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{summary['islands']} islands, {summary['token_budget'] / 1e6:.2f}M tokens, "
        f"recovery {summary['params']['recovery_s']:g} s, step {summary['params']['step_s']:g} s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="diloco bench chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small token budget (minutes)")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tokens", type=int, default=None, help="token budget override")
    parser.add_argument("--data", default=None, help="data source (default builtin:pydoc)")
    parser.add_argument("--step-s", type=float, default=BenchParams.step_s)
    parser.add_argument("--recovery-s", type=float, default=BenchParams.recovery_s)
    parser.add_argument("--H", type=int, default=BenchParams.H)
    parser.add_argument("--seed", type=int, default=BenchParams.seed)
    parser.add_argument(
        "--stop-on",
        choices=["merged", "kept"],
        default=BenchParams.stop_on,
        help="end at the budget of tokens in the global model (merged) or on the islands (kept)",
    )
    parser.add_argument(
        "--stagger-s", type=float, default=0.0, help="island i starts i x S virtual s late"
    )
    parser.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="config override, e.g. outer.quorum=2"
    )
    parser.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="N",
        help="record a per-merge trace (JSON rows 'trace'), evaluating every N-th version",
    )
    parser.add_argument("--trace-out", default=None, help="text file: the traces, one line a merge")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--plot", default=None, help="PNG: goodput and eval loss vs kill rate")
    args = parser.parse_args(argv)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(set(methods) - set(METHODS))}; known: {METHODS}")
    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        parser.error(f"--rates expects numbers, got {args.rates!r}")
    if any(r < 0 for r in rates):
        parser.error("--rates must be >= 0")
    overrides = parse_sets(args.set or [], parser)
    if args.stagger_s < 0:
        parser.error("--stagger-s must be >= 0")
    p = BenchParams(
        args.step_s, args.recovery_s, args.H, BenchParams.batch_size, args.seed, args.stagger_s,
        args.stop_on,
    )  # fmt: skip
    if args.trace < 0:
        parser.error("--trace must be >= 0")
    if args.trace_out and not args.trace:
        parser.error("--trace-out needs --trace N")
    summary = run(args.quick, rates, methods, p, args.data, args.tokens, overrides, args.trace)
    if args.trace_out:
        Path(args.trace_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.trace_out).write_text(
            "\n\n".join(
                f"# {r['label']} at {r['rate']:g} kills / 1000 s ({len(merges(r['trace']))} merges)"
                f"\n{format_trace(r['trace'])}"
                for r in summary["rows"]
            )
            + "\n"
        )
    print()
    print(format_table(summary))
    print()
    print(format_badput(summary))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(summary, args.plot)
    return 0
