"""End to end: a real Airflow runs `diloco_experiment` on fake-gcs-server.

`test_a_run_triggered_like_the_form_merges_from_its_first_publish`: a fresh Airflow home, one
trigger through REST API v2 exactly as the form does (unpause this DAG, POST the run), no other
DAG unpaused; the syncer's two shards and the evaluator run inside that run. Checked from the
store's merge and eval records: the first merge within seconds of the first publish, the tokens
merged within one publish interval per island of the budget, nothing applied twice, the final
eval no worse than the best one.

`test_experiment_on_gcs_survives_a_killed_island`: one island is killed.

Starts scheduler, triggerer, dag-processor and api-server (LocalExecutor on SQLite, a tmp
AIRFLOW_HOME) through `devtools.local_airflow`, triggers `diloco_experiment` through REST
API v2 with three local islands on a gs:// store, SIGKILLs one island's process group mid-run,
waits for the run to finish, then checks the bucket with google-cloud-storage alone (no project
code): every version's manifest names what it merged, nothing is merged twice, the killed
island's wait task retried and its pseudo-gradients committed after the kill were merged, and
the eval loss went down.

    .venv/bin/python -m pytest -m slow tests/test_e2e_airflow.py
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from devtools.demo import ISLANDS, KILL, demo_conf, summarize
from tests.airflow_fixture import running_airflow
from tests.gcs_fixture import BUCKET, gcs_bucket  # noqa: F401
from tests.helpers import tokens_discarded

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(540)]

DAG = "diloco_experiment"
ISLAND_TOKENS = 300_000
RUN_TIMEOUT_S = 330.0


@pytest.fixture
def airflow(tmp_path, gcs_bucket):  # noqa: F811 - the fixture
    """A running Airflow (all four components) with its islands' runs root; stopped afterwards.

    Garbage collection (the syncer's during the run and finalize's at the end) only plans
    (DILOCO_GC_DRY_RUN=1): it would delete applied pseudo-gradients, the evidence these tests'
    exactly-once check reads (every applied id has its commit marker);
    tests/test_retention_live.py covers collection while a run merges."""
    with running_airflow(tmp_path, DILOCO_GC_DRY_RUN="1") as af:
        yield af


def _conf(name: str, store_url: str) -> dict:
    conf = demo_conf(name, store_url, budget=10 * ISLAND_TOKENS * len(ISLANDS))
    # each island trains its own token count (the shared budget is never reached), so the killed
    # island must come back and finish its share after its relaunch
    for island in conf["islands"]:
        island["max_tokens"] = ISLAND_TOKENS
    return conf


class Bucket:
    """Read-only view of one experiment in the bucket, through google-cloud-storage only."""

    def __init__(self, prefix: str):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.client = storage.Client(project="test", credentials=AnonymousCredentials())
        self.bucket = self.client.bucket(BUCKET)
        self.root = prefix.rstrip("/") + "/"

    def names(self, sub: str) -> list[str]:
        blobs = self.client.list_blobs(BUCKET, prefix=self.root + sub)
        return sorted(b.name[len(self.root) :] for b in blobs)

    def json(self, relative: str) -> dict | None:
        blob = self.bucket.blob(self.root + relative)
        try:
            return json.loads(blob.download_as_bytes())
        except Exception as exc:  # NotFound
            if type(exc).__name__ == "NotFound":
                return None
            raise

    def chains(self) -> dict[int, list[dict]]:
        """Per fragment, the manifests of its HEAD and parent chain (store layout 2), oldest
        first."""
        out: dict[int, list[dict]] = {}
        for name in self.names("fragments/"):
            if not name.endswith("/HEAD.json"):
                continue
            head = self.json(name)
            chain, directory = [], head and head["dir"]
            while directory:
                manifest = self.json(f"{directory}/manifest.json")
                assert manifest is not None, f"{directory} is on HEAD's chain without a manifest"
                chain.append(manifest)
                directory = manifest.get("parent_dir")
            if chain:
                out[chain[0]["fragment"]] = chain[::-1]
        return out

    def versions(self) -> list[dict]:
        """Every fragment's chain, one after the other."""
        return [v for chain in self.chains().values() for v in chain]

    def pseudograds(self, island: str | None = None) -> dict[str, dict]:
        """Committed pseudo-gradients: id -> manifest (markers only, not payloads)."""
        out = {}
        for name in self.names("pseudograds/" + (f"{island}/" if island else "")):
            if name.endswith(".json"):
                out[name[len("pseudograds/") : -len(".json")]] = self.json(name)
        return out

    def records(self, sub: str) -> list[dict]:
        return [self.json(n) for n in self.names(sub) if n.endswith(".json")]


