"""What the DiLoCo page in Airflow shows (and `diloco report` draws): store -> JSON-able dicts.

Pure functions over an `ExperimentStore` and its parsed config; no Airflow, no jax. Everything
comes through the store's strict readers (training/store/merge_records.py, island_records.py), so
junk in a bucket is skipped and counted, never fatal. Airflow's side (task states, run links) comes in as plain
dicts (`tasks`, `runs`) from the plugin (plugins/diloco_airflow/ui/).

`MetricCache` keeps the merge / eval / chaos records already read, so a page polled every few
seconds lists only the new names of a long run and reads each record once.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from training.config.experiment import ChaosConfig, ExperimentConfig
from training.config.scavenge import METRIC as SCAVENGE_METRIC
from training.config.scavenge import scavenge_view
from training.island.goodput import BADPUT, experiment_goodput
from training.protocol.stall import island_state
from training.store.faces import ReaderFace
from training.store.layout import iso

MAX_POINTS = 1500  # per curve sent to the page (evenly thinned, the last point always kept)
MERGES_SHOWN = 40  # newest merge records in the table
QUARANTINE_SHOWN = 50  # newest quarantine entries (by seq) with their reasons


# ------------------------------------------------------------------ small pure helpers
def bucket_url(store_url: str, experiment: str, sub: str = "") -> str:
    """Where a person browses the experiment's objects: the Cloud console for gs://, the
    path for file:// (no link to make), the URL itself otherwise."""
    path = "/".join(p for p in (experiment, sub.strip("/")) if p)
    if store_url.startswith("gs://"):
        bucket_and_prefix = store_url[len("gs://") :].strip("/")
        return f"https://console.cloud.google.com/storage/browser/{bucket_and_prefix}/{path}"
    return f"{store_url.rstrip('/')}/{path}"


def chaos_mode(cfg: ExperimentConfig) -> bool:
    """Whether the experiment injects faults (any chaos field but the seed set): then "kill
    island" is allowed."""
    return cfg.chaos.model_dump(exclude={"seed"}) != ChaosConfig().model_dump(exclude={"seed"})


def thin(points: Sequence[Any], limit: int = MAX_POINTS) -> list[Any]:
    """At most `limit` of `points`, evenly spaced, first and last kept."""
    n = len(points)
    if n <= limit:
        return list(points)
    step = (n - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def badput(goodput_state: Any) -> dict[str, float]:
    """category -> fraction of the island's elapsed time (from its heartbeat's goodput_state)."""
    if not isinstance(goodput_state, Mapping):
        return {}
    seconds, elapsed = goodput_state.get("seconds"), goodput_state.get("elapsed_s")
    if not isinstance(seconds, Mapping) or not _real(elapsed) or elapsed <= 0:
        return {}
    return {c: seconds[c] / elapsed for c in BADPUT if _real(seconds.get(c)) and seconds[c] > 0}


def staleness(heads: Sequence[int] | None, base: Any) -> int | None:
    """How many versions behind the HEADs an island's base is (the worst fragment)."""
    if not heads:
        return None
    if isinstance(base, int) and not isinstance(base, bool):
        base = [base] * len(heads)
    if not isinstance(base, list) or len(base) != len(heads):
        return None
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in base):
        return None
    return max(h - b for h, b in zip(heads, base, strict=True))


def progress_line(island: str, beat: Mapping[str, Any]) -> str:
    """One line of an island's progress from its heartbeat (what its Airflow task log shows
    every few seconds): step, tokens, tokens/s, loss, the global version it trains from."""

    def fmt(key: str, spec: str) -> str:
        value = beat.get(key)
        return format(value, spec) if _real(value) else "-"

    base = beat.get("base_version")
    version = ",".join(map(str, base)) if isinstance(base, list) else str(base)
    return (
        f"island {island}: step {fmt('step', ',')}, tokens {fmt('tokens', ',')}, "
        f"{fmt('tokens_per_s', ',.0f')} tok/s, loss {fmt('loss', '.4f')}, "
        f"adopted version {version if base is not None else '-'}"
    )


# ------------------------------------------------------------------ metric records
class MetricCache:
    """merge / eval / chaos records and quarantine reasons of many experiments, each read once
    (thread-safe).

    Keyed by the experiment's URL; `records(estore, kind)` lists only names after the last one
    seen (`ExperimentStore.read_metrics_after`) and appends what is new."""

    KINDS = ("merge", "eval", "chaos")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[str | None, list[dict]]] = {}
        self._reasons: dict[str, dict[str, str]] = {}  # experiment URL -> id -> reason

    def quarantine(self, estore) -> tuple[int, list[dict[str, str]]]:
        """(how many are quarantined, the newest QUARANTINE_SHOWN with reasons); each reason
        is read once (an entry's reason may be overwritten later: the first one read stays)."""
        ids = estore.quarantine_ids()
        shown = sorted(ids, key=lambda i: (i.split("/", 1)[1], i))[-QUARANTINE_SHOWN:]
        with self._lock:
            known = self._reasons.setdefault(estore.url, {})
            missing = [i for i in shown if i not in known]
        got = {i: estore.quarantine_reason(i) or "" for i in missing}
        with self._lock:
            known.update(got)
            known = dict(known)
        return len(ids), quarantine_rows({i: known[i] for i in shown})

    def records(self, estore, kind: str) -> list[dict[str, Any]]:
        key = (estore.url, kind)
        with self._lock:
            last, got = self._seen.get(key, (None, []))
        new = estore.read_metrics_after(kind, last)
        with self._lock:
            last2, got2 = self._seen.get(key, (None, []))
            if last2 == last:  # nobody else extended it meanwhile
                got2 = got + [r for _, r in new]
                last2 = new[-1][0] if new else last
                self._seen[key] = (last2, got2)
            return list(got2)


