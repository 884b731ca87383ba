"""Chaos mode: inject the faults `ExperimentConfig.chaos` asks for, and record every one.

- Storage: `ChaosStore` wraps any `ObjectStore`. Before an operation it may raise
  `InjectedStoreError` (a `TransientStoreError`) with probability `storage_error_rate` and it
  sleeps `storage_latency_s`. The backends retry transient errors inside their own methods
  (`LocalStore._run` / `GCSStore._run` call `objectstore.retry`; `MemoryStore` does not retry;
  `ExperimentStore` has no retry layer of its own), so a wrapper sitting *above* a backend would
  let its errors reach the island or merger unretried. `ChaosStore` therefore runs the injection
  and the inner call inside the same `retry()` (same backoff and full jitter), retrying only the
  errors it injected: real errors keep their single retry layer in the backend. Injection happens
  before the inner call, so a retried attempt never repeats an operation that landed. At most
  `attempts - 1` injected failures in a row hit one call, so injected errors are always survivable
  (exhausting retries is a permanent failure, tested in tests/test_objectstore.py). Draws are
  deterministic per (seed, operation, key, n-th call on that key, attempt), independent of thread
  scheduling.
- Islands: `IslandChaos` slows one island (sleeps (slow_factor - 1) x the step's compute time
  after each step) and stalls one (after `stall_after_s` it stops stepping and heart-beating but
  stays alive until SIGTERM / SIGKILL; once per experiment).
- Kills: `run_monkey(pids_provider, cfg.chaos, record)` SIGKILLs island processes at exponential
  inter-arrival times of mean `kill_mtbi_s`, up to `max_kills` (0: no limit), victims chosen
  uniformly among the live ones; deterministic given the seed. `kill_times` is the same schedule
  for virtual-clock benches.
- Merge: `arm_merge_kill` makes the merge process SIGKILL itself at the named fault point
  (`training/faults/points.py`) the first time any merge process of the experiment runs with
  chaos on: it returns the process's `FaultPlan` with that point added, which `for_process`
  hands to the store the merger uses (nothing goes through the environment); a restarted merger
  finds the recorded event and is not armed again.

Every injected event is written with `append_metric("chaos", {"event": ..., "at": unix time})`.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from training.config.experiment import MERGE_FAULT_POINTS, ChaosConfig, ExperimentConfig
from training.faults.points import FaultPlan
from training.store.experiment import ExperimentStore
from training.store.objectstore import (
    Generation,
    ObjectStore,
    TransientStoreError,
    retry,
)

log = logging.getLogger("diloco.chaos")

T = TypeVar("T")
Record = Callable[[dict[str, Any]], None]


def recorder(store: ExperimentStore) -> Record:
    """A `record` callable writing chaos events to the store's metrics (never raises)."""

    def record(event: dict[str, Any]) -> None:
        try:
            store.append_metric("chaos", event)
        except Exception as exc:  # recording must not become a fault of its own
            log.warning("could not record chaos event %s: %s", event, exc)

    return record


# -- storage ----------------------------------------------------------------------------------


class InjectedStoreError(TransientStoreError):
    """A transient storage error injected by chaos mode."""


class ChaosStore(ObjectStore):
    """An `ObjectStore` that injects transient errors and latency in front of another one."""

    def __init__(
        self,
        inner: ObjectStore,
        error_rate: float = 0.0,
        latency_s: float = 0.0,
        seed: int = 0,
        record: Record | None = None,
        *,
        attempts: int = 5,
        backoff_base: float = 0.2,
        backoff_cap: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not 0 <= error_rate < 1:
            raise ValueError(f"error_rate must be in [0, 1), got {error_rate}")
        self.inner = inner
        self.url = inner.url
        self.error_rate = error_rate
        self.latency_s = latency_s
        self.seed = seed
        self.record = record
        self.attempts = attempts
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.sleep = sleep
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], int] = {}
        self.stats = dict(calls=0, injected=0, retried_calls=0, delayed_s=0.0)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        with self._lock:
            n = self._calls.get((op, key), 0)
            self._calls[(op, key)] = n + 1
            self.stats["calls"] += 1
        attempt = 0

        def once() -> T:
            nonlocal attempt
            a, attempt = attempt, attempt + 1
            if self.latency_s:
                self.sleep(self.latency_s)
                with self._lock:
                    self.stats["delayed_s"] += self.latency_s
            if a < self.attempts - 1 and self.error_rate:
                draw = random.Random(f"{self.seed}/{op}/{key}/{n}/{a}").random()
                if draw < self.error_rate:
                    with self._lock:
                        self.stats["injected"] += 1
                        self.stats["retried_calls"] += a == 0
                    if self.record:
                        self.record(
                            dict(
                                event="storage_error", op=op, key=key, attempt=a + 1, at=time.time()
                            )
                        )
                    raise InjectedStoreError(f"chaos: injected transient error on {op} {key}")
            return fn()

        return retry(
            once,
            self.attempts,
            self.backoff_base,
            self.backoff_cap,
            transient=lambda e: isinstance(e, InjectedStoreError),
            sleep=self.sleep,
        )

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        return self._call("read", key, lambda: self.inner.read(key, max_bytes))

    def write(self, key: str, data: bytes) -> None:
        return self._call("write", key, lambda: self.inner.write(key, data))

    def write_stream(self, key: str, chunks) -> None:
        return self._call("write", key, lambda: self.inner.write_stream(key, chunks))

    def create(self, key: str, data: bytes) -> bool:
        return self._call("create", key, lambda: self.inner.create(key, data))

    def read_versioned(
        self, key: str, max_bytes: int | None = None
    ) -> tuple[bytes, Generation] | None:
        return self._call("read_versioned", key, lambda: self.inner.read_versioned(key, max_bytes))

    def compare_and_swap_generation(
        self, key: str, data: bytes, expected: Generation | None
    ) -> Generation | None:
        return self._call(
            "compare_and_swap",
            key,
            lambda: self.inner.compare_and_swap_generation(key, data, expected),
        )

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list(prefix, start_after))

    def delete(self, key: str) -> None:
        return self._call("delete", key, lambda: self.inner.delete(key))

    def check(self) -> None:
        self.inner.check()


