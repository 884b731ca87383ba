"""Science benchmark: the papers' findings, each reproduced as rows on the virtual clock.

Findings (`--findings`, default all), each with its own plot:
- mixed: mixed hardware (arXiv 2604.21428). Four islands, two of them 18% slower (speeds 1, 1,
  1/1.18, 1/1.18), every inner step's time jittered by 10% (lognormal, sigma 0.1). Rows: K = M
  (synchronous: every island waits for the round), K = 1 without a grace window, K = 1 with the
  grace window. The paper: K = 1 alone loses quality, the grace window recovers it at full goodput.
- rda: radial-directional averaging against the plain weighted mean as the number of islands M
  grows (2, 4, 8 equal-speed islands, equal total tokens). The paper: RDA keeps the update norm
  (and the quality) where the mean shrinks it by about 1/sqrt(M) for near-orthogonal updates.
- compression: the outer gradient as fp32, bf16, int8, int4 and int2 (2-bit), each with and
  without error feedback, on the quality benchmark's four islands. The paper: int4 within 0.1% of
  bf16, 2-bit without error feedback collapses.
(Naive asynchronous Nesterov against Delayed Nesterov is a row pair of `diloco bench quality`.)

Every row is Decoupled DiLoCo (or the synchronous baseline) through the production Island and
Merger on training/bench/sim.py's virtual clock, at seeds 0..N-1, with the quality benchmark's
shared settings and sizes (training/bench/quality.py). Per row: mean and std of the final eval
loss, goodput (island-seconds stepping / provisioned), bytes sent per island, merges, and the
mean outer update norm |Theta_v - Theta_{v-1}| over merges (training/bench/trace.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import get_args

import numpy as np

from training.bench import stats
from training.bench.quality import SIZES, base_config, parse_sets
from training.bench.sim import run_islands
from training.bench.trace import merges
from training.config.experiment import Codec, with_overrides

FINDINGS = ("mixed", "rda", "compression")
SLOW = 1 / 1.18
JITTER = 0.10
NORMS_ONLY = 10**9  # trace every merge's norms, evaluate none of them


def _islands(speeds) -> list[dict]:
    return [{"name": f"island-{i}", "speed": s} for i, s in enumerate(speeds)]


def rows_for(finding: str) -> list[dict]:
    """The rows of one finding: label, config overrides, per-step jitter."""
    decoupled = {"outer.method": "decoupled", "inner.dylu": True}
    if finding == "mixed":
        mixed = {"islands": _islands([1.0, 1.0, SLOW, SLOW])}
        return [
            dict(label="K = M (synchronous)", jitter=JITTER, overrides={
                **mixed, "outer.method": "sync", "inner.dylu": False, "fragments.count": 1}),
            dict(label="K = 1, no grace", jitter=JITTER, overrides={
                **mixed, **decoupled, "outer.quorum": 1, "outer.max_grace_s": 0.0}),
            dict(label="K = 1 + grace", jitter=JITTER, overrides={
                **mixed, **decoupled, "outer.quorum": 1}),
        ]  # fmt: skip
    if finding == "rda":
        return [
            dict(label=f"M = {m}, {'RDA' if rda else 'mean'}", jitter=0.0, m=m, rda=rda,
                 overrides={**decoupled, "islands": _islands([1.0] * m), "outer.rda": rda})
            for m in (2, 4, 8)
            for rda in (True, False)
        ]  # fmt: skip
    if finding == "compression":
        return [
            dict(label=f"{codec}{'' if ef else ', no error feedback'}", jitter=0.0, codec=codec,
                 ef=ef, overrides={**decoupled, "codec": codec, "error_feedback": ef})
            for codec in get_args(Codec)
            for ef in (True, False)
        ]  # fmt: skip
    raise ValueError(f"unknown finding {finding!r}; known: {', '.join(FINDINGS)}")


def run_row(cfg, row: dict, seeds: int, eval_dt: float) -> dict:
    runs = []
    for seed in range(seeds):
        rcfg = with_overrides(cfg, {**row["overrides"], "seed": seed})
        started = time.time()
        out = run_islands(rcfg, eval_dt, jitter=row["jitter"], trace_every=NORMS_ONLY)
        ups = [m["update_norm"] for m in merges(out.pop("trace")) if m["update_norm"] is not None]
        out.update(update_norm=float(np.mean(ups)) if ups else None, wall_s=time.time() - started)
        runs.append(out)
        print(
            f"  {row['label']:28s} seed {seed}: eval loss {out['curve'].losses[-1]:.4f}  "
            f"goodput {out['goodput']:.1%}  merges {out['merges']}  ({out['wall_s']:.0f} s)",
            flush=True,
        )
    losses = [r["curve"].losses[-1] for r in runs]
    mean, sd = stats.mean_std(losses)
    keep = {k: v for k, v in row.items() if k != "overrides"}
    return dict(
        keep,
        overrides=row["overrides"],
        eval_loss=mean,
        eval_loss_std=sd,
        eval_losses=losses,
        goodput=float(np.mean([r["goodput"] for r in runs])),
        bytes_sent=float(np.mean([r["bytes_sent"] for r in runs])),
        merges=float(np.mean([r["merges"] for r in runs])),
        update_norm=float(np.mean([r["update_norm"] or 0.0 for r in runs])),
        tokens=float(np.mean([r["tokens"] for r in runs])),
        wall_s=float(sum(r["wall_s"] for r in runs)),
    )


def run(
    findings=FINDINGS,
    size: str = "quick",
    seeds: int = 1,
    data: str | None = None,
    tokens: int | None = None,
    overrides: dict | None = None,
    rows: list[int] | None = None,
) -> dict:
    """`rows`: the indices of the rows to run in each finding (default all)."""
    cfg = base_config(size, data, tokens, overrides)
    eval_dt = cfg.token_budget / (cfg.data.batch_size * cfg.data.seq_len) / 20
    out: dict = dict(
        size=size,
        model=cfg.model.preset,
        token_budget=cfg.token_budget,
        data=cfg.data.source,
        seeds=list(range(seeds)),
        findings={},
    )
    for finding in findings:
        print(f"[{finding}]", flush=True)
        picked = [r for i, r in enumerate(rows_for(finding)) if rows is None or i in rows]
        out["findings"][finding] = [run_row(cfg, r, seeds, eval_dt) for r in picked]
    return out


def format_tables(summary: dict) -> str:
    parts = [
        f"size {summary['size']}: model {summary['model']}, {summary['token_budget'] / 1e6:.2f}M "
        f"tokens, data {summary['data']}, seeds {len(summary['seeds'])}"
    ]
    for finding, rows in summary["findings"].items():
        base = rows[0]["eval_loss"]
        parts += [
            "",
            f"{finding}:",
            "| row | eval loss (mean ± std) | vs first row | goodput | update norm | "
            "sent / island | merges |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            parts.append(
                f"| {r['label']} | {r['eval_loss']:.4f} ± {r['eval_loss_std']:.4f} | "
                f"{(r['eval_loss'] / base - 1) * 100:+.2f}% | {r['goodput']:.1%} | "
                f"{r['update_norm']:.3f} | {r['bytes_sent'] / 2**20:.2f} MiB | {r['merges']:.0f} |"
            )
    return "\n".join(parts)


def plot(summary: dict, directory: str) -> list[str]:
    """One PNG per finding: science_<finding>.png in `directory`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    Path(directory).mkdir(parents=True, exist_ok=True)
    for finding, rows in summary["findings"].items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
        if finding == "rda":
            for rda, style in ((True, "o-"), (False, "s--")):
                sel = [r for r in rows if r["rda"] == rda]
                name = "RDA" if rda else "weighted mean"
                ax1.errorbar(
                    [r["m"] for r in sel],
                    [r["eval_loss"] for r in sel],
                    [r["eval_loss_std"] for r in sel],
                    fmt=style,
                    label=name,
                )
                ax2.plot([r["m"] for r in sel], [r["update_norm"] for r in sel], style, label=name)
            ax1.set_xlabel("islands M")
            ax2.set_xlabel("islands M")
            ax2.set_ylabel("mean outer update norm")
            ax1.legend()
        else:
            x = np.arange(len(rows))
            ax1.bar(x, [r["eval_loss"] for r in rows], yerr=[r["eval_loss_std"] for r in rows])
            ax1.set_xticks(x, [r["label"] for r in rows], rotation=40, ha="right", fontsize=7)
            lo = min(r["eval_loss"] for r in rows)
            ax1.set_ylim(bottom=lo * 0.95)
            second = "goodput" if finding == "mixed" else "bytes_sent"
            vals = [r[second] * (100 if second == "goodput" else 2**-20) for r in rows]
            ax2.bar(x, vals, color="C1")
            ax2.set_xticks(x, [r["label"] for r in rows], rotation=40, ha="right", fontsize=7)
            ax2.set_ylabel("goodput (%)" if second == "goodput" else "MiB sent / island")
        ax1.set_ylabel("final eval loss (nats/byte)")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
        fig.suptitle(f"{finding}: {summary['size']}, seeds {len(summary['seeds'])}", fontsize=9)
        fig.tight_layout()
        path = str(Path(directory) / f"science_{finding}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="diloco bench science", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--findings", default=",".join(FINDINGS))
    parser.add_argument("--size", choices=sorted(SIZES), default="quick")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--data", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="token budget override")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--rows", default=None, help="comma-separated row indices (from 0) of each finding"
    )
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--plot-dir", default=None, help="writes science_<finding>.png there")
    args = parser.parse_args(argv)
    findings = tuple(f.strip() for f in args.findings.split(",") if f.strip())
    if not findings or set(findings) - set(FINDINGS):
        parser.error(f"unknown findings {sorted(set(findings) - set(FINDINGS))}; known: {FINDINGS}")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    try:
        rows = [int(i) for i in args.rows.split(",")] if args.rows else None
    except ValueError:
        parser.error(f"--rows takes row indices, got {args.rows!r}")
    if rows is not None:
        fewest = min(len(rows_for(f)) for f in findings)
        if min(rows) < 0 or max(rows) >= fewest:
            parser.error(f"--rows {args.rows}: the findings {findings} have rows 0..{fewest - 1}")
    summary = run(
        findings, args.size, args.seeds, args.data, args.tokens, parse_sets(args.set, parser), rows
    )
    print()
    print(format_tables(summary))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    if args.plot_dir:
        plot(summary, args.plot_dir)
    return 0