# ------------------------------------------------------------------ curves, merges, islands
def eval_curve(evals: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The held-out loss against time and merged tokens, oldest first."""
    out = [
        dict(
            at=e["at"], tokens=e.get("tokens_merged", 0), loss=e["loss"], versions=e.get("versions")
        )
        for e in evals
        if _real(e.get("at")) and _real(e.get("loss"))
    ]
    return thin(sorted(out, key=lambda p: p["at"]))


def island_loss_curves(merges: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """island -> its training loss at each applied contribution (time published, the tokens
    merged after that merge), from the merge records' contributions."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for m in merges:
        for c in m.get("contributions") or []:
            if not isinstance(c, Mapping) or not isinstance(c.get("island"), str):
                continue
            at, loss = c.get("published_at"), c.get("loss")
            if _real(at) and _real(loss):
                point = dict(at=at, tokens=m.get("tokens_merged", 0), loss=loss)
                curves.setdefault(c["island"], []).append(point)
    return {i: thin(sorted(p, key=lambda x: x["at"])) for i, p in sorted(curves.items())}


def merge_row(m: Mapping[str, Any]) -> dict[str, Any]:
    """One merge record for the table: time, versions, counts, contributions with weight,
    staleness and latency (merge time minus the contribution's publish time)."""
    contributions = []
    for c in m.get("contributions") or []:
        if not isinstance(c, Mapping):
            continue
        at, published = c.get("merged_at", m.get("at")), c.get("published_at")
        latency = at - published if _real(at) and _real(published) else None
        contributions.append(
            dict(
                island=c.get("island"),
                fragment=c.get("fragment"),
                weight=c.get("weight"),
                staleness=c.get("staleness"),
                tokens=c.get("tokens"),
                latency_s=latency,
            )
        )
    latencies = [c["latency_s"] for c in contributions if _real(c["latency_s"])]
    at = m.get("at")
    return dict(
        at=at,
        at_iso=iso(at) if _real(at) else None,
        versions=m.get("versions"),
        applied=m.get("applied"),
        quarantined=m.get("quarantined"),
        skipped=m.get("skipped"),
        tokens_merged=m.get("tokens_merged"),
        latency_s=statistics.median(latencies) if latencies else None,
        contributions=contributions,
    )


def island_rows(
    cfg: ExperimentConfig,
    beats: Mapping[str, Mapping[str, Any]],
    done: Mapping[str, Any],
    stopped: set[str],
    heads: Sequence[int] | None,
    now: float,
    tasks: Mapping[str, Mapping[str, Any]] | None = None,
    scavenged: Mapping[str, Mapping[str, Any]] | None = None,
    stall_after_s: float | None = None,
) -> list[dict[str, Any]]:
    """One row per island of the config (state, progress, goodput and badput, bytes, retries).

    `tasks`: island -> {"state", "try_number"} of its Airflow wait task (optional);
    `scavenged`: `training.config.scavenge.scavenge_view` (a scavenged island's row carries it, and
    one that left says "left"); `stall_after_s`: the wait task's heartbeat limit where a
    deployment sets one (``DILOCO_HEARTBEAT_TIMEOUT_S``), else the stall rule's
    (training/protocol/stall.py, `island_state`)."""
    rows = []
    for isl in cfg.islands:
        scav = (scavenged or {}).get(isl.name)
        hb = beats.get(isl.name, {})
        task = (tasks or {}).get(isl.name) or {}
        at = hb.get("time", hb.get("at"))
        age = now - at if _real(at) else None
        tries = task.get("try_number")
        rows.append(
            dict(
                island=isl.name,
                backend=isl.backend,
                hardware=dict(isl.hardware),
                state=island_state(
                    isl.name in done,
                    age,
                    cfg.heartbeat_s,
                    stop_requested=isl.name in stopped,
                    task_state=task.get("state"),
                    left=bool(scav) and scav.get("state") == "left",
                    limit_s=stall_after_s,
                ),
                task_state=task.get("state"),
                retries=max(tries - 1, 0) if isinstance(tries, int) else None,
                step=hb.get("step"),
                tokens=hb.get("tokens"),
                tokens_per_s=hb.get("tokens_per_s"),
                loss=hb.get("loss"),
                staleness=staleness(heads, hb.get("base_version")),
                heartbeat_age_s=age,
                goodput=hb.get("goodput"),
                badput=badput(hb.get("goodput_state")),
                bytes_up=hb.get("bytes_sent"),
                bytes_down=hb.get("bytes_received"),
                stop_requested=isl.name in stopped,
                scavenged=dict(scav) if scav else None,
                bucket_url=bucket_url(cfg.store_url, cfg.name, f"pseudograds/{isl.name}"),
            )
        )
    return rows


def quarantine_rows(quarantined: Mapping[str, str]) -> list[dict[str, str]]:
    return [
        dict(id=pg_id, island=pg_id.split("/", 1)[0], reason=reason)
        for pg_id, reason in sorted(quarantined.items())
    ]


def experiment_view(
    cfg: ExperimentConfig,
    estore,
    cache: MetricCache | None = None,
    now: float | None = None,
    tasks: Mapping[str, Mapping[str, Any]] | None = None,
    runs: Sequence[Mapping[str, Any]] = (),
    stall_after_s: float | None = None,
) -> dict[str, Any]:
    """Everything the page shows about one experiment (the JSON of its API); `stall_after_s` as
    `island_rows`'."""
    estore = ReaderFace(estore)  # training/store/faces.py
    cache = cache or MetricCache()
    now = time.time() if now is None else now
    skipped_before = estore.skipped.count
    snapshot = estore.current_snapshot()
    heads = list(snapshot.versions) if snapshot else None
    beats = estore.heartbeats()
    merges = cache.records(estore, "merge")
    evals = cache.records(estore, "eval")
    tokens = snapshot.tokens_merged if snapshot else 0
    quarantine_count, quarantine = cache.quarantine(estore)
    state = estore.run_state()  # one read of control/STOP: a marker <=> not "running"
    return dict(
        experiment=cfg.name,
        store=cfg.store_url,
        bucket_url=bucket_url(cfg.store_url, cfg.name),
        now=now,
        now_iso=iso(now),
        config=dict(
            method=cfg.outer.method,
            H=cfg.inner.H,
            fragments=cfg.fragments.count,
            codec=cfg.codec,
            quorum=cfg.outer.quorum,
            grace_gamma=cfg.outer.grace_gamma,
            grace_min_steps=cfg.outer.grace_min_steps,
            max_grace_s=cfg.outer.max_grace_s,
            heartbeat_s=cfg.heartbeat_s,
            islands=len(cfg.islands),
            chaos=chaos_mode(cfg),
        ),
        snapshot=None
        if snapshot is None
        else dict(versions=heads, tokens_merged=tokens, at=snapshot.at, at_iso=iso(snapshot.at)),
        tokens=dict(
            merged=tokens, budget=cfg.token_budget, fraction=min(tokens / cfg.token_budget, 1.0)
        ),
        stop_requested=state != "running",
        state=state,
        best_eval=estore.best(),
        last_eval=evals[-1] if evals else None,
        evals=eval_curve(evals),
        island_losses=island_loss_curves(merges),
        islands=island_rows(
            cfg,
            beats,
            estore.done(),
            estore.stopped_islands(),
            heads,
            now,
            tasks,
            scavenge_view(cache.records(estore, SCAVENGE_METRIC)),
            stall_after_s,
        ),
        goodput=experiment_goodput(cfg, {n: hb.get("goodput_state") for n, hb in beats.items()}),
        merge_count=len(merges),
        merges=[merge_row(m) for m in merges[-MERGES_SHOWN:]][::-1],
        quarantine_count=quarantine_count,
        quarantine=quarantine,
        chaos_events=[
            dict(e, at_iso=iso(e["at"])) if _real(e.get("at")) else dict(e)
            for e in cache.records(estore, "chaos")
        ][-MERGES_SHOWN:][::-1],
        runs=list(runs),
        skipped=dict(
            count=estore.skipped.count - skipped_before, examples=estore.skipped.examples[:5]
        ),
    )


def experiment_summary(cfg: ExperimentConfig, estore, now: float | None = None) -> dict[str, Any]:
    """One line of the experiment list: name, store, versions, tokens against the budget,
    islands done of all, stop requested, best loss (a few small reads)."""
    estore = ReaderFace(estore)  # training/store/faces.py
    now = time.time() if now is None else now
    snapshot = estore.current_snapshot()
    tokens = snapshot.tokens_merged if snapshot else 0
    best = estore.best()
    done = estore.done()
    state = estore.run_state()  # one read of control/STOP: a marker <=> not "running"
    return dict(
        experiment=cfg.name,
        store=cfg.store_url,
        bucket_url=bucket_url(cfg.store_url, cfg.name),
        versions=list(snapshot.versions) if snapshot else None,
        updated_at=snapshot.at if snapshot else None,
        tokens_merged=tokens,
        token_budget=cfg.token_budget,
        islands=len(cfg.islands),
        islands_done=sum(1 for i in cfg.islands if i.name in done),
        stop_requested=state != "running",
        state=state,
        best_loss=best.get("loss") if best else None,
        chaos=chaos_mode(cfg),
    )
