"""`make demo`: a real Airflow runs a Decoupled DiLoCo experiment with local islands.

Starts Airflow (scheduler, triggerer, dag-processor, api-server; LocalExecutor on SQLite) in
./airflow_home, triggers `diloco_experiment` through REST API v2 with the `tiny` preset and three
local islands on a local-directory store under ./runs/, kills one island once mid-run so that its
retry shows, follows progress, prints a summary and stops every process it started.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from diloco_airflow import hooks  # noqa: E402
from diloco_airflow.local_airflow import LocalAirflow, stop_islands  # noqa: E402

ISLANDS = ["island-a", "island-b", "island-c"]
KILL = "island-b"
TOKEN_BUDGET = int(os.environ.get("DILOCO_DEMO_TOKENS", "600000"))
TIMEOUT_S = float(os.environ.get("DILOCO_DEMO_TIMEOUT_S", "480"))


def demo_conf(name: str, store_url: str, budget: int = TOKEN_BUDGET) -> dict:
    return {
        "experiment_name": name,
        "store_url": store_url,
        "model_preset": "tiny",
        "islands": [{"name": n, "speed": 1.0, "backend": "local", "hardware": {}} for n in ISLANDS],
        "H": 30,
        "fragments": 1,
        "codec": "int8",
        "outer_method": "decoupled",
        "outer_lr": 0.5,
        "outer_momentum": 0.8,
        "quorum": 1,
        "token_budget": budget,
        "eval_every_versions": 4,
        "heartbeat_s": 2.0,
        "chaos": {},
        "overrides": {"inner.lr": 0.002},
    }


def airflow_env(runs: Path) -> dict[str, str]:
    return {
        "DILOCO_RUNS_ROOT": str(runs / "islands"),
        "DILOCO_RETRY_DELAY_S": "3",
        "DILOCO_MERGE_POLL_S": "2",
        "DILOCO_MERGE_IDLE_S": "30",
        # islands share two cores with Airflow: one compute thread each
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        "OMP_NUM_THREADS": "1",
    }


def kill_island(runs: Path, experiment: str, island: str) -> int | None:
    record = runs / "islands" / experiment / island / "process.json"
    try:
        pgid = int(json.loads(record.read_text())["pgid"])
    except (OSError, ValueError, KeyError):
        return None
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pgid


def retries(af: LocalAirflow, run_id: str) -> dict[str, int]:
    out = {}
    for ti in af.task_instances("diloco_experiment", run_id):
        if ti["task_id"].endswith(".wait") and ti["try_number"] > 1:
            out[ti.get("rendered_map_index") or str(ti["map_index"])] = ti["try_number"] - 1
    return out


def progress(estore, heartbeat_s: float) -> dict:
    snapshot = estore.current_snapshot()
    evals = estore.read_metrics("eval")
    beats, done = estore.heartbeats(), estore.done()
    now = time.time()
    alive = [i for i, b in beats.items() if now - float(b.get("time", 0)) < 5 * heartbeat_s]
    return {
        "version": list(snapshot.versions) if snapshot else None,
        "tokens_merged": snapshot.tokens_merged if snapshot else 0,
        "eval": evals[-1]["loss"] if evals else None,
        "alive": sorted(set(alive) - set(done)),
        "done": sorted(done),
    }


def summary(estore, af_retries: dict[str, int], elapsed: float) -> dict:
    evals = sorted(estore.read_metrics("eval"), key=lambda r: r["version"])
    chains = [estore.list_fragment_versions(p) for p in range(estore.num_fragments())]
    versions = [m for chain in chains for m in chain]
    snapshot = estore.current_snapshot()
    applied = [pg for m in versions for pg in m.get("applied", [])]
    beats, done = estore.heartbeats(), estore.done()
    sent = sum(int((done.get(i) or beats.get(i) or {}).get("bytes_sent", 0)) for i in ISLANDS)
    return {
        "initial_eval_loss": evals[0]["loss"] if evals else None,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "final_version": list(snapshot.versions) if snapshot else None,
        "merges": max(0, len(versions) - len(chains)),
        "tokens_merged": snapshot.tokens_merged if snapshot else 0,
        "pseudograds_applied": len(applied),
        "applied_twice": len(applied) - len(set(applied)),
        "retries": af_retries,
        "bytes_sent_by_islands": sent,
        "islands_done": sorted(done),
        "wall_s": round(elapsed, 1),
    }


def single_process_loss(estore, tokens: int) -> float:
    from training.config import parse_config
    from training.evaluate import single_process_baseline

    return round(single_process_baseline(parse_config(estore.read_config()), tokens), 4)


def main() -> int:
    started = time.time()
    runs = ROOT / "runs"
    runs.mkdir(exist_ok=True)
    name = time.strftime("demo-%Y%m%d-%H%M%S")
    store_url = f"file://{runs / 'store'}"
    af = LocalAirflow(env=airflow_env(runs))
    print(f"[demo] starting Airflow in {af.home} (logs in {af.home / 'logs'})", flush=True)
    af.start()
    try:
        af.wait_healthy()
        af.ensure_pools()
        af.wait_dag("diloco_experiment")
        af.wait_dag("diloco_merge")
        af.unpause("diloco_merge")
        print(
            f"[demo] Airflow up after {time.time() - started:.0f}s; UI {af.base} "
            f"(admin / {af.password()})",
            flush=True,
        )
        run_id = af.trigger("diloco_experiment", demo_conf(name, store_url))
        print(f"[demo] triggered diloco_experiment {run_id}: experiment {name}", flush=True)
        estore = hooks.open_experiment(store_url, name)
        killed = False
        last_line = ""
        deadline = time.monotonic() + TIMEOUT_S
        state = "running"
        while time.monotonic() < deadline:
            af.check_alive()
            state = af.dag_run("diloco_experiment", run_id)["state"]
            try:
                p = progress(estore, 2.0)
            except Exception:  # not initialized yet
                p = None
            if p:
                r = retries(af, run_id)
                line = (
                    f"version {p['version']}  tokens {p['tokens_merged']:,}/{TOKEN_BUDGET:,}  "
                    f"eval {p['eval'] if p['eval'] is None else round(p['eval'], 4)}  "
                    f"alive {','.join(p['alive']) or '-'}  done {','.join(p['done']) or '-'}  "
                    f"retries {r or '-'}  run {state}"
                )
                if line != last_line:
                    print(f"[{time.time() - started:5.0f}s] {line}", flush=True)
                    last_line = line
                if not killed and KILL in p["alive"] and p["tokens_merged"] >= TOKEN_BUDGET // 4:
                    pgid = kill_island(runs, name, KILL)
                    if pgid:
                        killed = True
                        print(f"[demo] SIGKILL {KILL} (process group {pgid})", flush=True)
            if state in ("success", "failed"):
                break
            time.sleep(3)
        s = summary(estore, retries(af, run_id), time.time() - started)
        s["dag_run_state"] = state
        s["experiment"] = name
        s["store"] = store_url
        af.stop()  # free the CPU for the single-process comparison
        stop_islands(runs / "islands")
        if s.get("tokens_merged"):
            print(
                f"[demo] single-process run of the same {s['tokens_merged']:,} tokens...",
                flush=True,
            )
            s["single_process_eval_loss"] = single_process_loss(estore, s["tokens_merged"])
        print("\n[demo] summary")
        for k, v in s.items():
            print(f"  {k:24s} {v}")
        (runs / f"{name}-summary.json").write_text(json.dumps(s, indent=1))
        ok = (
            state == "success"
            and s["final_eval_loss"] is not None
            and s["final_eval_loss"] < s["initial_eval_loss"]
        )
        print(f"[demo] {'OK' if ok else 'FAILED'}; artifacts under {runs}", flush=True)
        return 0 if ok else 1
    finally:
        af.stop()
        stop_islands(runs / "islands")
        print(f"[demo] stopped Airflow and islands after {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
