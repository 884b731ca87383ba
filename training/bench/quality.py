"""Quality benchmark: five ways to train the same model on the same tokens, on a virtual clock.

Methods: (dp) data-parallel baseline, (sync) synchronous DiLoCo, (nesterov) naive asynchronous
Nesterov, (delayed_nesterov) Delayed Nesterov + DyLU, (decoupled) Decoupled DiLoCo + DyLU.
Four islands run at speeds 1, 1, 0.5 and 0.25. Islands and merger are the production `Island`
and `Merger` classes over an in-memory store; only time is simulated: an island at speed v takes
1/v virtual seconds per inner step, merges take no virtual time, and the event loop always runs
the island whose next step ends first. The run is deterministic (fixed seeds, fixed event order).

Equal tokens means tokens *in the global model*: a method's run ends when its merged pseudo-
gradients account for the token budget (work still on the islands does not count), and data-
parallel's when its steps have consumed it.

Data-parallel steps on the concatenation of the four islands' batches and, being synchronous, at
the pace of the slowest island (4 virtual seconds a step). Its traffic per island is a ring
all-reduce of fp32 gradients every step: 2 (M - 1) / M x 4 bytes x parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from training import inner, model
from training.config import ExperimentConfig, IslandConfig, with_overrides
from training.data import BatchLoader, eval_batches, shard_tokens
from training.island import Island, corpus_for, loop_for
from training.merge import Merger, initial_version
from training.store.experiment import ExperimentStore
from training.store.objectstore import open_store

log = logging.getLogger("diloco.bench")

METHODS = ("dp", "sync", "nesterov", "delayed_nesterov", "decoupled")
LABELS = {
    "dp": "data-parallel",
    "sync": "synchronous DiLoCo",
    "nesterov": "naive async Nesterov",
    "delayed_nesterov": "Delayed Nesterov + DyLU",
    "decoupled": "Decoupled DiLoCo",
}
SPEEDS = (1.0, 1.0, 0.5, 0.25)
# Tuned on 0.5M-token runs (docs/BENCHMARKS.md): the DiLoCo methods share inner lr 2e-3 (of 2, 3,
# 5e-3) and outer Nesterov lr 0.5 / momentum 0.8 (of 0.4-1.0 / 0.7-0.9); data-parallel keeps its
# best inner lr, 3e-3 (of 2, 3, 5e-3). The library defaults stay at the papers' 0.7 / 0.9.
BENCH_SETTINGS = {"inner.lr": 0.002, "outer.lr": 0.5, "outer.momentum": 0.8}
DP_SETTINGS = {"inner.lr": 0.003}


@dataclass
class Curve:
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def add(self, t: float, tokens: int, loss: float) -> None:
        self.times.append(t)
        self.tokens.append(tokens)
        self.losses.append(loss)

    def time_to(self, target: float) -> float | None:
        """First virtual time the eval loss reaches `target` (linear between evaluations)."""
        for i, loss in enumerate(self.losses):
            if loss <= target:
                if i == 0:
                    return self.times[0]
                t0, t1, l0 = self.times[i - 1], self.times[i], self.losses[i - 1]
                return t0 + (t1 - t0) * (l0 - target) / (l0 - loss)
        return None


class VirtualClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def base_config(
    quick: bool, data: str | None, token_budget: int | None, overrides: dict | None = None
) -> ExperimentConfig:
    islands = tuple(IslandConfig(name=f"island-{i}", speed=s) for i, s in enumerate(SPEEDS))
    cfg = ExperimentConfig(
        name="bench-quality",
        store_url="memory://bench",
        islands=islands,
        token_budget=token_budget or (800_000 if quick else 3_000_000),
    )
    cfg = with_overrides(cfg, BENCH_SETTINGS)
    if data:
        cfg = with_overrides(cfg, {"data.source": data})
    return with_overrides(cfg, overrides or {})


def method_config(cfg: ExperimentConfig, method: str) -> ExperimentConfig:
    overrides: dict = {"outer.method": method if method != "dp" else "sync"}
    if method == "dp":
        overrides.update(DP_SETTINGS)
    if method in ("sync", "nesterov", "dp"):
        overrides["inner.dylu"] = False
    return with_overrides(cfg, overrides)


def _eval_set(cfg: ExperimentConfig):
    corpus = corpus_for(cfg)
    return eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.seq_len, cfg.data.eval_batches)


def run_dp(cfg: ExperimentConfig, eval_dt: float, progress) -> dict:
    """Data-parallel: one AdamW step on all islands' batches, at the slowest island's pace."""
    loop = loop_for(cfg)
    corpus = corpus_for(cfg)
    loaders = [
        BatchLoader(
            shard_tokens(corpus.train, cfg.shard_of(i.name), cfg.num_shards),
            cfg.data.batch_size,
            cfg.data.seq_len,
            seed=cfg.seed * 1000 + cfg.shard_of(i.name),
        )
        for i in cfg.islands
    ]
    params = loop.put_params(inner.to_host(model.init_params(cfg.model, cfg.seed)))
    opt_state = loop.init_opt_state(params)
    evals = _eval_set(cfg)
    step_time = max(1.0 / i.speed for i in cfg.islands)
    curve, tokens, t = Curve(), 0, 0.0
    curve.add(0.0, 0, loop.eval_loss(params, evals))
    next_eval = eval_dt
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    m = len(cfg.islands)
    steps = 0
    while tokens < cfg.token_budget:
        batches = [ld.next_batch() for ld in loaders]
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1] for b in batches])
        params, opt_state, _ = loop.step(params, opt_state, x, y)
        tokens += x.size
        steps += 1
        t += step_time
        if t >= next_eval:
            curve.add(t, tokens, loop.eval_loss(params, evals))
            next_eval += eval_dt
            progress(t, tokens, curve.losses[-1])
    if curve.tokens[-1] != tokens:
        curve.add(t, tokens, loop.eval_loss(params, evals))
    bytes_per_island = steps * 2 * (m - 1) / m * 4 * n_params
    return dict(
        curve=curve, tokens=tokens, bytes_sent=bytes_per_island, merges=steps, quarantined=0
    )


def run_islands(cfg: ExperimentConfig, eval_dt: float, progress) -> dict:
    """The production Island and Merger classes on a virtual clock over a memory:// store."""
    clock = VirtualClock()
    store = ExperimentStore(open_store(f"memory://bench-{uuid.uuid4().hex[:8]}"), cfg.name)
    store.write_config(json.loads(cfg.to_json()))
    initial_version(cfg, store)
    islands = [Island(cfg, i.name, store, clock=clock) for i in cfg.islands]
    for isl in islands:
        isl.start()
    merger = Merger(cfg, store, clock=clock)
    loop = loop_for(cfg)
    evals = _eval_set(cfg)
    pace = {isl.name: 1.0 / isl.spec.speed for isl in islands}
    next_t = {isl.name: pace[isl.name] for isl in islands}
    wake: float | None = None
    curve = Curve()
    seen_version = -1
    next_eval = 0.0
    merges = quarantined = merged_tokens = 0

    def evaluate():
        nonlocal seen_version
        snapshot = store.current_snapshot()
        loss = loop.eval_loss(loop.put_params(store.load_params(snapshot)), evals)
        seen_version = sum(snapshot.versions)
        curve.add(clock.t, merged_tokens, loss)
        progress(clock.t, curve.tokens[-1], loss)

    def merge():
        nonlocal wake, merges, quarantined, merged_tokens
        for r in merger.merge_all():
            merges += r.version is not None
            merged_tokens = max(merged_tokens, r.tokens_merged or 0)
            quarantined += len(r.quarantined)
            wake = r.waiting_until
        for isl in islands:
            if isl.blocked() and isl.poll_merged():
                next_t[isl.name] = clock.t + pace[isl.name]

    evaluate()
    next_eval = eval_dt
    while merged_tokens < cfg.token_budget:
        ready = [i for i in islands if not i.blocked()]
        t_island = min((next_t[i.name] for i in ready), default=None)
        if wake is not None and (t_island is None or wake <= t_island):
            clock.t = max(clock.t, wake)
            wake = None
            merge()
            continue
        if t_island is None:  # everyone waits for a merge that cannot happen yet
            merge()
            if all(i.blocked() for i in islands):
                raise RuntimeError("synchronous round cannot complete: no merge possible")
            continue
        isl = min(ready, key=lambda i: (next_t[i.name], i.name))
        clock.t = next_t[isl.name]
        result = isl.step()
        next_t[isl.name] += pace[isl.name]
        if result.published:
            merge()
        if clock.t >= next_eval:
            evaluate()
            next_eval += eval_dt
    evaluate()
    bytes_sent = float(np.mean([i.bytes_sent for i in islands]))
    return dict(
        curve=curve,
        tokens=merged_tokens,
        tokens_processed=sum(i.tokens for i in islands),
        bytes_sent=bytes_sent,
        merges=merges,
        quarantined=quarantined,
        final_version=seen_version,
    )


