"""Artifacts for people: `diloco list`, `diloco history` and `diloco report --out DIR`.

- `list_rows(store)`: one summary per experiment of a store (training/views/catalog.py,
  training/dashboard.experiment_summary).
- `history(cfg, estore)`: per fragment its committed versions (time, contributions applied,
  tokens merged), and the recorded snapshots (time, versions, who recorded it, eval loss).
- `write_report(view, out)`: the DiLoCo page's charts as PNG files (matplotlib; SVG written by
  hand when matplotlib is missing) and one self-contained HTML file (images inlined, no
  external reference) from `training.views.dashboard.experiment_view`.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.store.faces import ReaderFace
from training.store.layout import iso


def _iso(t: Any) -> str | None:
    return iso(t) if isinstance(t, int | float) and not isinstance(t, bool) and t > 0 else None


# ------------------------------------------------------------------ list
def list_rows(store) -> list[dict[str, Any]]:
    """Every experiment in `store`, summarised (an unreadable one says why)."""
    from training.store.experiment import ExperimentStore
    from training.views.catalog import list_experiments
    from training.views.dashboard import experiment_summary

    rows = []
    for name in list_experiments(store):
        estore = ExperimentStore(store, name)
        try:
            rows.append(experiment_summary(estore.config(), estore))
        except Exception as exc:  # one broken experiment must not hide the others
            rows.append(dict(experiment=name, store=store.url, error=str(exc).splitlines()[0]))
    return rows


def format_list(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no experiments"
    header = f"{'experiment':28s} {'versions':12s} {'tokens merged / budget':>26s} {'islands':>8s} {'best loss':>9s}  state"
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['experiment']:28s} unreadable: {r['error']}")
            continue
        versions = ",".join(map(str, r["versions"])) if r["versions"] else "-"
        tokens = f"{r['tokens_merged']:,} / {r['token_budget']:,}"
        done = f"{r['islands_done']}/{r['islands']}"
        best = "-" if r["best_loss"] is None else f"{r['best_loss']:.4f}"
        state = r.get("state", "running")
        lines.append(
            f"{r['experiment']:28s} {versions:12s} {tokens:>26s} {done:>8s} {best:>9s}  {state}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ history
def history(cfg, estore) -> dict[str, Any]:
    """{"fragments": {p: [version rows]}, "snapshots": [snapshot rows]}, oldest first."""
    estore = ReaderFace(estore)  # training/store/faces.py
    evals = estore.read_metrics("eval")
    fragments = {}
    for p in range(cfg.fragments.count):
        loss_at = {}  # this fragment's version -> the first eval of a snapshot holding it
        for e in evals:
            versions = e.get("versions")
            if isinstance(versions, list) and len(versions) > p:
                loss_at.setdefault(versions[p], e.get("loss"))
        rows = []
        for m in estore.list_fragment_versions(p):
            at = m.get("merged_at", m.get("created_at"))
            rows.append(
                dict(
                    version=m.get("version"),
                    at=at,
                    at_iso=m.get("created_at_iso") or _iso(at),
                    applied=len(m.get("applied") or []),
                    tokens_merged=m.get("tokens_merged"),
                    eval_loss=loss_at.get(m.get("version")),
                    islands=sorted(
                        {
                            c.get("island")
                            for c in m.get("contributions") or []
                            if isinstance(c, Mapping) and c.get("island")
                        }
                    ),
                )
            )
        fragments[p] = rows
    snapshots = [
        dict(
            at=s.get("at"),
            at_iso=s.get("at_iso") or _iso(s.get("at")),
            versions=s.get("versions"),
            tokens_merged=s.get("tokens_merged"),
            by=s.get("by"),
            loss=s.get("loss"),
        )
        for s in estore.snapshots()
    ]
    return dict(experiment=cfg.name, fragments=fragments, snapshots=snapshots)


def format_history(h: Mapping[str, Any]) -> str:
    lines = [f"experiment {h['experiment']}"]
    for p, rows in h["fragments"].items():
        lines += [
            "",
            f"fragment {p}: {len(rows)} versions",
            f"{'version':>7s}  {'time (UTC)':20s} {'applied':>7s} {'tokens merged':>14s} "
            f"{'eval loss':>9s}  islands",
        ]
        for r in rows:
            tokens = "-" if r["tokens_merged"] is None else f"{r['tokens_merged']:,}"
            loss = "-" if not isinstance(r["eval_loss"], int | float) else f"{r['eval_loss']:.4f}"
            lines.append(
                f"{r['version']:>7d}  {r['at_iso'] or '-':20s} {r['applied']:>7d} {tokens:>14s} "
                f"{loss:>9s}  " + ", ".join(r["islands"])
            )
    lines += [
        "",
        f"snapshots: {len(h['snapshots'])}",
        f"{'time (UTC)':20s} {'by':6s} {'versions':14s} {'tokens merged':>14s} {'eval loss':>9s}",
    ]
    for s in h["snapshots"]:
        versions = ",".join(map(str, s["versions"] or []))
        loss = "-" if not isinstance(s["loss"], int | float) else f"{s['loss']:.4f}"
        tokens = "-" if s["tokens_merged"] is None else f"{s['tokens_merged']:,}"
        lines.append(
            f"{s['at_iso'] or '-':20s} {s['by'] or '-':6s} {versions:14s} {tokens:>14s} {loss:>9s}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ report
def _series(view: Mapping[str, Any]) -> list[tuple[str, list[dict], bool]]:
    """(label, points, is_eval) of every loss curve of the page."""
    out = [("eval (held-out)", list(view["evals"]), True)]
    out += [(f"{i} (training)", pts, False) for i, pts in view["island_losses"].items()]
    return out


def _png_charts(view: Mapping[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    t0 = min((p["at"] for _, pts, _ in _series(view) for p in pts), default=0.0)
    for x, label, name in (
        ("at", "minutes since the first point", "loss_vs_time"),
        ("tokens", "tokens merged", "loss_vs_tokens"),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
        for series_label, pts, is_eval in _series(view):
            pts = sorted(pts, key=lambda p: p[x])
            xs = [(p["at"] - t0) / 60 if x == "at" else p["tokens"] for p in pts]
            ax.plot(
                xs,
                [p["loss"] for p in pts],
                marker="o" if is_eval else None,
                linewidth=2.2 if is_eval else 1.0,
                label=series_label,
                zorder=3 if is_eval else 2,
            )
        ax.set_xlabel(label)
        ax.set_ylabel("loss")
        ax.set_title(f"{view['experiment']}: loss against {'time' if x == 'at' else 'tokens'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _svg_chart(view: Mapping[str, Any], x: str, title: str) -> str:
    """A line chart as SVG text (no dependency)."""
    w, h, left, right, top, bottom = 800, 400, 60, 20, 30, 40
    series = _series(view)
    pts = [p for _, s, _ in series for p in s]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"><text x="20" y="40">no data</text></svg>'
    x0, x1 = min(p[x] for p in pts), max(p[x] for p in pts)
    y0, y1 = min(p["loss"] for p in pts), max(p["loss"] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def sx(v):
        return left + (v - x0) / (x1 - x0) * (w - left - right)

    def sy(v):
        return top + (1 - (v - y0) / (y1 - y0)) * (h - top - bottom)

    colors = ["#017cee", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#319795"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="18" font-size="14">{html.escape(title)}</text>',
    ]
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        parts.append(
            f'<line x1="{left}" x2="{w - right}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>'
        )
    for i, (label, s, is_eval) in enumerate(series):
        s = sorted(s, key=lambda p: p[x])
        line = " ".join(f"{sx(p[x]):.1f},{sy(p['loss']):.1f}" for p in s)
        parts.append(
            f'<polyline fill="none" stroke="{colors[i % len(colors)]}" stroke-width="{2.2 if is_eval else 1}" points="{line}"/>'
        )
        parts.append(
            f'<text x="{w - right - 150}" y="{top + 14 * (i + 1)}" fill="{colors[i % len(colors)]}">{html.escape(label)}</text>'
        )
    parts.append(
        f'<text x="{w - right}" y="{h - 8}" text-anchor="end">{"time" if x == "at" else "tokens merged"}</text></svg>'
    )
    return "".join(parts)


COLUMN_TITLES = {
    "tokens_per_s": "tokens/s",
    "bytes_up": "bytes up",
    "bytes_down": "bytes down",
    "at_iso": "at (UTC)",
    "versions": "fragment versions",
    "tokens_merged": "tokens merged",
    "latency_s": "latency",
}
"""A column's heading (else its name)."""


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(COLUMN_TITLES.get(c, c))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c), c))}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _pairs(pairs: Sequence[tuple[str, str]]) -> str:
    """A two-column table of (what, value) rows, headings on the left."""
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in pairs)
    return f'<table class="pairs">{rows}</table>'


