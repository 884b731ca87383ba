"""The syncer as a service: merge shards, their leases and the draining loop.

Airflow-free (docs/AIRFLOW.md, "The syncer" has the design; `plugins/diloco_airflow/syncer.py`
runs this in mapped tasks of the experiment's own DAG run):

- **Shards.** Fragments are partitioned over `syncer.shards` S: shard s merges the fragments
  p with ``p % S == s`` and never touches another shard's (`shard_fragments`).
- **Lease.** One live syncer per shard: ``<experiment>/control/syncer/shard-{s}.json`` holds
  ``{"owner", "expires_at", "holder"}``, written by compare-and-swap only (name:
  `training.store.keys.lease_key`; record: `training.store.syncer_records`, docs/STORE.md "The
  syncer's objects"). An owner takes a missing or expired lease, renews its own while it merges
  and releases it when it ends; a syncer that finds another owner's live lease stands by
  (`lease_action`). An object there that is not a lease counts as a free lease. The lease is an
  efficiency rule, not a safety one: two syncers on one shard stay exactly-once by the merge's
  own CAS.
- **Draining.** `ShardSyncer.drain()` merges while contributions arrive (one `merge_once` after
  another while each makes progress; a grace window's `waiting_until` is honoured; otherwise a
  cheap look for pending work every `poll_s`), and returns after `idle_s` without a merge (the
  caller then waits somewhere cheap: a deferrable trigger) or, once the experiment is finished
  (`finished`), after a last drain. Before it returns idle, and when asked to stop
  (`request_stop`, SIGTERM: `terminated`), it promotes the light HEADs its merger holds in
  memory (training/store/promotions.py): the next start, here or on another worker, begins
  at them instead of replaying the merges since their full versions.
- **Finished** = every island of the config is done (or asked to leave), or the DAG run that
  started this syncer has marked its islands ended (`ExperimentStore.mark_run_ended`,
  ``control/runs/...``: its island tasks are over, successful or not). A STOP alone does not
  finish: islands publish their remainders first.
- **Housekeeping** (optional, shard 0 on Airflow): a `housekeeping()` callable (garbage
  collection of the store, `plugins/diloco_airflow/retention.py`) runs after a merge once
  `housekeeping_every_s` have passed since the last run, so the bucket does not fill up during a
  run; its failure is logged, never a merge's.
- **Evaluation** runs beside it, in a process of its own (training/merge/evaluator.py), so it
  never delays a merge.

Pure decisions: `shard_fragments`, `lease_action`, `is_finished`, `housekeeping_due`. The I/O of
the leases, run markers and finalize claim is the store's (training/store/syncer_control.py); the
rest is thin calls on `ExperimentStore` (and `training.merge.merger.Merger`, imported lazily: this
module is imported by Airflow triggers, which must not import jax).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from training.config.experiment import ExperimentConfig
from training.store.experiment import ExperimentStore
from training.store.faces import SyncerFace
from training.store.keys import lease_key
from training.store.objectstore import (
    ObjectTooLarge,
    StoreUnreachable,
    TransientStoreError,
)
from training.store.syncer_records import (
    MAX_HOLDER,
    Lease,
    lease_record,
)

log = logging.getLogger("diloco.syncer")

MAX_ERRORS = 5  # consecutive transient store errors before a drain gives up (the task retries)


# -- shards ----------------------------------------------------------------------------------
def shard_fragments(num_fragments: int, shards: int, shard: int) -> list[int]:
    """The fragments shard `shard` of `shards` owns: p with p % shards == shard."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range (shards = {shards})")
    return [p for p in range(num_fragments) if p % shards == shard]


# -- leases ----------------------------------------------------------------------------------
def lease_action(current: Lease | None, owner: str, now: float) -> Literal["take", "renew", "wait"]:
    """What `owner` may do with a shard's lease: take a free or expired one, renew its own live
    one, or wait while another owner's lives."""
    if current is None or not current.live(now):
        return "take"
    return "renew" if current.owner == owner else "wait"


