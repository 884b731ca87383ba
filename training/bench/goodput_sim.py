"""Goodput simulator: data-parallel vs elastic data-parallel vs Decoupled DiLoCo at scale.

A discrete-event simulation of chip interruptions for a training job of 150k .. 2.4M chips, as in
the goodput table of Decoupled DiLoCo (arXiv 2604.21428, secondary figures). Three modules:

- training/bench/goodput_model.py: the assumptions (`SimAssumptions`), the failure stream and the
  two job models (a job that restarts, a job that re-shapes);
- training/bench/goodput_methods.py: the methods (``dp``, ``elastic_dp``, ``decoupled_m<M>``),
  `simulate`, `run_table` and `calibrate`;
- this module: the report (markdown tables, the plot) and the command line.

Run ``python -m training.bench.goodput_sim --help`` (or ``diloco bench goodput-sim``);
docs/GOODPUT_SIM.md has the assumptions in full.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from training.bench.goodput_methods import DECOUPLED, calibrate, run_table
from training.bench.goodput_model import (
    CALIBRATED_RECOVERY_S,
    CALIBRATION_NOTE,
    CHIPS,
    METHODS,
    PAPER_TABLE,
    SimAssumptions,
)

_LABELS = {"dp": "DP", "elastic_dp": "elastic DP"}


def _label(method: str) -> str:
    m = DECOUPLED.match(method)
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
