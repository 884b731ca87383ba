"""Quality benchmark: five ways to train the same model on the same tokens, on a virtual clock.

Methods: (dp) data-parallel baseline, (sync) synchronous DiLoCo, (nesterov) naive asynchronous
Nesterov, (delayed_nesterov) Delayed Nesterov + DyLU, (decoupled) Decoupled DiLoCo + DyLU.
Four islands run at speeds 1, 1, 0.5 and 0.25. A sixth row, (decoupled_mixed_batch), is Decoupled
DiLoCo with islands of different hardware: the two fast islands train batches of 2B (B =
data.batch_size) at half the step rate, so the same throughput, and DyLU gives every island
rounds of the same time (H, H, H, H/2 steps) and token weighting counts their tokens.
Islands and merger are the production `Island`
and `Merger` classes over an in-memory store; only time is simulated: an island at speed v takes
1/v virtual seconds per inner step, merges take no virtual time, and the event loop always runs
the island whose next step ends first. A run is deterministic given its seed.

Seeds: `--seeds N` runs seeds 0..N-1 for every method (`--first-seed K`: seeds K..K+N-1, so that
seeds can be spread over machines and their JSON files read together). The seed sets the model's
initialization, the islands' data order, and the islands' start offsets (island i starts
U(0, start_spread) virtual seconds late), so runs of one seed are paired across methods. Per
method the table gives the mean and standard deviation of the final eval loss and the paired
difference to data-parallel with a 95% t-interval (training/bench/stats.py); a method whose
config differs from data-parallel's in anything but `outer.method` says where (computed from
the two configs).

Equal tokens means tokens *in the global model*: a method's run ends when its merged pseudo-
gradients account for the token budget (work still on the islands does not count), and data-
parallel's when its steps have consumed it. A DiLoCo run's last merge overshoots the budget by
part of a round (up to 8% at the `small` size, where a round is a third of the budget), so data-
parallel, run last in each seed, goes on past the budget on the same trajectory and is evaluated
at each other method's final token count as well: the column "vs DP at equal tokens" (JSON
`vs_dp_at_tokens_pct`, and `dp_eval_losses_at_tokens` per seed) compares at exactly those tokens;
"vs DP" compares with data-parallel at the budget, as before.

Data-parallel steps on the concatenation of the four islands' batches and, being synchronous, at
the pace of the slowest island (4 virtual seconds a step). Its traffic per island is a ring
all-reduce of fp32 gradients every step, 2 (M - 1) / M x 4 bytes x parameters sent and as many
received. DiLoCo islands report what they upload (`bytes_sent`) and download (`bytes_received`).

Sizes (`--size`): quick (tiny model, 0.8M tokens, minutes), full (tiny, 3M tokens) and small
(the 14M-parameter `small` preset, a budget that fits about 30 minutes for one seed of all five
methods on the 2-core CI machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

import numpy as np

from training.bench import stats
from training.bench.sim import VirtualClock, eval_set, run_islands
from training.config import experiment as config
from training.config.experiment import ExperimentConfig, IslandConfig, with_overrides
from training.model.baseline import run_data_parallel

__all__ = ["VirtualClock", "base_config", "method_config", "run", "eval_set"]

log = logging.getLogger("diloco.bench")

MIXED_BATCH = "decoupled_mixed_batch"
METHODS = ("dp", *get_args(config.OuterMethod), MIXED_BATCH)  # dp: training.model.baseline
LABELS = {
    "dp": "data-parallel",
    "sync": "synchronous DiLoCo",
    "nesterov": "naive async Nesterov",
    "delayed_nesterov": "Delayed Nesterov + DyLU",
    "decoupled": "Decoupled DiLoCo",
    MIXED_BATCH: "Decoupled DiLoCo, mixed batch (2B, 2B, B, B)",
}
SPEEDS = (1.0, 1.0, 0.5, 0.25)
# size -> (model preset, token budget)
SIZES = {"quick": ("tiny", 800_000), "full": ("tiny", 3_000_000), "small": ("small", 250_000)}
# Tuned on 0.5M-token runs (docs/bench-history/quality.md): the DiLoCo methods share inner lr 2e-3 (of 2, 3,
# 5e-3) and outer Nesterov lr 0.5 / momentum 0.8 (of 0.4-1.0 / 0.7-0.9); data-parallel keeps its
# best inner lr, 3e-3 (of 2, 3, 5e-3). The library defaults stay at the papers' 0.7 / 0.9.
BENCH_SETTINGS = {"inner.lr": 0.002, "outer.lr": 0.5, "outer.momentum": 0.8}
DP_SETTINGS = {"inner.lr": 0.003}
START_SPREAD_S = 1.0  # islands start up to one speed-1 inner step apart


def base_config(
    size: str | bool,
    data: str | None,
    token_budget: int | None,
    overrides: dict | None = None,
    seed: int = 0,
) -> ExperimentConfig:
    """The shared config of a size ("quick", "full", "small"; True / False mean quick / full)."""
    if isinstance(size, bool):
        size = "quick" if size else "full"
    preset, budget = SIZES[size]
    islands = tuple(IslandConfig(name=f"island-{i}", speed=s) for i, s in enumerate(SPEEDS))
    cfg = ExperimentConfig(
        name="bench-quality",
        store_url="memory://bench",
        islands=islands,
        token_budget=token_budget or budget,
        seed=seed,
    )
    cfg = with_overrides(cfg, {**BENCH_SETTINGS, "model.preset": preset})
    if data:
        cfg = with_overrides(cfg, {"data.source": data})
    return with_overrides(cfg, overrides or {})


def method_config(cfg: ExperimentConfig, method: str) -> ExperimentConfig:
    overrides: dict = {"outer.method": method if method != "dp" else "sync"}
    if method == MIXED_BATCH:  # the first half of the islands: twice the batch, same speed
        half = len(cfg.islands) / 2
        overrides["outer.method"] = "decoupled"
        overrides["islands"] = [
            {
                **i.model_dump(mode="json"),
                "batch_size": cfg.data.batch_size * (2 if n < half else 1),
            }
            for n, i in enumerate(cfg.islands)
        ]
    if method == "dp":
        overrides.update(DP_SETTINGS)
    if method in ("sync", "nesterov", "dp"):
        overrides["inner.dylu"] = False
        # the papers' baselines on one fragment, whatever the library's default P (4 since
        # issue 26): synchronous DiLoCo and naive asynchronous Nesterov as published
        overrides["fragments.count"] = 1
    return with_overrides(cfg, overrides)


def start_offsets(cfg: ExperimentConfig, spread: float) -> dict[str, float]:
    """Island start delays, U(0, spread) virtual seconds each, drawn from the config's seed."""
    rng = np.random.default_rng([cfg.seed, 7])
    return {i.name: float(rng.uniform(0.0, spread)) if spread > 0 else 0.0 for i in cfg.islands}