class ShardLease:
    """The lease of one shard, read and written by compare-and-swap only."""

    def __init__(
        self,
        estore: ExperimentStore,
        shard: int,
        owner: str,
        lease_s: float,
        clock: Callable[[], float] = time.time,
    ):
        self.estore = SyncerFace(estore)
        self.shard = shard
        self.key = f"{estore.experiment}/{lease_key(shard)}"  # for log lines
        self.owner = owner
        self.lease_s = float(lease_s)
        self.clock = clock
        self.holder = f"{socket.gethostname()}/{os.getpid()}"[:MAX_HOLDER]
        lease_record(Lease(owner, 0.0, self.holder))  # ValueError now for an owner no one reads
        self.held_until: float | None = None

    def read(self) -> tuple[Lease | None, Any]:
        """(the lease or None, its generation or None when absent): `ExperimentStore.read_lease`."""
        return self.estore.read_lease(self.shard)

    def acquire(self) -> bool:
        """Take or renew the lease; False while another owner's is live (or on a lost race).
        An object too large to be a lease is deleted first, then the lease is created (no
        generation to swap from without reading it whole)."""
        try:
            current, generation = self.read()
        except ObjectTooLarge as exc:
            log.warning("%s: %s: deleted, counted as a free lease", self.key, exc)
            self.estore.drop_lease(self.shard)
            current, generation = None, None
        now = self.clock()
        if lease_action(current, self.owner, now) == "wait":
            self.held_until = None
            return False
        new = Lease(self.owner, now + self.lease_s, self.holder)
        if self.estore.swap_lease(self.shard, new, generation):
            self.held_until = new.expires_at
            return True
        self.held_until = None
        return False

    def renew_due(self) -> bool:
        """Whether a third of the lease has passed since it was taken or renewed."""
        if self.held_until is None:
            return True
        return self.held_until - self.clock() < self.lease_s * 2 / 3

    def release(self) -> None:
        """End our lease now (expires_at 0) so that a standby syncer takes over at once."""
        try:
            current, generation = self.read()
        except ObjectTooLarge:  # not a lease, so not ours
            current, generation = None, None
        if current is not None and current.owner == self.owner:
            gone = Lease(self.owner, 0.0, self.holder)
            self.estore.swap_lease(self.shard, gone, generation)
        self.held_until = None


# -- the end of a run ------------------------------------------------------------------------
def is_finished(islands: Iterable[str], done: Iterable[str], left: Iterable[str], ended: bool):
    """The experiment needs no more merges from this syncer: its run's islands ended, or every
    island of the config is done or has been asked to leave."""
    return ended or set(islands) <= set(done) | set(left)


class ShardView:
    """What a syncer shard (or its trigger) reads: config, finished, pending work, lease.

    Read-only: safe in a trigger that may run twice.
    """

    def __init__(self, estore: ExperimentStore, shard: int, run_id: str | None = None):
        self.estore = SyncerFace(estore)
        self.shard = shard
        self.run_id = run_id

    def config(self) -> ExperimentConfig:
        return self.estore.config()

    def fragments(self, cfg: ExperimentConfig) -> list[int]:
        return shard_fragments(cfg.fragments.count, cfg.syncer.shards, self.shard)

    def finished(self, cfg: ExperimentConfig) -> bool:
        islands = [i.name for i in cfg.islands]
        return is_finished(
            islands,
            self.estore.done(),
            self.estore.stopped_islands(),
            self.estore.run_ended(self.run_id),
        )

    def pending(self, cfg: ExperimentConfig) -> list[str]:
        """Ids of this shard's committed, unapplied, unquarantined pseudo-gradients, from its
        fragments' cursors (`ExperimentStore.pending`: listings that start after them and the
        small HEAD and manifest objects, never the history; no jax)."""
        return [r.id for refs in self.estore.pending(self.fragments(cfg)).values() for r in refs]

    def lease(self) -> Lease | None:
        """The shard's lease; None when it is free (absent, or an object that is not a lease)."""
        key = f"{self.estore.experiment}/{lease_key(self.shard)}"
        try:
            return self.estore.read_lease(self.shard)[0]
        except ObjectTooLarge as exc:
            log.warning("%s: %s: counted as a free lease", key, exc)
            return None