def run(
    quick: bool = True, data: str | None = None, methods=METHODS, token_budget=None, overrides=None
) -> dict:
    cfg = base_config(quick, data, token_budget, overrides)
    tokens_per_time = cfg.data.batch_size * cfg.data.seq_len  # dp / sync pace: one batch a second
    eval_dt = cfg.token_budget / tokens_per_time / 20
    results: dict[str, dict] = {}
    for method in methods:
        mcfg = method_config(cfg, method)
        started = time.time()

        def progress(t, tokens, loss, method=method):
            print(
                f"  {method:17s} t={t:8.1f}  tokens={tokens / 1e6:6.2f}M  eval_loss={loss:.4f}",
                flush=True,
            )

        print(f"[{method}] {LABELS[method]}", flush=True)
        out = (run_dp if method == "dp" else run_islands)(mcfg, eval_dt, progress)
        out["wall_s"] = time.time() - started
        results[method] = out
    return summarize(cfg, results)


def summarize(cfg: ExperimentConfig, results: dict[str, dict]) -> dict:
    dp = results.get("dp")
    # Target: the eval loss data-parallel reaches at half the token budget; every method should
    # get there, and the time it takes shows the cost of synchronization.
    target = None
    if dp:
        curve = dp["curve"]
        half = next(i for i, t in enumerate(curve.tokens) if t >= cfg.token_budget / 2)
        target = curve.losses[half]
    rows = {}
    for method, r in results.items():
        c: Curve = r["curve"]
        rows[method] = dict(
            label=LABELS[method],
            eval_loss=c.losses[-1],
            tokens=r["tokens"],
            bytes_sent=r["bytes_sent"],
            bytes_vs_dp=(r["bytes_sent"] / dp["bytes_sent"]) if dp else None,
            time_to_target=c.time_to(target) if target is not None else None,
            end_time=c.times[-1],
            merges=r["merges"],
            quarantined=r["quarantined"],
            wall_s=r["wall_s"],
            curve=dict(times=c.times, tokens=c.tokens, losses=c.losses),
        )
    return dict(
        target_loss=target,
        token_budget=cfg.token_budget,
        speeds=[i.speed for i in cfg.islands],
        H=cfg.inner.H,
        codec=cfg.codec,
        model=cfg.model.preset,
        data=cfg.data.source,
        methods=rows,
    )


