"""`make demo`: a real Airflow runs a Decoupled DiLoCo experiment with local islands.

Starts Airflow (scheduler, triggerer, dag-processor, api-server; LocalExecutor on SQLite) in
./airflow_home on port `DILOCO_AIRFLOW_PORT` (8080), triggers `diloco_experiment` through REST
API v2 exactly as the form does (nothing else unpaused: the syncer's two shards and the evaluator
are tasks of that run) with the form's defaults (the `tiny` preset, three local islands, H 20,
P 4 tensor fragments, K auto, S 2) on a local-directory store under ./runs/, kills one island
once mid-run so that its retry shows, prints every eval as it appears, then a summary (also
written to runs/<experiment>-summary.json: eval losses against a single-process run of the same
tokens, merges, publish-to-applied latency, tokens against the budget, bytes, anything applied
twice), and stops every process it started.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from diloco_airflow import knobs, store  # noqa: E402
from diloco_airflow.params import DEFAULT_ISLANDS, form_values  # noqa: E402

from devtools.local_airflow import (  # noqa: E402
    AirflowError,
    LocalAirflow,
    hold_signals,
    stop_islands,
    stop_on_signals,
)

ISLANDS = [i["name"] for i in DEFAULT_ISLANDS]  # the form's: island-0, island-1, island-2
KILL = ISLANDS[1]
TOKEN_BUDGET = knobs.DEMO_TOKENS.get()
TIMEOUT_S = knobs.DEMO_TIMEOUT_S.get()


# The paper's profile (issue 7 item 8): P = 24 fragments (balanced single tensors; `tiny` has
# 15 tensors, so P = 15, the most it allows), H = 24, tau = 2 overlap steps, quorum K = 1, int4
# pseudo-gradients, overwrite on adoption. `DILOCO_DEMO_PROFILE=paper make demo`.
PROFILES: dict[str, dict] = {
    "default": {},
    "paper": {
        "H": 24,
        "fragments": 15,
        "codec": "int4",
        "quorum": 1,
        "overrides": {
            "inner.tau": 2,
            "inner.keep_overlap": False,
            "fragments.strategy": "tensors",
        },
    },
}


def demo_conf(
    name: str, store_url: str, budget: int = TOKEN_BUDGET, profile: str = "default"
) -> dict:
    """The trigger form's values for the demo (the REST API gets exactly these)."""
    if profile not in PROFILES:
        raise SystemExit(f"unknown demo profile {profile!r}; choose one of {sorted(PROFILES)}")
    return {**_base_conf(name, store_url, budget), **PROFILES[profile]}


def _base_conf(name: str, store_url: str, budget: int) -> dict:
    """The trigger form's defaults (`diloco_airflow.params.form_values`: one source of truth),
    with the demo's name, store, budget and local islands."""
    conf = form_values()
    islands = [{**i, "backend": "local"} for i in conf["islands"]]
    return {
        **conf,
        "experiment_name": name,
        "store_url": store_url,
        "islands": islands,
        "token_budget": budget,
    }


def airflow_env(runs: Path) -> dict[str, str]:
    return {
        knobs.RUNS_ROOT.name: str(runs / "islands"),
        knobs.RETRY_DELAY_S.name: "3",
        # islands share two cores with Airflow: one compute thread each
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        "OMP_NUM_THREADS": "1",
    }


def kill_island(runs: Path, experiment: str, island: str, store_url: str) -> int | None:
    """SIGKILL a running demo island's process group (LocalBackend.kill_running)."""
    from diloco_airflow.backends.base import IslandSpec
    from diloco_airflow.backends.local import LocalBackend

    spec = IslandSpec(experiment=experiment, island=island, store_url=store_url, command=["-"])
    return LocalBackend(runs_root=runs / "islands").kill_running(spec)


def retries(af: LocalAirflow, run_id: str) -> dict[str, int]:
    out = {}
    for ti in af.task_instances("diloco_experiment", run_id):
        if ti["task_id"].endswith(".wait") and ti["try_number"] > 1:
            out[ti.get("rendered_map_index") or str(ti["map_index"])] = ti["try_number"] - 1
    return out


