"""`diloco bench wan`: data-parallel, synchronous DiLoCo and Decoupled DiLoCo over emulated WAN links.

The same model (`tiny`), data and token budget, trained three ways by real processes in the
namespaces of `training/bench/wan/netns.py` (one region per namespace, the bucket and the merger in
the backbone; docs/WAN.md has the whole method):
- data-parallel: one process per region, `jax.distributed` over gloo, a bf16 gradient all-reduce
  across the links every step (training/bench/wan/dp.py);
- synchronous and Decoupled DiLoCo: one production island per region (training/bench/wan/island.py),
  `diloco merge --follow` in the backbone, the store gs:// on fake-gcs-server in the backbone.

Link rates. For each Gbps-equivalent g the links are shaped so that data-parallel's communication
over computation per step equals the 12B model's on g Gbps (training/bench/wan/model12b.py):
`rate(g) = DP wire bytes per step / (ratio_12b(g) x T_c)`, with the wire bytes per step and the
step time T_c measured here in the unshaped data-parallel run.

Each method runs once unshaped to the full token budget (its quality: held-out loss against
tokens in the model, hence the tokens to the target loss, and its wire bytes per token), then in
short shaped runs, one per g, that measure its training throughput over the links:
data-parallel steps (same processes, links reshaped between phases), and for the DiLoCo methods
the second publish cycle of each island (3 H steps run; from its publish at H to the one at 2 H,
with the adoption and the publish in it). Time to target at g = tokens to target / throughput at g.

That composition holds for the synchronous methods, whose quality per token does not depend on
the links. It does not for Decoupled DiLoCo with background transfers: its islands never wait for
a slow link, they adopt later instead, so its quality per token falls as the link slows while its
throughput does not. The methods in `BenchParams.direct` (Decoupled) therefore get a fresh run per
g on links shaped from the start, timed from the islands' first step to the first evaluation at
the target loss (`Runner.run_direct`); the table's rows say which way each time was measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from training.bench.wan import model12b
from training.bench.wan.bucket import start_bucket
from training.bench.wan.netns import Wan, WanError, unavailable
from training.bench.wan.params import BenchParams
from training.bench.wan.runner import Runner, experiment_config
from training.config.experiment import parse_sets

METHODS = ("dp", "sync", "decoupled")
LABELS = {"dp": "data-parallel", "sync": "synchronous DiLoCo", "decoupled": "Decoupled DiLoCo"}
# -- pure parts -------------------------------------------------------------------------------


def tokens_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """First token count at which the loss reaches `target`, linear between points; None if never."""
    for i, (tokens, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(tokens)
            t0, l0 = curve[i - 1]
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
    return None


def loss_at(curve: list[tuple[int, float]], tokens: float) -> float:
    """The loss at `tokens`, linear between points (clamped to the ends)."""
    if tokens <= curve[0][0]:
        return curve[0][1]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(t1 - t0, 1)
    return curve[-1][1]


def rows_from(m: dict, gbps: tuple[float, ...]) -> list[dict]:
    """The table: per method and g, time to target, speed-up over data-parallel, bytes, goodput.

    `m[method]` holds `tokens_to_target` (None: not reached within the budget),
    `bytes_per_token` (`up`, `down`: per region) and `throughput` {g: tokens/s};
    `m["dp"]["line_throughput"]` {g: tokens/s} is data-parallel at the links' nominal rate
    (its compute plus its wire bytes at the rate), `m["compute_tokens_s"]` pure compute.
    `m[method]["direct"]` {g: `Runner.run_direct`'s result}, where present, gives that g's time
    to target, throughput and bytes instead (`measured`: "direct", else "composed")."""
    rows = []
    for g in gbps:
        dp = m["dp"]
        dp_time = dp_line = None
        if dp["tokens_to_target"] is not None:
            dp_time = dp["tokens_to_target"] / dp["throughput"][g]
            dp_line = dp["tokens_to_target"] / dp["line_throughput"][g]
        for method in METHODS:
            r = m[method]
            tput = r["throughput"].get(g)
            tokens = r["tokens_to_target"]
            t = tokens / tput if tokens is not None and tput else None
            per = r["bytes_per_token"]
            up = per["up"] * tokens if tokens is not None else None
            down = per["down"] * tokens if tokens is not None else None
            direct = r.get("direct", {}).get(g)
            if direct is not None:  # measured on shaped links from the start
                t, tput = direct["time_to_target_s"], direct["tokens_per_s"]
                tokens = direct["tokens_trained"] if t is not None else None
                up = direct["wire"]["up"] if t is not None else None
                down = direct["wire"]["down"] if t is not None else None
            rows.append(
                dict(
                    method=method,
                    gbps=g,
                    time_to_target_s=t,
                    speedup_vs_dp=dp_time / t if dp_time and t else None,
                    speedup_vs_dp_line_rate=dp_line / t if dp_line and t else None,
                    throughput_vs_dp=tput / dp["throughput"][g] if tput else None,
                    bytes_up=up,
                    bytes_down=down,
                    goodput=min(1.0, tput / m["compute_tokens_s"]) if tput else None,
                    tokens_per_s=tput,
                    tokens_to_target=tokens,
                    measured="direct" if direct is not None else "composed",
                )
            )
    return rows


def format_table(summary: dict) -> str:
    def num(x, fmt, unit=""):
        return "not reached" if x is None else format(x, fmt) + unit

    lines = [
        "| method | Gbps-eq | link Mbit/s | tokens/s | goodput | time to target s "
        "| speed-up vs DP | vs DP at line rate | tokens/s vs DP | up / region | down / region "
        "| time measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        up = r["bytes_up"] and r["bytes_up"] / 2**20
        down = r["bytes_down"] and r["bytes_down"] / 2**20
        lines.append(
            f"| {LABELS[r['method']]} | {r['gbps']:g} | {summary['links'][str(r['gbps'])]:.2f} "
            f"| {r['tokens_per_s']:.0f} | {r['goodput']:.0%} "
            f"| {num(r['time_to_target_s'], '.1f')} | {num(r['speedup_vs_dp'], '.1f', 'x')} "
            f"| {num(r['speedup_vs_dp_line_rate'], '.1f', 'x')} "
            f"| {r['throughput_vs_dp']:.1f}x | {num(up, '.1f', ' MiB')} "
            f"| {num(down, '.1f', ' MiB')} | {r.get('measured', 'composed')} |"
        )
    extra = summary.get("params", {}).get("decoupled_set") or ()
    if extra:
        sets = ", ".join(f"{k} = {v}" for k, v in extra)
        lines.append(f"\nDecoupled DiLoCo's runs differ from the others in: {sets}")
    pad = summary.get("params", {}).get("step_pad_s") or 0.0
    if pad:
        lines.append(f"\nEvery process idles {pad * 1e3:g} ms after each step (--step-pad-ms).")
    return "\n".join(lines)


def format_direct(summary: dict) -> str:
    """The runs measured on shaped links from the start: held-out loss at the end and the
    syncer's latency from the merger's records (runner.merge_timeline)."""
    lines = [
        "| method | Gbps-eq | loss at the end | merge passes | contributions "
        "| publish to merge p50 / p95 s | staleness mean / max |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        for g, r in sorted(summary["measured"].get(m, {}).get("direct", {}).items()):
            s = r.get("syncer") or {}
            lag = f"{s['lag_p50_s']:.2f} / {s['lag_p95_s']:.2f}" if s else "-"
            st = f"{s['staleness_mean']:.1f} / {s['staleness_max']}" if s else "-"
            lines.append(
                f"| {LABELS[m]} | {float(g):g} | {r['final_loss']:.4f} | {s.get('passes', '-')} "
                f"| {s.get('contributions', '-')} | {lag} | {st} |"
            )
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    """Two panels per Gbps-eq: speed-up over data-parallel to the target loss (the 20x line;
    a method that did not reach it is marked) and goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    gbps = sorted({r["gbps"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    width = 0.8 / len(METHODS)
    for i, m in enumerate(METHODS):
        mine = {r["gbps"]: r for r in rows if r["method"] == m}
        xs = [k + (i - (len(METHODS) - 1) / 2) * width for k in range(len(gbps))]
        speed = [mine[g]["speedup_vs_dp"] or 0.0 for g in gbps]
        ax1.bar(xs, speed, width, color=f"C{i}", label=LABELS[m])
        for x, v in zip(xs, speed, strict=True):
            ax1.annotate("not reached" if not v else f"{v:.0f}x", (x, v), ha="center",
                         va="bottom", fontsize=7, rotation=90 if not v else 0)  # fmt: skip
        ax2.bar(xs, [100 * (mine[g]["goodput"] or 0.0) for g in gbps], width, color=f"C{i}")
    ax1.axhline(20, color="grey", ls=":", lw=1, label="target 20x")
    for ax, label in ((ax1, "speed-up over data-parallel to the target loss"), (ax2, "goodput %")):
        ax.set_xticks(range(len(gbps)), [f"{g:g} Gbps-eq" for g in gbps])
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=7)
    extra = summary.get("params", {}).get("decoupled_set") or ()
    if extra:
        fig.suptitle("Decoupled: " + ", ".join(f"{k}={v}" for k, v in extra), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_calibration(summary: dict) -> str:
    lines = [
        "| method | Gbps-eq | predicted tokens/s (in line) | measured tokens/s | measured / predicted |",
        "|---|---|---|---|---|",
    ]
    for c in summary["calibration"]:
        ratio = c["measured_over_predicted"]
        lines.append(
            f"| {LABELS[c['method']]} | {c['gbps']:g} | {c['predicted_tokens_s']:.0f} "
            f"| {c['measured_tokens_s']:.0f} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------


def run_name(method: str, g: float | None) -> str:
    return f"wan-{method}" if g is None else f"wan-{method}-{g:g}gbps".replace(".", "p")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run(p: BenchParams, workdir: str | None = None, log=print) -> dict:
    """The whole benchmark; returns the summary (rows, links, measurements, the 12B figure)."""
    reason = unavailable()
    if reason:
        raise WanError(f"diloco bench wan needs network namespaces: {reason}")
    started = time.time()
    # a SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so the WAN is torn down
    signal.signal(signal.SIGTERM, _interrupt)
    ratios = {g: model12b.comm_ratio(p.assume, g, regions=p.regions) for g in p.gbps}
    tmp = None if workdir else tempfile.mkdtemp(prefix="wan-bench-")
    root = Path(workdir or tmp)
    try:
        with Wan(regions=p.regions) as wan:
            bucket = start_bucket(wan, root)
            runner = Runner(wan, bucket, root, p, log)
            diloco = ("sync", "decoupled")
            budget = p.regions * p.steps * p.batch_size * 64
            # the merger's own budget is far away: the bench ends each run itself
            configs = {m: experiment_config(p, m, run_name(m, None), budget_factor=100)
                       for m in diloco}  # fmt: skip
            shaped = {(m, g): experiment_config(p, m, run_name(m, g), budget_factor=100)
                      for m in p.direct for g in p.gbps}  # fmt: skip
            runner.init_experiments([*configs.values(), *shaped.values()])
            log(f"[dp] {LABELS['dp']}")
            dp = runner.run_dp(ratios)
            target = p.target
            if target is None:
                target = loss_at(dp["curve"], p.target_fraction * budget)
            measured = {"dp": dp}
            for m in diloco:
                log(f"[{m}] {LABELS[m]}: unshaped to {budget} tokens, then at each Gbps-eq")
                measured[m] = runner.run_diloco(configs[m], budget, dp["rates_mbit"])
            for (m, g), cfg in shaped.items():
                log(f"[{m}] {LABELS[m]} at {g:g} Gbps-eq from the start, to loss {target:.4f}")
                r = runner.run_direct(cfg, dp["rates_mbit"][g], target, budget)
                measured[m].setdefault("direct", {})[g] = r
                ttt = r["time_to_target_s"]
                log(f"  {'not reached' if ttt is None else f'{ttt:.1f} s'} to the target")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    for m in METHODS:
        tokens = tokens_to(measured[m]["curve"], target)
        measured[m]["tokens_to_target"] = (
            tokens if tokens is not None and tokens <= budget else None
        )
        measured[m]["loss_at_budget"] = loss_at(measured[m]["curve"], budget)
    measured["compute_tokens_s"] = p.regions * p.batch_size * 64 / dp["step_s"]
    summary = dict(
        params={k: v for k, v in asdict(p).items() if k != "assume"},
        assumptions_12b=asdict(p.assume),
        comm_ratio={str(g): r for g, r in ratios.items()},
        links={str(g): dp["rates_mbit"][g] for g in p.gbps},
        step_s=dp["step_s"],
        target_loss=target,
        measured=_jsonable(measured),
        rows=rows_from(measured, p.gbps),
        calibration=calibration(measured, p),
        wall_s=time.time() - started,
    )
    return summary


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def calibration(measured: dict, p: BenchParams) -> list[dict]:
    """Measured throughput against the in-line transfer model (model12b's `overlap=False`):
    a step (DP) or a publish cycle of H steps (DiLoCo) takes its compute time plus its wire bytes
    at the link rate, up and down one after the other."""
    dp = measured["dp"]
    t_c = dp["step_s"]
    out = []
    for g in p.gbps:
        rate = dp["rates_mbit"][g] * 1e6 / 8
        for m in METHODS:
            r = measured[m]
            per = r["bytes_per_token"]
            if m == "dp":
                tokens = dp["tokens_per_step"]
                seconds = t_c + (per["up"] + per["down"]) / 2 * tokens / rate
            else:
                tokens = p.regions * p.H * p.batch_size * 64
                seconds = p.H * t_c + (per["up"] + per["down"]) * tokens / rate
            predicted = tokens / seconds
            got = r["throughput"].get(g)
            out.append(
                dict(
                    method=m,
                    gbps=g,
                    predicted_tokens_s=predicted,
                    measured_tokens_s=got,
                    measured_over_predicted=got / predicted if got else None,
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench wan", description=__doc__.split("\n")[0])
    ap.add_argument("--model-12b", action="store_true", help="only the computed 12B figure")
    ap.add_argument("--merge-json", default=None, help="`diloco bench merge --json` output (12B)")
    ap.add_argument("--steps", type=int, default=BenchParams.steps, help="steps per region")
    ap.add_argument("--gbps", default=",".join(f"{g:g}" for g in BenchParams.gbps))
    ap.add_argument(
        "--target", type=float, default=None, help="target loss (default: DP's at half)"
    )
    ap.add_argument("--checkpoints", choices=("regional", "bucket"), default="regional")
    ap.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir)")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--plot", default=None, help="PNG: speed-up and goodput per Gbps-eq")
    ap.add_argument(
        "--decoupled-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for Decoupled DiLoCo's runs only (e.g. fragments.count=4)",
    )
    ap.add_argument(
        "--step-pad-ms",
        type=float,
        default=0.0,
        help="idle ms after every step of every process (a slower chip; the links slow with it)",
    )
    args, rest = ap.parse_known_args(argv)
    if args.model_12b:
        forward = ["--merge-json", args.merge_json] if args.merge_json else []
        forward += ["--json", args.json_out] if args.json_out else []
        return model12b.main(rest + forward)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        gbps = tuple(float(g) for g in args.gbps.split(",") if g.strip())
    except ValueError:
        ap.error(f"--gbps expects numbers, got {args.gbps!r}")
    p = BenchParams(
        steps=args.steps,
        gbps=gbps,
        target=args.target,
        regional_checkpoints=args.checkpoints == "regional",
        decoupled_set=tuple(parse_sets(args.decoupled_set).items()),
        step_pad_s=args.step_pad_ms / 1e3,
    )
    summary = run(p, args.workdir)
    a = model12b.measured_assumptions(args.merge_json)
    summary["model_12b"] = model12b.report(a)
    print()
    print(format_table(summary))
    print(f"\ntarget loss {summary['target_loss']:.4f}; wall time {summary['wall_s']:.0f} s")
    print()
    print(format_direct(summary))
    print()
    print(format_calibration(summary))
    print()
    print(model12b.format_report(summary["model_12b"]))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(summary, args.plot)
    return 0