def _bytes(v: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(v) < 1024 or unit == "GB":
            return f"{v:,.0f} {unit}" if unit == "B" else f"{v:,.1f} {unit}"
        v /= 1024
    return f"{v:,.1f} GB"  # pragma: no cover (the loop returns)


def _cell(value: Any, column: str = "") -> str:
    """A value as people read it: losses to 4 decimals, shares as percentages, rates and
    tokens as whole numbers, bytes in KB/MB, fragment versions as ``f0 v8, f1 v9``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        if column == "versions":
            return ", ".join(f"f{k} v{v}" for k, v in sorted(value.items(), key=_fragment_order))
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_cell(v) for v in value)
    if not isinstance(value, int | float):
        return str(value)
    if column == "goodput":
        return f"{value:.1%}"
    if column.startswith("bytes"):
        return _bytes(float(value))
    if column == "latency_s":
        return f"{value:.2f} s"
    if column == "loss":
        return f"{value:.4f}"
    if isinstance(value, int) or column in ("tokens_per_s", "tokens", "tokens_merged"):
        return f"{value:,.0f}"
    return f"{value:,.4g}"


def _fragment_order(item: tuple[Any, Any]) -> tuple[int, str]:
    key = str(item[0])
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def _baseline_rows(best: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> list:
    """The single-process baseline's row, and the best eval against it, when one is recorded."""
    if not baseline or not isinstance(baseline.get("loss"), int | float):
        return []
    rows = [
        (
            f"single process, {baseline.get('tokens', 0):,} tokens",
            _cell(float(baseline["loss"]), "loss"),
        )
    ]
    if isinstance(best.get("loss"), int | float) and baseline["loss"] > 0:
        rows.append(("best against single process", f"{best['loss'] / baseline['loss'] - 1:+.2%}"))
    return rows


def write_report(
    view: Mapping[str, Any], out: str | Path, baseline: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Write the charts and report.html into `out`; returns {"charts": [...], "html": path}.
    `baseline`: the newest ``baseline`` metric record of the experiment (a single process
    trained on the same tokens: {"loss", "tokens"}), shown against the best eval when given."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        charts = _png_charts(view, out)
        images = [(p.name, "image/png", p.read_bytes()) for p in charts]
    except ImportError:
        charts, images = [], []
        for x, name in (("at", "loss_vs_time"), ("tokens", "loss_vs_tokens")):
            svg = _svg_chart(view, x, f"{view['experiment']}: loss against {x}")
            path = out / f"{name}.svg"
            path.write_text(svg)
            charts.append(path)
            images.append((path.name, "image/svg+xml", svg.encode()))
    tokens = view["tokens"]
    best = view.get("best_eval") or {}
    summary = [
        ("store", view["store"]),
        (
            "snapshot (fragment versions)",
            _cell(view["snapshot"]["versions"] if view.get("snapshot") else None),
        ),
        ("tokens merged / budget", f"{tokens['merged']:,} / {tokens['budget']:,}"),
        ("best eval loss", _cell(best.get("loss"), "loss")),
        *_baseline_rows(best, baseline),
        ("merges", _cell(view["merge_count"])),
        ("quarantined", _cell(view["quarantine_count"])),
        ("goodput", _cell((view.get("goodput") or {}).get("goodput"), "goodput")),
        ("written", view["now_iso"]),
    ]
    imgs = "".join(
        f'<img alt="{html.escape(n)}" src="data:{mime};base64,{base64.b64encode(data).decode()}">'
        for n, mime, data in images
    )
    island_cols = [
        "island",
        "state",
        "backend",
        "step",
        "tokens",
        "tokens_per_s",
        "loss",
        "staleness",
        "goodput",
        "bytes_up",
        "bytes_down",
    ]
    merge_cols = ["at_iso", "versions", "applied", "quarantined", "tokens_merged", "latency_s"]
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>DiLoCo report: {html.escape(view["experiment"])}</title>
<style>body{{font:14px system-ui,sans-serif;margin:20px}}table{{border-collapse:collapse;margin:8px 0 20px}}
td,th{{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}}.pairs th{{font-weight:normal;color:#555}}img{{max-width:100%;margin:8px 0}}</style></head><body>
<h1>DiLoCo report: {html.escape(view["experiment"])}</h1>
{_pairs(summary)}
{imgs}
<h2>Islands</h2>{_table(view["islands"], island_cols)}
<h2>Merges (newest first)</h2>{_table(view["merges"], merge_cols)}
<h2>Quarantine</h2>{_table(view["quarantine"], ["id", "reason"])}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc)
    return dict(charts=[str(p) for p in charts], html=str(path))
