"""The processes of one `diloco bench wan` run (see training/bench/wan/bench.py for the method).

`Runner(wan, bucket, workdir, params)` starts and watches the training processes in the
namespaces; every run writes its logs under `workdir/<run>/`. Each call returns plain
measurements (dicts of numbers); the table is made from them by `bench.rows_from`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from training.bench.wan.netns import Wan, WanError
from training.bench.wan.params import DILOCO_SETTINGS, DP_SETTINGS, BenchParams, link_mbit
from training.config.experiment import ExperimentConfig, IslandConfig, with_overrides

PY = sys.executable


def experiment_config(p: BenchParams, method: str, name: str, budget_factor: int = 1):
    """The config of every run: `tiny`, the same data, batch, seed and token budget."""
    islands = tuple(IslandConfig(name=f"island-{i}") for i in range(p.regions))
    cfg = ExperimentConfig(
        name=name,
        islands=islands,
        token_budget=p.regions * p.steps * p.batch_size * 64 * budget_factor,
    )
    overrides = {
        "model.preset": "tiny",
        "data.batch_size": p.batch_size,
        "data.seq_len": 64,
        "inner.H": p.H,
        # the baselines on P fragments (the paper's synchronous DiLoCo: one); Decoupled DiLoCo
        # on the config's defaults (the point of a run without --decoupled-set)
        **({} if method == "decoupled" else {"fragments.count": p.fragments}),
        "codec": p.codec,
        "heartbeat_s": 1.0,
        "outer.method": "sync" if method in ("dp", "sync") else "decoupled",
        "inner.dylu": method == "decoupled",
        **(DP_SETTINGS if method == "dp" else DILOCO_SETTINGS),
        **(dict(p.decoupled_set) if method == "decoupled" else {}),
    }
    return with_overrides(cfg, overrides)


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sub(a: list[dict], b: list[dict]) -> dict:
    """Mean per region of counter differences b - a."""
    n = len(a)
    return {k: sum(y[k] - x[k] for x, y in zip(a, b, strict=True)) / n for k in ("up", "down")}


class Runner:
    def __init__(self, wan: Wan, bucket, workdir: Path, params: BenchParams, log=print):
        self.wan, self.bucket, self.workdir, self.p, self.log = wan, bucket, workdir, params, log
        self.env = {
            **bucket.env,
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "JAX_PLATFORMS": "cpu",
            # one compute thread per process: each region's process has one core of its own
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        }
        self._port = 7100

    def _dir(self, name: str) -> Path:
        d = self.workdir / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _wait(self, procs, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        for proc in procs:
            left = deadline - time.monotonic()
            try:
                rc = proc.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                raise WanError(f"{what}: still running after {timeout:.0f} s") from None
            if rc != 0:
                raise WanError(f"{what}: a process exited {rc} (logs in {self.workdir})")

    def _until(self, cond, procs, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if any(p.poll() not in (None, 0) for p in procs):
                raise WanError(f"{what}: a process failed (logs in {self.workdir})")
            if time.monotonic() > deadline:
                raise WanError(f"{what}: timed out after {timeout:.0f} s")
            time.sleep(0.05)

    # -- experiments in the bucket ---------------------------------------------------------

    def init_experiments(self, configs: list[ExperimentConfig]) -> None:
        """`diloco init` for every run's experiment, in one process in the backbone."""
        d = self._dir("init")
        calls = []
        for cfg in configs:
            path = d / f"{cfg.name}.json"
            path.write_text(cfg.to_json())
            calls.append(
                ["init", "--store", self.bucket.url, "--name", cfg.name, "--config", str(path)]
            )
        code = (
            "import sys, json; from training.cli import main\n"
            "sys.exit(max(main(a) for a in json.loads(sys.argv[1])))"
        )
        self.wan.run(self.wan.backbone, [PY, "-c", code, json.dumps(calls)], env=self.env)

    # -- data-parallel -----------------------------------------------------------------------

    def run_dp(self, ratios: dict[float, float]) -> dict:
        """Budget phase unshaped, then `dp_probe_steps` steps at each g's link rate."""
        p = self.p
        d = self._dir("dp")
        cfg = experiment_config(p, "dp", "wan-dp")
        (d / "cfg.json").write_text(cfg.to_json())
        self._port += 1
        start = self.wan.counters()
        procs = []
        for i in range(p.regions):
            argv = [PY, "-m", "training.bench.wan.dp", "--config", str(d / "cfg.json")]
            argv += ["--process-id", str(i), "--num-processes", str(p.regions)]
            argv += ["--coordinator", f"{self.wan.region_addr(0)}:{self._port}"]
            argv += ["--address", self.wan.region_addr(i), "--out", str(d)]
            argv += ["--save-every", str(max(1, p.steps // 20))]
            argv += ["--probe-steps", str(p.dp_probe_steps), "--probe-phases", str(len(ratios))]
            argv += ["--step-pad-s", repr(p.step_pad_s)]
            with open(d / f"region-{i}.log", "wb") as logf:
                proc = self.wan.popen(self.wan.region(i), argv, self.env, stdout=logf, stderr=logf)
            procs.append(proc)
        gs = list(ratios)
        rates = {}
        main_bytes = step_s = None
        for j, g in enumerate(gs):
            self._until((d / f"ready-{j}").exists, procs, p.run_timeout_s, "data-parallel")
            if j == 0:
                main_bytes = _sub(start, self.wan.counters())
                main = json.loads((d / "main.json").read_text())
                durations = [b - a for a, b in zip(main["times"], main["times"][1:], strict=False)]
                step_s = statistics.median(durations[1:])  # the first step compiles
                per_step = {k: v / main["steps"] for k, v in main_bytes.items()}
                rates = {x: link_mbit(per_step["up"], step_s, ratios[x]) for x in gs}
                self.log(
                    f"  data-parallel: {step_s * 1e3:.0f} ms per step unshaped, "
                    f"{per_step['up'] / 1e3:.0f} kB up per step and region; links "
                    + ", ".join(f"{x:g} Gbps-eq = {rates[x]:.2f} Mbit/s" for x in gs)
                )
            self.wan.shape(rates[g])
            (d / f"go-{j}").touch()
        self._wait(procs, p.run_timeout_s, "data-parallel")
        self.wan.shape(None)
        rec = json.loads((d / "steps.json").read_text())
        throughput = {}
        for g, times in zip(gs, rec["probes"], strict=True):
            durations = [b - a for a, b in zip(times, times[1:], strict=False)]
            throughput[g] = rec["tokens_per_step"] / statistics.median(durations)
            self.log(f"  data-parallel at {g:g} Gbps-eq: {statistics.median(durations):.2f} s/step")
        line = {
            g: rec["tokens_per_step"] / (step_s + (per_step["up"] + per_step["down"]) / 2
                                         / (rates[g] * 1e6 / 8))
            for g in gs
        }  # fmt: skip
        return dict(
            line_throughput=line,
            step_s=step_s,
            tokens_per_step=rec["tokens_per_step"],
            steps=rec["steps"],
            bytes_per_step=per_step,
            rates_mbit=rates,
            throughput=throughput,
            bytes_per_token={k: v / rec["tokens_per_step"] for k, v in per_step.items()},
            curve=self._dp_curve(cfg, d, rec["tokens_per_step"]),
        )

    def _dp_curve(self, cfg, d: Path, tokens_per_step: int) -> list[tuple[int, float]]:
        import numpy as np

        from training.model import definition as model
        from training.model.evaluate import eval_loss

        first = {k: np.asarray(v) for k, v in model.init_params(cfg.model, cfg.seed).items()}
        curve = [(0, eval_loss(cfg, first))]
        for path in sorted(d.glob("params-*.npz")):
            with np.load(path, allow_pickle=False) as z:
                params = {k: z[k] for k in z.files}
            curve.append((int(path.stem.split("-")[1]) * tokens_per_step, eval_loss(cfg, params)))
        return curve

    # -- DiLoCo ------------------------------------------------------------------------------

    def run_diloco(self, cfg: ExperimentConfig, quality_tokens: int, rates: dict) -> dict:
        """One continuous run of islands + merger: unshaped until `quality_tokens` are merged
        (its evaluated curve and wire bytes per token), then one phase per g at its link rate
        (throughput over `cycles_per_phase` publish cycles of every island)."""
        p, wan, name = self.p, self.wan, cfg.name
        d = self._dir(name)
        start = wan.counters()
        procs, logs = self._start(cfg, d, quality_tokens)
        evaluator = procs[1]
        throughput, phases = {}, []
        try:
            self._wait([evaluator], p.run_timeout_s, f"{name} evaluator")
            t_quality = time.time()
            wire = _sub(start, wan.counters())
            trained = sum(_tokens_at(_lines(x), t_quality) for x in logs)
            for g, mbit in rates.items():
                wan.shape(mbit)
                t0, before = time.time(), wan.counters()
                need = 1 + p.cycles_per_phase * cfg.fragments.count  # an anchor, then full cycles

                def enough(t0=t0, need=need):
                    return all(_publishes_after(_lines(x), t0) >= need for x in logs)

                self._until(enough, procs[2:], p.run_timeout_s, f"{name} at {g:g} Gbps-eq")
                per_island = [_phase_throughput(_lines(x), t0, need) for x in logs]
                throughput[g] = sum(per_island)
                t1 = time.time()
                tokens = sum(_tokens_at(_lines(x), t1) - _tokens_at(_lines(x), t0) for x in logs)
                phases.append(
                    dict(
                        gbps=g,
                        mbit=mbit,
                        seconds=t1 - t0,
                        tokens=tokens,
                        wire=_sub(before, wan.counters()),
                    )
                )
                self.log(f"  {name} at {g:g} Gbps-eq: {throughput[g]:.0f} tokens/s")
        finally:
            wan.shape(None)
            _kill(procs)
        curve = sorted({(r["tokens_merged"], r["loss"]) for r in _lines(d / "curve.jsonl")})
        return dict(
            curve=curve,
            wire=wire,
            tokens_trained=trained,
            bytes_per_token={k: v / max(trained, 1) for k, v in wire.items()},
            throughput=throughput,
            phases=phases,
        )

    def _start(self, cfg: ExperimentConfig, d: Path, until_tokens: int, until_loss=None):
        """The merger and the evaluator in the backbone, one island per region: (processes
        [merger, evaluator, *islands], the islands' step-log paths)."""
        p, wan, name = self.p, self.wan, cfg.name
        store = self.bucket.url  # experiment `name` under the bucket's root
        bb = wan.backbone
        argv = [PY, "-m", "training.cli", "merge", "--store", store, "--experiment", name]
        argv += ["--follow", "--poll", "0.2"]
        with open(d / "merge.log", "wb") as logf:
            merger = wan.popen(bb, argv, self.env, stdout=logf, stderr=logf)
        argv = [PY, "-m", "training.bench.wan.evaluator", "--store", store, "--experiment", name]
        argv += ["--out", str(d / "curve.jsonl"), "--until-tokens", str(until_tokens)]
        argv += ["--merges-out", str(d / "merges.json")]
        if until_loss is not None:
            argv += ["--until-loss", repr(float(until_loss))]
        with open(d / "eval.log", "wb") as logf:
            evaluator = wan.popen(bb, argv, self.env, stdout=logf, stderr=logf)
        islands = []
        logs = [d / f"{isl.name}.jsonl" for isl in cfg.islands]
        for i, isl in enumerate(cfg.islands):
            argv = [PY, "-m", "training.bench.wan.island", "--store", store, "--experiment", name]
            argv += ["--island", isl.name, "--step-log", str(logs[i])]
            argv += ["--step-pad-s", repr(p.step_pad_s)]
            if p.regional_checkpoints:
                argv += ["--checkpoints", f"file://{d / f'region-{i}'}"]
            with open(d / f"{isl.name}.log", "wb") as logf:
                islands.append(wan.popen(wan.region(i), argv, self.env, stdout=logf, stderr=logf))
        return [merger, evaluator, *islands], logs

    def run_direct(self, cfg: ExperimentConfig, mbit: float, target: float, budget: int) -> dict:
        """A fresh run on links shaped to `mbit` from the start, until the held-out loss reaches
        `target` or `budget` tokens are merged: the time to target measured, not composed.

        For an asynchronous method the quality per token depends on the links (slow downloads
        mean stale adoptions), so `tokens to target / throughput` from an unshaped run does not
        hold; this is what it measures instead. The clock starts at the islands' first logged
        step (after their start-up and compile, as data-parallel's step time leaves them out)
        and stops at the evaluation that first reaches the target (the evaluator's cadence and
        its own time count against the method)."""
        d = self._dir(cfg.name)
        self.wan.shape(mbit)
        before = self.wan.counters()
        procs, logs = self._start(cfg, d, budget, target)
        try:
            self._wait([procs[1]], self.p.run_timeout_s, f"{cfg.name} evaluator")
            wire = _sub(before, self.wan.counters())
        finally:
            self.wan.shape(None)
            _kill(procs)
        curve = _lines(d / "curve.jsonl")
        steps = [r for x in logs for r in _lines(x) if "tokens" in r]
        t0 = min(r["t"] for r in steps)
        hit = next((r for r in curve if r["loss"] <= target), None)
        t1 = hit["t"] if hit else max(r["t"] for r in curve)
        trained = sum(_tokens_at(_lines(x), t1) for x in logs)
        return dict(
            time_to_target_s=t1 - t0 if hit else None,
            final_loss=curve[-1]["loss"],
            tokens_trained=trained,
            tokens_per_s=trained / max(t1 - t0, 1e-9),
            wire=wire,
            curve=[(r["tokens_merged"], r["loss"]) for r in curve],
            syncer=merge_timeline(d / "merges.json"),
        )


def merge_timeline(path: Path) -> dict | None:
    """The syncer's latency in one run from the merger's records (evaluator `--merges-out`):
    merge passes, contributions applied, seconds from publish (stamped by the island before its
    upload) to merge (p50 / p95 / max), and staleness (mean / max). None without records."""
    if not path.exists():
        return None
    records = json.loads(path.read_text())
    contribs = [c for m in records for c in m.get("contributions", [])]
    if not contribs:
        return None
    lags = sorted(c["merged_at"] - c["published_at"] for c in contribs)
    stale = [c["staleness"] for c in contribs]

    def q(x: float) -> float:
        return lags[min(len(lags) - 1, int(x * len(lags)))]

    return dict(
        passes=len(records),
        contributions=len(contribs),
        lag_p50_s=q(0.5),
        lag_p95_s=q(0.95),
        lag_max_s=lags[-1],
        staleness_mean=sum(stale) / len(stale),
        staleness_max=max(stale),
    )


def _kill(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _tokens_at(step_log: list[dict], t: float) -> int:
    return max((r["tokens"] for r in step_log if "tokens" in r and r["t"] <= t), default=0)


def _publishes_after(step_log: list[dict], t: float) -> int:
    return sum(1 for r in step_log if r.get("published") and r["t"] > t)


def _phase_throughput(step_log: list[dict], t: float, need: int) -> float:
    """Tokens per second from the first publish after `t` to the `need`-th."""
    pubs = [r for r in step_log if r.get("published") and r["t"] > t][:need]
    return (pubs[-1]["tokens"] - pubs[0]["tokens"]) / (pubs[-1]["t"] - pubs[0]["t"])