def merge_line(shard: int, result: Any, now: float) -> str:
    """The merge task's log line for one merge (`training.merge.merger.MergeResult`): the versions
    published, each contribution (island, fragment, weight, staleness, publish-to-merge
    latency), the tokens merged and what was quarantined."""
    parts = []
    for c in result.contributions or []:
        latency = (
            now - c["published_at"] if isinstance(c.get("published_at"), int | float) else None
        )
        weight, stale = c.get("weight"), c.get("staleness")
        parts.append(
            f"{c.get('island')} f{c.get('fragment')}"
            + (f" w {weight:.2f}" if isinstance(weight, int | float) else "")
            + (f" stale {stale}" if stale is not None else "")
            + (f" {latency:.1f}s" if latency is not None else "")
        )
    versions = ", ".join(f"f{p} v{v}" for p, v in sorted(result.versions.items())) or "-"
    tokens = f"{result.tokens_merged:,}" if result.tokens_merged is not None else "?"
    line = f"shard {shard}: merged {len(result.applied)} -> {versions}; tokens {tokens}"
    if parts:
        line += "; " + ", ".join(parts)
    if result.quarantined:
        line += f"; quarantined {len(result.quarantined)}"
    return line


def housekeeping_due(now: float, last_at: float | None, every_s: float) -> bool:
    """Run the housekeeping now: it is on (`every_s` > 0) and has not run for `every_s`
    seconds (or never ran in this drain)."""
    return every_s > 0 and (last_at is None or now - last_at >= every_s)


# -- the draining loop -----------------------------------------------------------------------
@dataclass
class DrainOutcome:
    reason: Literal["idle", "finished", "standby", "lease_lost", "terminated"]
    merges: int = 0
    applied: int = 0
    pending: list[str] = field(default_factory=list)  # left pending (not mergeable now)