def chaos_store(store: ExperimentStore, chaos: ChaosConfig, **kwargs: Any) -> ExperimentStore:
    """`store` itself when chaos storage faults are off, else the same experiment over a
    `ChaosStore` (events recorded through the unwrapped store). kwargs go to `ChaosStore`."""
    if not chaos.storage_error_rate and not chaos.storage_latency_s:
        return store
    record = recorder(store)
    wrapped = ChaosStore(
        store.store,
        chaos.storage_error_rate,
        chaos.storage_latency_s,
        chaos.seed,
        record,
        **kwargs,
    )
    record(
        dict(
            event="storage_faults",
            error_rate=chaos.storage_error_rate,
            latency_s=chaos.storage_latency_s,
            pid=os.getpid(),
            at=time.time(),
        )
    )
    return ExperimentStore(wrapped, store.experiment, store.max_workers, store.faults)


# -- islands ----------------------------------------------------------------------------------


class IslandChaos:
    """Slow-down and stall of one island process (None from `for_island` when neither applies)."""

    def __init__(
        self,
        island: str,
        record: Record,
        slow_factor: float | None = None,
        stall_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.island = island
        self.record = record
        self.slow_factor = slow_factor
        self.stall_after_s = stall_after_s
        self.clock = clock
        self.sleep = sleep
        self.t0 = clock()
        self.slowed_s = 0.0
        self._slow_recorded = False

    @classmethod
    def for_island(
        cls, cfg: ExperimentConfig, island: str, store: ExperimentStore, **kwargs: Any
    ) -> IslandChaos | None:
        c = cfg.chaos
        slow = c.slow_factor if c.slow_island == island and c.slow_factor > 1 else None
        stall = c.stall_after_s if c.stall_island == island else None
        if stall is not None and any(
            e.get("event") == "stall" and e.get("island") == island
            for e in store.read_metrics("chaos")
        ):
            stall = None  # stalled once already; a restarted process runs normally
        if slow is None and stall is None:
            return None
        return cls(island, recorder(store), slow, stall, **kwargs)

    def after_step(self, compute_s: float) -> None:
        """Slow island: stretch the step to slow_factor x its compute time."""
        if self.slow_factor is None:
            return
        if not self._slow_recorded:
            self._slow_recorded = True
            self.record(
                dict(event="slow", island=self.island, factor=self.slow_factor, at=time.time())
            )
        extra = (self.slow_factor - 1.0) * max(0.0, compute_s)
        self.slowed_s += extra
        self.sleep(extra)

    def stall_due(self) -> bool:
        return self.stall_after_s is not None and self.clock() - self.t0 >= self.stall_after_s

    def stall(self, should_end: Callable[[], bool], poll_s: float = 0.5) -> None:
        """Hang: no steps, no heartbeats, until `should_end()` (SIGTERM) or a SIGKILL."""
        self.record(
            dict(event="stall", island=self.island, after_s=self.stall_after_s, at=time.time())
        )
        self.stall_after_s = None
        while not should_end():
            self.sleep(poll_s)


# -- kills ------------------------------------------------------------------------------------


def kill_times(mtbi_s: float, seed: int, start: float = 0.0) -> Iterator[float]:
    """Absolute times of a Poisson process of mean interval `mtbi_s` (endless, deterministic)."""
    rng = random.Random(f"{seed}/kill-times")
    t = start
    while True:
        t += rng.expovariate(1.0 / mtbi_s)
        yield t


def victim_chooser(seed: int) -> Callable[[list[str]], str]:
    """Deterministic uniform choice among the (sorted) live islands."""
    rng = random.Random(f"{seed}/kill-victims")
    return lambda names: rng.choice(sorted(names))


def run_monkey(
    pids_provider: Callable[[], Mapping[str, int]],
    chaos: ChaosConfig,
    record: Record,
    *,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    kill: Callable[[int, int], None] = os.kill,
) -> list[dict[str, Any]]:
    """SIGKILL island processes at exponential inter-arrival times; returns the kill events.

    `pids_provider()` gives {island: pid} of the island processes alive now (a runner restarts
    killed ones). The n-th kill is due at the n-th time of `kill_times(kill_mtbi_s, seed)` after
    the monkey starts; at that time one live island, chosen uniformly, is killed (none alive: that
    kill is skipped). Stops after `max_kills` kills (0: no limit) or when `stop` is set.
    """
    if chaos.kill_mtbi_s is None:
        return []
    stop = stop or threading.Event()
    choose = victim_chooser(chaos.seed)
    t0 = clock()
    kills: list[dict[str, Any]] = []
    for due in kill_times(chaos.kill_mtbi_s, chaos.seed, t0):
        if chaos.max_kills and len(kills) >= chaos.max_kills:
            break
        if stop.wait(max(0.0, due - clock())):
            break
        pids = dict(pids_provider())
        if not pids:
            continue
        island = choose(list(pids))
        pid = pids[island]
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        event = dict(event="kill", island=island, pid=pid, n=len(kills) + 1, at=time.time())
        log.warning("chaos: SIGKILL island %s (pid %d)", island, pid)
        record(event)
        kills.append(event)
    return kills


def start_monkey(
    pids_provider: Callable[[], Mapping[str, int]],
    chaos: ChaosConfig,
    record: Record,
    *,
    kill: Callable[[int, int], None] = os.kill,
) -> tuple[threading.Thread, threading.Event, list[dict[str, Any]]]:
    """`run_monkey` on a daemon thread: (thread, stop event, the kill events as they happen)."""
    stop = threading.Event()
    kills: list[dict[str, Any]] = []

    def record_too(event: dict[str, Any]) -> None:
        record(event)
        kills.append(event)

    def target() -> None:
        run_monkey(pids_provider, chaos, record_too, stop=stop, kill=kill)

    thread = threading.Thread(target=target, name="chaos-monkey", daemon=True)
    thread.start()
    return thread, stop, kills


# -- merge ------------------------------------------------------------------------------------


def parse_fault(spec: str) -> tuple[str, int]:
    point, _, nth = spec.partition("@")
    return point, int(nth or 1)


def arm_merge_kill(
    cfg: ExperimentConfig, store: ExperimentStore, faults: FaultPlan | None = None
) -> FaultPlan | None:
    """The fault plan of this merge process: `faults` (the entry point's, or None) plus a
    SIGKILL at `chaos.kill_merge_at` (a point of `training/faults/points.py`, optionally
    `point@n`), unless chaos mode names none or an earlier merge process was armed already (the
    event is in the metrics): then `faults` itself. Records the event when it arms."""
    spec = cfg.chaos.kill_merge_at
    if not spec:
        return faults
    point, nth = parse_fault(spec)
    if point not in MERGE_FAULT_POINTS:
        raise ValueError(f"chaos.kill_merge_at: {point!r} is not a merge fault point")
    if any(e.get("event") == "merge_kill" for e in store.read_metrics("chaos")):
        return faults
    recorder(store)(
        dict(event="merge_kill", point=point, nth=nth, pid=os.getpid(), armed=True, at=time.time())
    )
    return (faults or FaultPlan({})).with_point(point, nth)


def for_process(cfg: ExperimentConfig, store: ExperimentStore, role: str) -> ExperimentStore:
    """What a process entry point calls: the store to use, carrying `store.faults` (the
    process's fault plan) and, for role "merge", the merge kill (`arm_merge_kill`); storage
    faults on when configured (`chaos_store`: the plan survives the wrap)."""
    if role not in ("island", "merge"):
        raise ValueError(f"role must be 'island' or 'merge', not {role!r}")
    if role == "merge":
        faults = arm_merge_kill(cfg, store, store.faults)
        if faults is not store.faults:
            store = store.with_faults(faults)
    return chaos_store(store, cfg.chaos)