class MetricTail:
    """The records of one metrics kind, each read once: a listing, then only the new names."""

    def __init__(self, estore, kind: str):
        self.store = estore.store
        self.prefix = f"{estore.experiment}/metrics/{kind}/"
        self.seen: set[str] = set()
        self.records: list[dict] = []

    def poll(self) -> list[dict]:
        new = []
        for key in self.store.list(self.prefix):
            if key in self.seen or not key.endswith(".json"):
                continue
            self.seen.add(key)
            try:
                new.append(json.loads(self.store.read(key)))
            except (ValueError, OSError):
                continue
        self.records += new
        return new


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


def _real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def summarize(
    merges: list[dict],
    evals: list[dict],
    islands: dict[str, dict],
    budget: int,
    tokens_merged: int | None = None,
) -> dict:
    """The run's figures from its merge and eval records and the islands' done / heartbeat info.

    Latency: per applied contribution, the merge's time minus its manifest's `published_at`.
    `tokens_merged`: the model's (the current snapshot's); default the merge records' largest.
    """
    merges = sorted(merges, key=lambda m: m.get("at", 0.0))
    evals = sorted(evals, key=lambda r: (r.get("at", 0.0), r.get("version", 0)))
    contribs = [c for m in merges for c in m.get("contributions") or []]
    ids = [c.get("id") for c in contribs]
    latency = [
        m["at"] - c["published_at"]
        for m in merges
        for c in m.get("contributions") or []
        if _real(m.get("at")) and _real(c.get("published_at"))
    ]
    published = [c["published_at"] for c in contribs if _real(c.get("published_at"))]
    losses = [r["loss"] for r in evals if _real(r.get("loss"))]
    tokens = tokens_merged
    if tokens is None:
        tokens = max((int(m.get("tokens_merged") or 0) for m in merges), default=0)

    def total(*keys):  # per island the first of `keys` it reports; None if none does
        found = [next((i[k] for k in keys if _real(i.get(k))), None) for i in islands.values()]
        found = [v for v in found if v is not None]
        return int(sum(found)) if found else None

    def rounded(x):
        return None if x is None else round(x, 3)

    return {
        "initial_eval_loss": losses[0] if losses else None,
        "final_eval_loss": losses[-1] if losses else None,
        "best_eval_loss": min(losses) if losses else None,
        "evals": len(losses),
        "merges": len(merges),
        "contributions_applied": len(ids),
        "applied_twice": len(ids) - len(set(ids)),
        "merge_latency_p50_s": rounded(percentile(latency, 50)),
        "merge_latency_p95_s": rounded(percentile(latency, 95)),
        "merge_latency_max_s": rounded(max(latency, default=None)),
        "first_merge_after_first_publish_s": (
            rounded(merges[0]["at"] - min(published)) if merges and published else None
        ),
        "tokens_merged": tokens,
        "token_budget": budget,
        "tokens_trained": total("tokens"),
        "bytes_uploaded": total("bytes_uploaded", "bytes_sent"),
        "bytes_downloaded": total("bytes_downloaded", "bytes_received"),
    }


def islands_info(estore) -> dict[str, dict]:
    beats, done = estore.heartbeats(), estore.done()
    return {i: dict(done.get(i) or beats.get(i) or {}) for i in ISLANDS}


def single_process_loss(estore, tokens: int) -> float:
    from training.model.baseline import single_process_baseline

    return round(single_process_baseline(estore.config(), tokens), 4)


def main() -> int:
    """The demo; refuses to start (one line on stderr, exit 1) when the Airflow home or the
    port is in use, and stops everything it started on SIGINT and SIGTERM alike."""
    started = time.time()
    runs = ROOT / "runs"
    af = LocalAirflow(env=airflow_env(runs))
    ours = False  # whether this demo holds the home (started its Airflow)
    with stop_on_signals():
        try:
            print(f"[demo] starting Airflow in {af.home} (logs in {af.home / 'logs'})", flush=True)
            af.start()
            ours = True
            runs.mkdir(exist_ok=True)
            return _demo(af, runs, started)
        except KeyboardInterrupt:
            print("[demo] interrupted", file=sys.stderr, flush=True)
            return 130
        except AirflowError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
        finally:
            hold_signals()
            af.stop()
            if ours:  # this demo's Airflow: its islands (never another instance's)
                stop_islands(runs / "islands")
                print(f"[demo] stopped Airflow and islands after {time.time() - started:.0f}s")