def run_one(
    cfg: ExperimentConfig,
    method: str,
    eval_dt: float,
    start_spread: float,
    progress=None,
    merge_latency: float = 0.0,
    trace_every: int = 0,
    dp_also_at: Sequence[int] = (),
) -> dict:
    """One method at one seed (cfg.seed); `merge_latency`, `trace_every` (DiLoCo methods: a
    per-merge trace record every N-th version, training/bench/trace.py): see `sim.run_islands`;
    `dp_also_at` (data-parallel): the other methods' final token counts, where it is evaluated
    too (`run_data_parallel`'s `also_at`)."""
    mcfg = method_config(cfg, method)
    if method == "dp":
        return run_data_parallel(mcfg, eval_dt, progress, also_at=dp_also_at)
    return run_islands(
        mcfg,
        eval_dt,
        progress,
        offsets=start_offsets(mcfg, start_spread),
        merge_latency=merge_latency,
        trace_every=trace_every,
    )


def run(
    quick: bool | str = True,
    data: str | None = None,
    methods=METHODS,
    token_budget=None,
    overrides=None,
    seeds: int = 1,
    start_spread: float = START_SPREAD_S,
    verbose: bool = False,
    merge_latency: float = 0.0,
    trace_every: int = 0,
    first_seed: int = 0,
) -> dict:
    """Every method at seeds first_seed..first_seed+seeds-1 (seed-major: each seed's set of runs
    completes together).
    `merge_latency`: virtual seconds from a publish to its merge (0: at once). `trace_every` N
    > 0: each DiLoCo run's per-merge trace (every N-th version) in `traces[method][seed]`."""
    size = ("quick" if quick else "full") if isinstance(quick, bool) else quick
    cfg = base_config(size, data, token_budget, overrides)
    tokens_per_time = cfg.data.batch_size * cfg.data.seq_len  # dp / sync pace: one batch a second
    eval_dt = cfg.token_budget / tokens_per_time / 20
    results: dict[str, list[dict]] = {m: [] for m in methods}
    total, done = seeds * len(methods), 0
    # data-parallel last in each seed: it is also evaluated at the other methods' final tokens
    order = [m for m in methods if m != "dp"] + [m for m in methods if m == "dp"]
    for seed in range(first_seed, first_seed + seeds):
        scfg = with_overrides(cfg, {"seed": seed})
        for method in order:
            started = time.time()

            def progress(t, tokens, loss, method=method, seed=seed):
                print(
                    f"    {method} seed {seed}  t={t:8.1f}  tokens={tokens / 1e6:6.2f}M  "
                    f"eval_loss={loss:.4f}",
                    flush=True,
                )

            out = run_one(
                scfg,
                method,
                eval_dt,
                start_spread,
                progress if verbose else None,
                merge_latency,
                trace_every,
                dp_also_at=[results[m][-1]["tokens"] for m in order if m != "dp"]
                if method == "dp"
                else (),
            )
            out["wall_s"] = time.time() - started
            out["seed"] = seed
            results[method].append(out)
            done += 1
            print(
                f"[{done}/{total}] {method:16s} seed {seed}: eval loss "
                f"{out['curve'].losses[-1]:.4f}  tokens {out['tokens'] / 1e6:.2f}M  "
                f"merges {out['merges']}  ({out['wall_s']:.0f} s)",
                flush=True,
            )
    summary = summarize(cfg, results)
    summary.update(size=size, start_spread_s=start_spread, merge_latency_s=merge_latency)
    if trace_every:
        summary["traces"] = {
            m: [r.get("trace") or [] for r in runs] for m, runs in results.items() if m != "dp"
        }
    return summary


