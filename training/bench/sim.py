"""The virtual-clock harness the benches share: production islands and merger, simulated time.

`run_islands(cfg, eval_dt, ...)` runs `Island` and `Merger` over a fresh `memory://` store. Time
is a `VirtualClock`: an island at step rate r (`ExperimentConfig.step_rate`: its speed while its
batch is data.batch_size) takes 1/r virtual seconds per inner step (times a
per-step jitter factor exp(jitter * z), z standard normal, when `jitter` > 0), merges take no
virtual time, and the event loop always runs the island whose next step ends first (ties by
name), so a run is deterministic given the config's seed. Island i takes its first step at
`offsets[i]` + one step. The run ends when the merged pseudo-gradients account for the token
budget (tokens in the global model).

Returned: the eval curve (every `eval_dt` virtual seconds and at the end), tokens merged and
processed, bytes per island both ways (`bytes_received` is None when islands do not count it),
merges, quarantined contributions, goodput (island-seconds stepping / island-seconds
provisioned from 0 to the end), `params_sha256` (the final parameters' digest) and, with
`trace_every` > 0, the per-merge trace (training/bench/trace.py).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import uuid

import numpy as np

from training.bench.trace import MergeTracer
from training.config.experiment import ExperimentConfig
from training.island.process import Island
from training.merge import replay
from training.merge.merger import Merger, initial_version
from training.model.baseline import Curve
from training.model.evaluate import held_out_batches
from training.model.runtime import loop_for
from training.store.experiment import ExperimentStore
from training.store.registry import open_store


class VirtualClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


eval_set = held_out_batches


def fresh_store(cfg: ExperimentConfig) -> ExperimentStore:
    store = ExperimentStore(open_store(f"memory://bench-{uuid.uuid4().hex[:8]}"), cfg.name)
    store.write_config(json.loads(cfg.to_json()))
    initial_version(cfg, store)
    return store


def params_digest(params: dict[str, np.ndarray]) -> str:
    """sha256 over the final parameters' names, dtypes, shapes and bytes (name order): equal
    digests are equal bits (tests/test_determinism.py)."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def run_islands(
    cfg: ExperimentConfig,
    eval_dt: float,
    progress=None,
    offsets: dict[str, float] | None = None,
    jitter: float = 0.0,
    trace_every: int = 0,
    merge_latency: float = 0.0,
) -> dict:
    """The production Island and Merger classes on a virtual clock over a memory:// store.

    `merge_latency` (virtual seconds): each publish wakes the merger that long after it (a real
    syncer's upload, poll and merge time), which then merges whatever is committed (0: at once,
    before the island's next step)."""
    clock = VirtualClock()
    store = fresh_store(cfg)
    islands = [Island(cfg, i.name, store, clock=clock) for i in cfg.islands]
    for isl in islands:
        isl.start()
    merger = Merger(cfg, store, clock=clock)
    loop = loop_for(cfg)
    evals = eval_set(cfg)
    tracer = None
    if trace_every:
        tracer = MergeTracer(
            store, lambda p: loop.eval_loss(loop.put_params(p), evals), trace_every, clock
        )
    rng = np.random.default_rng([cfg.seed, 11])
    base_pace = {isl.name: 1.0 / cfg.step_rate(isl.name) for isl in islands}

    def pace(name: str) -> float:
        p = base_pace[name]
        return p * math.exp(jitter * rng.standard_normal()) if jitter > 0 else p

    offsets = offsets or {}
    next_t, took = {}, {}
    for isl in islands:
        took[isl.name] = pace(isl.name)
        next_t[isl.name] = offsets.get(isl.name, 0.0) + took[isl.name]
    stepping = 0.0
    wake: float | None = None
    due: list[float] = []  # merges scheduled by publishes (merge_latency > 0)
    curve = Curve()
    seen_version = -1
    merges = quarantined = merged_tokens = 0

    def evaluate():
        nonlocal seen_version
        snapshot = store.current_snapshot()
        params = store.load_params(snapshot, replay.params_of(cfg, store))
        loss = loop.eval_loss(loop.put_params(params), evals)
        seen_version = sum(snapshot.versions)
        curve.add(clock.t, merged_tokens, loss)
        if progress:
            progress(clock.t, curve.tokens[-1], loss)

    def merge():
        nonlocal wake, merges, quarantined, merged_tokens
        if tracer:
            tracer.before_merge()
        results = merger.merge_all()
        if tracer:
            tracer.after_merge(results, [i.name for i in islands])
        for r in results:
            merges += r.version is not None
            merged_tokens = max(merged_tokens, r.tokens_merged or 0)
            quarantined += len(r.quarantined)
            wake = r.waiting_until
        for isl in islands:
            if isl.blocked() and isl.poll_merged():
                took[isl.name] = pace(isl.name)
                next_t[isl.name] = clock.t + took[isl.name]

    evaluate()
    next_eval = eval_dt
    while merged_tokens < cfg.token_budget:
        ready = [i for i in islands if not i.blocked()]
        t_island = min((next_t[i.name] for i in ready), default=None)
        if due and (t_island is None or due[0] <= t_island):
            clock.t = max(clock.t, heapq.heappop(due))
            merge()
            continue
        if wake is not None and (t_island is None or wake <= t_island):
            clock.t = max(clock.t, wake)
            wake = None
            merge()
            continue
        if t_island is None:  # everyone waits for a merge that cannot happen yet
            merge()
            if all(i.blocked() for i in islands):
                raise RuntimeError("synchronous round cannot complete: no merge possible")
            continue
        isl = min(ready, key=lambda i: (next_t[i.name], i.name))
        clock.t = next_t[isl.name]
        result = isl.step()
        stepping += took[isl.name]
        took[isl.name] = pace(isl.name)
        next_t[isl.name] += took[isl.name]
        if result.published and merge_latency > 0:
            heapq.heappush(due, clock.t + merge_latency)
        elif result.published:
            merge()
        if clock.t >= next_eval:
            evaluate()
            next_eval += eval_dt
    evaluate()
    received = [getattr(i, "bytes_received", None) for i in islands]
    out = dict(
        curve=curve,
        tokens=merged_tokens,
        tokens_processed=sum(i.tokens for i in islands),
        bytes_sent=float(np.mean([i.bytes_sent for i in islands])),
        bytes_received=None if None in received else float(np.mean(received)),
        merges=merges,
        quarantined=quarantined,
        final_version=seen_version,
        goodput=stepping / (len(islands) * clock.t) if clock.t > 0 else None,
        params_sha256=params_digest(
            store.load_params(store.current_snapshot(), replay.params_of(cfg, store))
        ),
    )
    if tracer:
        out["trace"] = tracer.records
    return out