def _kill_island(runs: Path, experiment: str, island: str) -> int | None:
    try:
        record = json.loads((runs / experiment / island / "process.json").read_text())
        pgid = int(record["pgid"])
        os.killpg(pgid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        return None
    return pgid


FORM_BUDGET = 240_000
FIRST_MERGE_S = 10.0  # first merge after the first publish, at most


def test_a_run_triggered_like_the_form_merges_from_its_first_publish(airflow, gcs_bucket):  # noqa: F811
    from diloco_airflow.store import open_experiment

    name = f"form-{uuid.uuid4().hex[:8]}"
    store_url = f"{gcs_bucket}/form-{uuid.uuid4().hex[:8]}"
    conf = demo_conf(name, store_url, budget=FORM_BUDGET)
    airflow.wait_healthy()
    airflow.ensure_pools()
    airflow.wait_dag(DAG)
    dags = airflow.request("GET", "/api/v2/dags?limit=100")["dags"]
    assert all(d["is_paused"] for d in dags), "a DAG was unpaused before the trigger"
    run_id = airflow.trigger(DAG, conf)  # the form: unpause this DAG, trigger it
    state = airflow.wait_run(DAG, run_id, RUN_TIMEOUT_S)
    assert state == "success", f"run ended {state}"
    dags = airflow.request("GET", "/api/v2/dags?limit=100")["dags"]
    assert [d["dag_id"] for d in dags if not d["is_paused"]] == [DAG]

    tis = airflow.task_instances(DAG, run_id)
    shards = sorted(ti["map_index"] for ti in tis if ti["task_id"] == "syncer")
    assert shards == [0, 1] and all(
        ti["state"] == "success" for ti in tis if ti["task_id"] in ("syncer", "evaluate")
    )

    estore = open_experiment(store_url, name)
    merges, evals = estore.read_metrics("merge"), estore.read_metrics("eval")
    s = summarize(
        merges, evals, {}, FORM_BUDGET, tokens_merged=estore.current_snapshot().tokens_merged
    )
    print(f"\n[e2e form] {s}")
    fragments = {c["fragment"] for m in merges for c in m["contributions"]}
    assert fragments == {0, 1, 2, 3}, "every fragment merged (the form's P = 4, on both shards)"
    assert s["applied_twice"] == 0
    from training.config.experiment import parse_config

    cfg = parse_config(estore.read_config())
    per_interval = cfg.inner.H * cfg.data.batch_size * cfg.data.seq_len  # one island's interval
    # The run merged past the budget; when finalize restored an earlier BEST (below), the model's
    # tokens_merged is that version's, and the tokens after it are the restore's discarded ones.
    over = s["tokens_merged"] + tokens_discarded(estore) - FORM_BUDGET
    misses = []  # the three targets, all reported at once
    if not s["first_merge_after_first_publish_s"] <= FIRST_MERGE_S:
        misses.append(
            f"first merge {s['first_merge_after_first_publish_s']}s after the first publish"
        )
    if not 0 <= over <= len(ISLANDS) * per_interval:
        misses.append(f"{over} tokens over the budget (at most {len(ISLANDS) * per_interval})")
    # The end of the run may not degrade the model: today's failure was a final eval far above
    # the best (2.84 -> 3.53, +24%; the remainders' momentum step, now applied without it). The
    # last merges of this short run still moved the eval by 2-7% in one run in three, so
    # finalize restores snapshots/BEST.json when the final model is worse (finish_at_best).
    if not s["final_eval_loss"] <= 1.001 * s["best_eval_loss"]:
        misses.append(f"final eval {s['final_eval_loss']:.4f} > best {s['best_eval_loss']:.4f}")
    assert s["evals"] >= 3  # version 0, at least one during the run, the final one
    assert not misses, "; ".join(misses)


def test_experiment_on_gcs_survives_a_killed_island(airflow, gcs_bucket):  # noqa: F811
    started = time.monotonic()
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    store_url = f"{gcs_bucket}/{prefix}"
    bucket = Bucket(f"{prefix}/{name}")

    airflow.wait_healthy()
    airflow.ensure_pools()
    airflow.wait_dag(DAG)
    ready_s = time.monotonic() - started
    run_id = airflow.trigger(DAG, _conf(name, store_url))

    # kill KILL once it has had a pseudo-gradient merged (so it resumes from a checkpoint)
    killed_at = killed_pgid = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    state = "queued"
    while time.monotonic() < deadline:
        airflow.check_alive()
        state = airflow.dag_run(DAG, run_id)["state"]
        if state in ("success", "failed"):
            break
        if killed_at is None:
            merged = {pg for v in bucket.versions() for pg in v.get("applied", [])}
            if any(pg.startswith(f"{KILL}/") for pg in merged):
                killed_pgid = _kill_island(airflow.runs, name, KILL)
                if killed_pgid is not None:
                    killed_at = time.time()
        time.sleep(2)
    run_s = time.monotonic() - started - ready_s
    assert killed_at is not None, f"{KILL} never got a pseudo-gradient merged (run {state})"
    assert state == "success", f"run ended {state} after {run_s:.0f}s"

    # the killed island's wait task retried (REST API v2)
    tis = airflow.task_instances(DAG, run_id)
    waits = {
        ti.get("rendered_map_index"): ti for ti in tis if ti["task_id"] == "islands_local.wait"
    }
    killed_ti = next(ti for label, ti in waits.items() if label and label.startswith(KILL))
    assert killed_ti["try_number"] > 1, killed_ti
    assert killed_ti["state"] == "success"

    # the bucket, read with google-cloud-storage alone
    chains = bucket.chains()
    versions = [v for chain in chains.values() for v in chain]
    for chain in chains.values():
        assert [v["version"] for v in chain] == list(range(len(chain)))
        assert chain[0]["applied"] == []
    assert len(versions) - len(chains) >= 3
    committed = bucket.pseudograds()
    applied = []
    for v in versions:
        # version 0 and finalize's restore of the best snapshot (finish_at_best) apply nothing
        assert v["applied"] or v["version"] == 0 or v.get("restored_from"), (
            f"version {v['version']} names no pseudo-gradient"
        )
        for pg in v["applied"]:
            assert pg in committed, f"version {v['version']} applied {pg}, which has no marker"
            ledger = bucket.json(f"ledger/{pg}.json")
            assert ledger["version"] == v["version"], (pg, ledger)
        applied += v["applied"]
    assert len(applied) == len(set(applied)), "a pseudo-gradient was merged twice"
    quarantined = {n[len("quarantine/") : -len(".json")] for n in bucket.names("quarantine/")}
    assert set(committed) <= set(applied) | quarantined, "committed but never merged"
    assert len(quarantined) <= 2, quarantined

    after_kill = [pg for pg, m in bucket.pseudograds(KILL).items() if m["created_at"] > killed_at]
    assert after_kill, f"{KILL} published nothing after its relaunch"
    assert set(after_kill) <= set(applied)
    assert set(bucket.names("done/")) == {f"done/{i}.json" for i in ISLANDS}

    evals = sorted(bucket.records("metrics/eval/"), key=lambda r: r["at"])
    heads = [chains[p][-1]["version"] for p in sorted(chains)]
    assert evals[0]["version"] == 0 and evals[-1]["versions"] == heads
    initial, final = evals[0]["loss"], evals[-1]["loss"]
    trajectory = [(r["version"], round(r["loss"], 3)) for r in evals]
    assert final < initial - 0.5, f"eval loss did not go down: {trajectory}"
    print(
        f"\n[e2e] airflow ready {ready_s:.0f}s, run {run_s:.0f}s; versions {len(versions)}, "
        f"applied {len(applied)}, {KILL} retried (try {killed_ti['try_number']}), "
        f"{len(after_kill)} merged after the kill; eval {initial:.3f} -> {final:.3f}"
    )