class ShardSyncer:
    """One shard's syncer: `drain()` merges while work arrives (see the module docstring).

    It looks for pending work in the store (`ShardView.pending`). `merger_for(cfg, fragments)`
    builds the merger (default: `training.merge.merger.Merger`, over `estore`, whose fault plan
    it hits).
    """

    def __init__(
        self,
        estore: ExperimentStore,
        shard: int,
        owner: str,
        *,
        run_id: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        merger_for: Callable[[ExperimentConfig, list[int]], Any] | None = None,
        on_merge: Callable[[Any], None] | None = None,
        housekeeping: Callable[[], Any] | None = None,
        housekeeping_every_s: float = 0.0,
    ):
        self.estore = estore
        self.housekeeping = housekeeping
        self.housekeeping_every_s = housekeeping_every_s if housekeeping else 0.0
        self.housekept_at: float | None = None
        self.view = ShardView(estore, shard, run_id)
        self.shard = shard
        self.clock = clock
        self.sleep = sleep
        self.merger_for = merger_for or self._default_merger
        self.on_merge = on_merge or (lambda result: None)
        self.cfg = self.view.config()
        self.settings = self.cfg.syncer
        self.fragments = self.view.fragments(self.cfg)
        self.lease = ShardLease(estore, shard, owner, self.settings.lease_s, clock)
        self.merger = self.merger_for(self.cfg, self.fragments)
        self.outcome = DrainOutcome("idle")
        self.stop_requested = False  # request_stop(): SIGTERM

    def request_stop(self) -> None:
        """Ask a drain to end after the merge in progress (safe from a signal handler: it only
        sets a flag): it promotes its light HEADs and returns "terminated"."""
        self.stop_requested = True

    def _promote(self) -> None:
        """Promote the light HEADs this shard's merger holds warm before its memory goes
        (Merger.promote_heads); a store error here is logged: a cold start replays instead."""
        try:
            self.merger.promote_heads()
        except (TransientStoreError, StoreUnreachable) as exc:
            log.warning("shard %d: light HEADs not promoted: %s", self.shard, exc)

    def _default_merger(self, cfg: ExperimentConfig, fragments: list[int]):
        from training.merge.merger import Merger  # jax: only in the process that merges

        return Merger(cfg, self.estore, clock=self.clock, fragments=fragments)

    def _reload(self) -> None:
        """Re-read config.json: islands may have joined (a new merger sees them)."""
        cfg = self.view.config()
        if cfg != self.cfg:
            self.cfg = cfg
            self.merger = self.merger_for(cfg, self.fragments)

    def _merge(self):
        result = self.merger.merge_once()
        if result.applied:
            self.outcome.merges += 1
            self.outcome.applied += len(result.applied)
            self.on_merge(result)
            self._housekeep()
        return result

    def _housekeep(self) -> None:
        now = self.clock()
        if not housekeeping_due(now, self.housekept_at, self.housekeeping_every_s):
            return
        self.housekept_at = now
        try:
            self.housekeeping()
        except Exception as exc:  # the bucket's retention must never stop a merge
            log.warning("shard %d: housekeeping failed: %s", self.shard, exc)

    def drain(self) -> DrainOutcome:
        """Merge until idle for `idle_s`, finished (after a last drain), or standing by."""
        self.outcome = DrainOutcome("idle")
        if not self.lease.acquire():
            self._reload()
            if self.view.finished(self.cfg):
                self.outcome.reason = "finished"  # the live owner does the last drain
            else:
                self.outcome.reason = "standby"
            return self.outcome
        poll_s, idle_s = self.settings.poll_s, self.settings.idle_s
        last_progress = self.clock()
        wake_at: float | None = None
        merge_now, errors = True, 0
        while True:
            try:
                if self.stop_requested:
                    self._promote()
                    self.lease.release()
                    self.outcome.reason = "terminated"
                    return self.outcome
                if self.lease.renew_due() and not self.lease.acquire():
                    self.outcome.reason = "lease_lost"
                    return self.outcome
                if merge_now:
                    result = self._merge()
                    if result.applied or result.lost_race:
                        last_progress = self.clock()
                        errors = 0
                        continue
                    wake_at = result.waiting_until
                self._reload()
                if self.view.finished(self.cfg):
                    self._last_drain()
                    self._promote()  # waits for background writes still in flight
                    self.lease.release()
                    self.outcome.reason = "finished"
                    return self.outcome
                now = self.clock()
                if wake_at is None and now - last_progress >= idle_s:
                    self.outcome.pending = self.view.pending(self.cfg)
                    self._promote()  # the caller defers: this process's memory goes
                    self.outcome.reason = "idle"
                    return self.outcome
                nap = poll_s if wake_at is None else min(poll_s, max(0.0, wake_at - now))
                if nap > 0:
                    self.sleep(nap)
                if wake_at is not None and self.clock() >= wake_at:
                    merge_now, wake_at = True, None
                else:
                    merge_now = bool(self.view.pending(self.cfg))
                errors = 0
            except (TransientStoreError, StoreUnreachable) as exc:
                errors += 1
                if errors >= MAX_ERRORS:
                    raise
                log.warning("shard %d: store error %d/%d: %s", self.shard, errors, MAX_ERRORS, exc)
                self.sleep(poll_s)
                merge_now = True

    def _last_drain(self, max_attempts: int = 50) -> None:
        """Merge everything left (a grace window is waited out; a lost race is retried); with
        syncer.full_every > 1 these merges write full versions (the run ends on them)."""
        self.merger.full_always = True
        for _ in range(max_attempts):
            result = self._merge()
            if result.applied or result.lost_race:
                continue
            if result.waiting_until is None:
                return
            self.sleep(max(0.0, min(result.waiting_until - self.clock(), 60.0)))
