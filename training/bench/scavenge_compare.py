"""`diloco bench scavenge --compare A.json,... --against B.json,...`: two settings of the
scavenging benchmark (training/bench/scavenge.py) over seeds, paired by seed, each burst's
wall-clock against the setting's own base run and against a common target (`compare`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.bench import stats
from training.bench.scavenge_report import ratio_text, write_json
from training.model.baseline import Curve


def compare(baseline: list[dict], candidate: list[dict]) -> dict:
    """Two settings' runs of the bench (`scavenge.run`'s outputs, one per seed, with curves),
    paired by seed: per burst, (a) the row itself, wall-clock to the target against the setting's own
    base run, and (b) wall-clock to a common target against the baseline's base run. (a) is
    what the burst gains a setting; a setting whose base run is better gets a lower target of
    its own, so (a) alone cannot say which setting reaches a given loss sooner. (b) can: the
    common target of a seed is the higher (easier) of the two base runs' final losses, which
    both settings' curves reach; the row "+0%" is the candidate's base run itself.
    Differences are candidate - baseline, with a 95% t-interval over the seeds (`stats`)."""
    by_seed = {r["assumptions"]["seed"]: r for r in baseline}
    pairs = [(by_seed[c["assumptions"]["seed"]], c) for c in candidate
             if c["assumptions"]["seed"] in by_seed]  # fmt: skip
    if not pairs:
        raise ValueError("no seed of the candidate's runs is among the baseline's")
    for b, c in pairs:
        if "curve" not in b["base"] or "curve" not in c["base"]:
            raise ValueError(f"seed {b['assumptions']['seed']}: a run without curves (older JSON)")
        if {**b["assumptions"], "seed": 0} != {**c["assumptions"], "seed": 0}:
            raise ValueError(f"seed {b['assumptions']['seed']}: the runs' assumptions differ")
    seeds = [b["assumptions"]["seed"] for b, _ in pairs]
    bursts = sorted({r["burst"] for b, _ in pairs for r in b["rows"] if r["method"] == "decoupled"})
    own: dict[float, tuple[list, list]] = {x: ([], []) for x in bursts}
    common: dict[float, tuple[list, list]] = {x: ([], []) for x in [0.0, *bursts]}
    for b, c in pairs:
        target = max(b["base"]["target_loss"], c["base"]["target_loss"])
        t_base = Curve(**b["base"]["curve"]).time_to(target)
        common[0.0][0].append(1.0)
        common[0.0][1].append(_rel(c["base"]["curve"], target, t_base))
        rows_b, rows_c = _decoupled_rows(b), _decoupled_rows(c)
        for x in bursts:
            own[x][0].append(rows_b[x]["time_to_target_rel"])
            own[x][1].append(rows_c[x]["time_to_target_rel"])
            common[x][0].append(_rel(rows_b[x]["curve"], target, t_base))
            common[x][1].append(_rel(rows_c[x]["curve"], target, t_base))

    def summarise(kind: str, table: dict) -> list[dict]:
        out = []
        for x, (bs, cs) in table.items():
            both = [(u, v) for u, v in zip(bs, cs, strict=True) if u is not None and v is not None]
            diff = stats.paired_interval([v for _, v in both], [u for u, _ in both])
            out.append(dict(kind=kind, burst=x, baseline=bs, candidate=cs,
                            baseline_mean=_mean(bs), candidate_mean=_mean(cs),
                            diff=diff.to_dict()))  # fmt: skip
        return out

    return dict(
        seeds=seeds,
        baseline_sets=pairs[0][0]["sets"],
        candidate_sets=pairs[0][1]["sets"],
        rows=summarise("own base", own) + summarise("common target", common),
    )


def _decoupled_rows(out: dict) -> dict[float, dict]:
    rows = {r["burst"]: r for r in out["rows"] if r["method"] == "decoupled"}
    if any("curve" not in r for r in rows.values()):
        raise ValueError(f"seed {out['assumptions']['seed']}: a row without a curve (older JSON)")
    return rows


def _rel(curve: dict, target: float, t_base: float) -> float | None:
    t = Curve(**curve).time_to(target)
    return None if t is None else t / t_base


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return stats.mean_std(xs)[0] if xs else None


def format_compare(out: dict) -> str:
    """Markdown: per kind and burst, each seed's ratio for both settings, the means and the
    paired difference (candidate - baseline; negative: the candidate is sooner)."""
    lines = [
        f"baseline {out['baseline_sets'] or 'the defaults'} against candidate "
        f"{out['candidate_sets'] or 'the defaults'}, seeds {out['seeds']}",
        "",
        "| wall-clock to | burst | baseline per seed | candidate per seed | baseline mean | "
        "candidate mean | candidate - baseline [95% CI] |",
        "|---|---:|---|---|---:|---:|---|",
    ]
    for r in out["rows"]:
        d = r["diff"]
        ci = "" if d["lo"] is None else f" [{d['lo']:+.3f}, {d['hi']:+.3f}]"
        what = (
            "own target / own base"
            if r["kind"] == "own base"
            else "common target / baseline's base"
        )
        lines.append(
            f"| {what} | +{r['burst']:.0%} | {' / '.join(ratio_text(v) for v in r['baseline'])} | "
            f"{' / '.join(ratio_text(v) for v in r['candidate'])} | {ratio_text(r['baseline_mean'])} | "
            f"{ratio_text(r['candidate_mean'])} | {d['mean']:+.3f}{ci} |"
        )
    return "\n".join(lines)


def main_compare(p: argparse.ArgumentParser, args) -> int:
    if not (args.compare and args.against):
        p.error("--compare and --against go together")
    runs = []
    for arg in (args.compare, args.against):
        outs = []
        for name in arg.split(","):
            try:
                outs.append(json.loads(Path(name).read_text()))
            except (OSError, ValueError) as e:
                p.error(f"{name}: {e}")
        runs.append(outs)
    try:
        out = compare(*runs)
    except (KeyError, ValueError) as e:
        p.error(str(e))
    print(format_compare(out))
    if args.json:
        write_json(args.json, out)
    return 0