def _demo(af: LocalAirflow, runs: Path, started: float) -> int:
    """Trigger the run, follow it, summarize it (Airflow is up; `main` stops it)."""
    name = time.strftime("demo-%Y%m%d-%H%M%S")
    store_url = f"file://{runs / 'store'}"
    af.wait_healthy()
    af.ensure_pools()
    af.wait_dag("diloco_experiment")
    print(
        f"[demo] Airflow up after {time.time() - started:.0f}s; UI {af.base} "
        f"(admin / {af.password()})",
        flush=True,
    )
    run_id = af.trigger(
        "diloco_experiment", demo_conf(name, store_url, profile=knobs.DEMO_PROFILE.get())
    )
    print(f"[demo] triggered diloco_experiment {run_id}: experiment {name}", flush=True)
    print(f"[demo] watch it: {af.base}/plugin/diloco (Browse -> DiLoCo)", flush=True)
    estore = store.open_experiment(store_url, name)
    merges, evals = MetricTail(estore, "merge"), MetricTail(estore, "eval")
    killed, last_line, last_print = False, "", 0.0
    deadline = time.monotonic() + TIMEOUT_S
    state = "running"
    while time.monotonic() < deadline:
        af.check_alive()
        state = af.dag_run("diloco_experiment", run_id)["state"]
        try:
            merges.poll()
            new_evals = evals.poll()
            info = islands_info(estore)
            snapshot = estore.current_snapshot()
        except Exception:  # not initialized yet
            new_evals, info, snapshot = [], {}, None
        t = time.time() - started
        for r in sorted(new_evals, key=lambda r: r.get("at", 0.0)):
            print(
                f"[{t:5.0f}s] eval loss {r['loss']:.4f} at {r.get('tokens_merged', 0):,} "
                f"tokens merged (version {r.get('version')})",
                flush=True,
            )
        tokens = snapshot.tokens_merged if snapshot else 0
        now = time.time()
        alive = [i for i, b in info.items() if now - float(b.get("time", 0)) < 10]
        done = sorted(estore.done()) if info else []
        line = (
            f"merges {len(merges.records)}  tokens {tokens:,}/{TOKEN_BUDGET:,}  "
            f"alive {','.join(sorted(set(alive) - set(done))) or '-'}  "
            f"done {','.join(done) or '-'}  run {state}"
        )
        if line != last_line and (now - last_print >= 10 or state != "running"):
            print(f"[{t:5.0f}s] {line}", flush=True)
            last_line, last_print = line, now
        if not killed and KILL in alive and tokens >= TOKEN_BUDGET // 4:
            pgid = kill_island(runs, name, KILL, store_url)
            if pgid:
                killed = True
                print(f"[{t:5.0f}s] SIGKILL {KILL} (process group {pgid})", flush=True)
        if state in ("success", "failed"):
            break
        time.sleep(2)
    merges.poll()
    evals.poll()
    snapshot = estore.current_snapshot()
    s = summarize(
        merges.records,
        evals.records,
        islands_info(estore),
        TOKEN_BUDGET,
        tokens_merged=snapshot.tokens_merged if snapshot else 0,
    )
    s.update(
        retries=retries(af, run_id),
        islands_done=sorted(estore.done()),
        wall_s=round(time.time() - started, 1),
        dag_run_state=state,
        experiment=name,
        store=store_url,
    )
    af.stop()  # free the CPU for the single-process comparison
    stop_islands(runs / "islands")
    tokens = s["tokens_trained"] or s["tokens_merged"]
    s["single_process_eval_loss"] = None
    if tokens:
        print(f"[demo] single-process run of the same {tokens:,} tokens...", flush=True)
        s["single_process_eval_loss"] = single_process_loss(estore, tokens)
        # recorded in the store: `diloco report` shows it against the best eval
        record = {"loss": s["single_process_eval_loss"], "tokens": tokens, "at": time.time()}
        estore.append_metric("baseline", {**record, "method": "single process"})
    final, single = s["final_eval_loss"], s["single_process_eval_loss"]
    if final is not None and single:
        s["final_vs_single_process"] = round(final / single - 1, 4)
    print("\n[demo] summary")
    for k, v in s.items():
        print(f"  {k:34s} {v}")
    out = runs / f"{name}-summary.json"
    out.write_text(json.dumps(s, indent=1))
    ok = state == "success" and final is not None and final < s["initial_eval_loss"]
    print(f"[demo] {'OK' if ok else 'FAILED'}; summary in {out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