def format_table(summary: dict) -> str:
    rows = summary["methods"]
    dp = rows.get("dp")
    lines = [
        "| method | eval loss | vs DP | tokens | virtual time to target | bytes sent / island | DP bytes / ours | merges |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        vs = f"{(r['eval_loss'] / dp['eval_loss'] - 1) * 100:+.2f}%" if dp else "-"
        ttt = f"{r['time_to_target']:.0f}" if r["time_to_target"] is not None else "not reached"
        ratio = f"{1 / r['bytes_vs_dp']:.0f}x" if r["bytes_vs_dp"] else "-"
        lines.append(
            f"| {r['label']} | {r['eval_loss']:.4f} | {vs} | {r['tokens'] / 1e6:.2f}M | {ttt} | "
            f"{r['bytes_sent'] / 2**20:.1f} MiB | {ratio} | {r['merges']} |"
        )
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in summary["methods"].values():
        ax.plot(r["curve"]["times"], r["curve"]["losses"], label=r["label"])
    if summary["target_loss"] is not None:
        ax.axhline(summary["target_loss"], color="grey", ls=":", lw=1, label="target")
    ax.set_xlabel("virtual time (s; speed-1 island = 1 step/s)")
    ax.set_ylabel("held-out eval loss (nats/byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="diloco bench quality", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller token budget (minutes)")
    parser.add_argument("--data", default=None, help="data source (default builtin:pydoc)")
    parser.add_argument("--tokens", type=int, default=None, help="token budget override")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--plot", default=None, help="PNG of eval loss vs virtual time")
    args = parser.parse_args(argv)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    summary = run(args.quick, args.data, methods, args.tokens, overrides)
    print()
    print(format_table(summary))
    if summary["target_loss"] is not None:
        print(f"\ntarget loss {summary['target_loss']:.4f} (data-parallel at half the tokens)")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(summary, args.plot)
    return 0