def _target(dp_runs: list[dict], budget: int) -> list[float]:
    """Per seed: the eval loss data-parallel reaches at half the budget."""
    out = []
    for r in dp_runs:
        c = r["curve"]
        out.append(c.losses[next(i for i, t in enumerate(c.tokens) if t >= budget / 2)])
    return out


def _dp_at_tokens(runs: list[dict], dp_runs: list[dict]) -> list[float] | None:
    """Per seed: data-parallel's eval loss at the tokens this method's run ended with (its
    `at_tokens`), or None where a data-parallel run has no such point (read from elsewhere)."""
    out = []
    for r, d in zip(runs, dp_runs, strict=True):
        hit = [loss for target, _, loss in d.get("at_tokens", []) if target == r["tokens"]]
        if r["seed"] != d["seed"] or not hit:
            return None
        out.append(hit[0])
    return out


def _mean_or_none(xs: list) -> float | None:
    return None if not xs or any(x is None for x in xs) else float(np.mean(xs))


def summarize(cfg: ExperimentConfig, results: dict[str, list[dict]]) -> dict:
    dp_runs = results.get("dp")
    targets = _target(dp_runs, cfg.token_budget) if dp_runs else None
    dp_losses = [r["curve"].losses[-1] for r in dp_runs] if dp_runs else None
    dp_cfg = json.loads(method_config(cfg, "dp").to_json())
    dp_bytes = _mean_or_none([r["bytes_sent"] for r in dp_runs]) if dp_runs else None
    rows = {}
    for method, runs in results.items():
        losses = [r["curve"].losses[-1] for r in runs]
        mean, sd = stats.mean_std(losses)
        ttt = [r["curve"].time_to(t) for r, t in zip(runs, targets, strict=True)] if targets else []
        sent = _mean_or_none([r["bytes_sent"] for r in runs])
        row = dict(
            label=LABELS[method],
            eval_loss=mean,
            eval_loss_std=sd,
            eval_losses=losses,
            seeds=[r["seed"] for r in runs],
            tokens=float(np.mean([r["tokens"] for r in runs])),
            bytes_sent=sent,
            bytes_received=_mean_or_none([r.get("bytes_received") for r in runs]),
            bytes_vs_dp=(sent / dp_bytes) if dp_bytes and sent is not None else None,
            time_to_target=_mean_or_none(ttt) if targets else None,
            times_to_target=ttt,
            merges=float(np.mean([r["merges"] for r in runs])),
            quarantined=int(sum(r["quarantined"] for r in runs)),
            goodput=_mean_or_none([r.get("goodput") for r in runs]),
            wall_s=float(sum(r["wall_s"] for r in runs)),
            config_diff=stats.config_diff(
                json.loads(method_config(cfg, method).to_json()),
                dp_cfg,
                ignore=["outer.method", "islands"] if method == MIXED_BATCH else ["outer.method"],
            ),
            curves=[r["curve"].to_dict() for r in runs],
        )
        if dp_losses is not None and method != "dp":
            row["vs_dp"] = stats.paired_interval(losses, dp_losses).to_dict()
            row["vs_dp_pct"] = stats.relative_interval(losses, dp_losses).to_dict()
            at = _dp_at_tokens(runs, dp_runs)
            if at is not None:
                row["dp_eval_losses_at_tokens"] = at
                row["vs_dp_at_tokens_pct"] = stats.relative_interval(losses, at).to_dict()
        rows[method] = row
    return dict(
        target_loss=_mean_or_none(targets) if targets else None,
        token_budget=cfg.token_budget,
        speeds=[i.speed for i in cfg.islands],
        H=cfg.inner.H,
        codec=cfg.codec,
        model=cfg.model.preset,
        params=cfg.model.param_count(),
        data=cfg.data.source,
        seeds=[r["seed"] for r in next(iter(results.values()), [])],
        methods=rows,
    )


