"""How the scavenging benchmark's results read (training/bench/scavenge.py runs it,
training/bench/scavenge_compare.py compares two settings of it): the markdown table, the plot,
a wall-clock ratio as text, the JSON file."""

from __future__ import annotations

import json
from pathlib import Path


def ratio_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


LABELS = {
    "decoupled": "Decoupled DiLoCo (harness)",
    "dp": "data-parallel (restarts)",
    "dp_failures": "data-parallel (restarts + failures)",
}


def format_table(out: dict) -> str:
    """Markdown: one row per method and burst: ours, the paper's, goodput, uptime."""
    lines = [
        "| method | burst | wall-clock to target (paper) | goodput | uptime | reclaimed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {LABELS[r['method']]} | +{r['burst']:.0%} | {ratio_text(r['time_to_target_rel'])} "
            f"({r['paper']:.2f}x) | {_pct(r['goodput'])} | {_pct(r['uptime'])} | "
            f"{r['reclaimed']} |"
        )
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    """Wall-clock to the target relative to the base run against the burst, ours and the
    paper's, per method (1.0: no gain)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, m in enumerate(LABELS):
        rows = [r for r in out["rows"] if r["method"] == m and r["time_to_target_rel"]]
        if not rows:
            continue
        xs = [100 * r["burst"] for r in rows]
        ax.plot(xs, [r["time_to_target_rel"] for r in rows], "o-", color=f"C{i}", label=LABELS[m])
        if m != "dp_failures":
            ax.plot(xs, [r["paper"] for r in rows], "x--", color=f"C{i}", alpha=0.6,
                    label=f"{LABELS[m].split(' (')[0]}, paper")  # fmt: skip
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks([25, 50, 100, 300], ["+25%", "+50%", "+100%", "+300%"])
    ax.set_xlabel("burst compute during the window")
    ax.set_ylabel("wall-clock to target / base run")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(name: str, out: dict) -> None:
    path = Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