def _pct(iv: dict | None) -> str:
    if not iv:
        return "-"
    if iv["lo"] is None:
        return f"{iv['mean']:+.2f}% (n=1)"
    return f"{iv['mean']:+.2f}% [{iv['lo']:+.2f}, {iv['hi']:+.2f}]"


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f} MiB"


def format_table(summary: dict) -> str:
    rows = summary["methods"]
    seeds = summary["seeds"]
    head = (
        f"size {summary.get('size', '?')}: model {summary['model']} "
        f"({summary['params'] / 1e6:.2f}M parameters), {summary['token_budget'] / 1e6:.2f}M "
        f"tokens, data {summary['data']}, seeds {seeds[0]}-{seeds[-1]} (n = {len(seeds)})"
    )
    if summary.get("merge_latency_s"):
        head += f", merges {summary['merge_latency_s']:g} virtual s after each publish"
    lines = [
        head,
        "",
        "| method | eval loss (mean ± std) | vs DP (paired, 95% CI) | vs DP at equal tokens | "
        "tokens | virtual time to target | sent / island | received / island | DP bytes / ours | "
        "merges | differs from DP in |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in rows.items():
        ttt = f"{r['time_to_target']:.0f}" if r["time_to_target"] is not None else "not reached"
        ratio = f"{1 / r['bytes_vs_dp']:.0f}x" if r["bytes_vs_dp"] else "-"
        diff = stats.format_diff({k: tuple(v) for k, v in r["config_diff"].items()})
        lines.append(
            f"| {r['label']} | {r['eval_loss']:.4f} ± {r['eval_loss_std']:.4f} | "
            f"{_pct(r.get('vs_dp_pct')) if method != 'dp' else '-'} | "
            f"{_pct(r.get('vs_dp_at_tokens_pct')) if method != 'dp' else '-'} | "
            f"{r['tokens'] / 1e6:.2f}M | "
            f"{ttt} | {_mib(r['bytes_sent'])} | {_mib(r['bytes_received'])} | {ratio} | "
            f"{r['merges']:.0f} | {diff or '-'} |"
        )
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, r in enumerate(summary["methods"].values()):
        for j, c in enumerate(r["curves"]):
            ax.plot(
                c["times"], c["losses"], color=f"C{i}", lw=1.2 if j == 0 else 0.6,
                alpha=1.0 if j == 0 else 0.5, label=r["label"] if j == 0 else None,
            )  # fmt: skip
    if summary["target_loss"] is not None:
        ax.axhline(summary["target_loss"], color="grey", ls=":", lw=1, label="target")
    ax.set_xlabel("virtual time (s; speed-1 island = 1 step/s)")
    ax.set_ylabel("held-out eval loss (nats/byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    seeds = summary["seeds"]
    ax.set_title(
        f"{summary.get('size', '')}: seeds {seeds[0]}-{seeds[-1]} (n = {len(seeds)}; "
        f"thick: seed {seeds[0]})",
        fontsize=9,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_sets(items: list[str], parser: argparse.ArgumentParser) -> dict:
    """`training.config.experiment.parse_sets`, a malformed item reported by `parser`."""
    try:
        return config.parse_sets(items)
    except config.ConfigError as err:
        parser.error(str(err))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="diloco bench quality", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="same as --size quick")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: full")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 per method")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="start the seeds here: K..K+N-1 (default 0)"
    )
    parser.add_argument(
        "--start-spread", type=float, default=START_SPREAD_S, help="island start offsets (s)"
    )
    parser.add_argument(
        "--merge-latency",
        type=float,
        default=0.0,
        help="virtual seconds from a publish to its merge (a real syncer's delay; default 0)",
    )
    parser.add_argument("--data", default=None, help="directory, glob or URL (default builtin)")
    parser.add_argument("--tokens", type=int, default=None, help="token budget override")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--plot", default=None, help="PNG of eval loss vs virtual time")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every evaluation")
    parser.add_argument(
        "--trace", type=int, default=0, metavar="N", help="per-merge trace of every N-th version"
    )
    parser.add_argument("--trace-out", default=None, help="write the traces as text here")
    args = parser.parse_args(argv)
    if args.quick and args.size not in (None, "quick"):
        parser.error("--quick contradicts --size " + args.size)
    size = "quick" if args.quick else args.size or "full"
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.first_seed < 0:
        parser.error("--first-seed must be >= 0")
    if args.start_spread < 0:
        parser.error("--start-spread must be >= 0")
    if args.merge_latency < 0:
        parser.error("--merge-latency must be >= 0")
    if args.trace < 0:
        parser.error("--trace must be >= 0")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        parser.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    overrides = parse_sets(args.set, parser)
    summary = run(
        size,
        args.data,
        methods,
        token_budget=args.tokens,
        overrides=overrides,
        seeds=args.seeds,
        start_spread=args.start_spread,
        verbose=args.verbose,
        merge_latency=args.merge_latency,
        trace_every=args.trace,
        first_seed=args.first_seed,
    )
    print()
    print(format_table(summary))
    if summary["target_loss"] is not None:
        print(f"\ntarget loss {summary['target_loss']:.4f} (data-parallel at half the tokens)")
    if args.trace_out and summary.get("traces"):
        from training.bench.trace import format_trace

        text = [
            f"== {m} seed {seed}\n{format_trace(records)}"
            for m, per_seed in summary["traces"].items()
            for seed, records in zip(summary["seeds"], per_seed, strict=True)
        ]
        Path(args.trace_out).write_text("\n\n".join(text) + "\n")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(summary, args.plot)
    return 0
