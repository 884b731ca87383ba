"""The merger: apply every committed, unapplied pseudo-gradient exactly once, per fragment.

A `Merger` owns a set of fragments (a syncer shard: all of them by default). One `merge_once()`
makes, for each owned fragment with work, at most one new version:
1. read the fragment's HEAD and manifest; re-create the ledger entries of its `applied` list (a
   crash after the HEAD swap but before the ledger writes is repaired here);
2. find pending pseudo-gradients without listing the history: per island, the listing starts
   after the smallest cursor (`merge_state.cursors[island]`, the highest seq applied) of the
   owned fragments; quarantined ones are skipped;
3. admit each by its manifest (admit.judge), quarantining the bad ones;
4. let the method decide what to apply now (selection.select; K from quorum.py);
5. stream: take the fragment's params and outer state (warm.FragmentStates: the arrays of the
   version this merger published last if HEAD still names it, else read, or a light HEAD
   replayed forward from its full ancestor), read each contribution chunk by chunk from its
   codes (reads.MergeReads), fold each island's vote into one float32 accumulator and apply the
   outer step in place, chunk by chunk (apply.apply_groups, shared with `diloco replay`);
6. write the new version (payloads, manifest, then HEAD by compare-and-swap from the head read
   in step 1; light or full as light.plan says) and the ledger entries, with its merge state
   (merge_state.after_merge). Losing the race publishes nothing: the next attempt starts again
   at 1.
So a contribution is applied at most once (only a version that won the CAS counts, and its
cursors and `applied` list are what the next attempt reads) and at least once (it stays pending
until a version of its fragment names it). Fragments are independent: two shards never contend.

Every decision is a pure function of the modules named above; this module is the I/O of one
merge round, in the order above.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from training.codecs import native
from training.config.experiment import ExperimentConfig
from training.merge import (
    admit,
    apply,
    light,
    memory,
    merge_state,
    outer,
    quorum,
    selection,
    timing,
)
from training.merge import stream as merge_stream
from training.merge.promote import BackgroundPromotions
from training.merge.reads import MergeReads
from training.merge.warm import FragmentStates
from training.model import definition as model
from training.model.runtime import fragment_names, fragment_shapes
from training.protocol import broadcast, claims, rounds
from training.store import merge_records as records
from training.store.experiment import ExperimentStore, HeadPointer, PseudoGradRef
from training.store.faces import MergeFace
from training.store.tensorboard import ScalarWriter, merge_run, merge_scalars

log = logging.getLogger("diloco.merge")

SNAPSHOT_EVERY_S = 10.0  # a merger records the current snapshot at most this often


@dataclass
class MergeResult:
    versions: dict[int, int] = field(default_factory=dict)  # fragment -> version published
    applied: list[str] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)
    waiting_until: float | None = None  # grace window: try again at this time
    lost_race: bool = False
    tokens_merged: int | None = None  # mean over the owned fragments after this round
    contributions: list[dict] = field(default_factory=list)
    skipped: int = 0  # objects skipped this round (junk names, broken records): counted
    # seconds per stage of this round's merges (training/merge/timing.py), added up
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def version(self) -> int | None:
        """The highest fragment version this round published (None: nothing published)."""
        return max(self.versions.values()) if self.versions else None


def initial_version(cfg: ExperimentConfig, store: ExperimentStore) -> int | None:
    """Create version 0 of every fragment (fresh parameters, zero outer state); None if the
    experiment already has them (a repeat after a crash completes what is missing)."""
    heads = store.heads(range(cfg.fragments.count))
    if all(h is not None for h in heads):
        return None
    params = {
        k: np.asarray(v, np.float32) for k, v in model.init_params(cfg.model, cfg.seed).items()
    }
    created = False
    for p, names in enumerate(fragment_names(cfg)):
        if heads[p] is not None:
            continue
        frag = {n: params[n] for n in names}
        state = outer.init_state(cfg.outer, {n: v.shape for n, v in frag.items()})
        ms = records.MergeState(state.steps, state.seen, version_times={"0": time.time()})
        extra = dict(tokens_merged=0, merge_state=ms.to_json())
        created |= store.publish_fragment(p, 0, frag, outer.state_tensors(state), extra) is not None
    return 0 if created else None


class Merger:
    def __init__(
        self,
        cfg: ExperimentConfig,
        store: ExperimentStore,
        clock: Callable[[], float] = time.time,
        fragments: Sequence[int] | None = None,
        warm_bytes: int | None = None,
    ):
        self.cfg = cfg
        self._arena = merge_stream.Arena()  # the accumulators, reused merge after merge
        native.set_threads(cfg.syncer.threads)  # the C loops over chunks (the same bits)
        self.store = store = MergeFace(store)  # the merge's face (training/store/faces.py)
        self.clock = clock
        self.frags = fragment_names(cfg)
        self.fragments = sorted(range(len(self.frags)) if fragments is None else set(fragments))
        # TensorBoard run "merge" or "merge-s{shard}" (merge_run): one event file per merge
        # pass that published (flush_s=0)
        run = merge_run(self.fragments, len(self.frags))
        self.tb = ScalarWriter(store, run, 0.0) if cfg.tensorboard.enabled else None
        bad = [p for p in self.fragments if not 0 <= p < len(self.frags)]
        if bad:
            raise ValueError(f"fragments {bad} out of range (P = {len(self.frags)})")
        self.shapes = fragment_shapes(cfg)
        # the state kept resident between merges (training/merge/memory.py): all of it when
        # the shard's memory holds it, else the most recently merged fragments'
        if warm_bytes is None:
            warm_bytes = memory.shard_warm_limit(cfg, self.fragments, self.shapes)
        self.warm_bytes = warm_bytes
        # the payloads (fetched ahead, into reused buffers) and re-anchored votes' base params
        self._reads = MergeReads(store, self.shapes, cfg.syncer.fetch_concurrency)
        # the payloads' read buffers and the update's codes, reused merge after merge
        self._buffers = self._reads.buffers
        self._snapshot_at = 0.0
        # version dir -> (manifest, its merge state) (immutable once committed)
        self._manifests: dict[str, tuple[dict, records.MergeState]] = {}
        self._repaired: set[str] = set()  # version dirs whose ledger entries this merger wrote
        self._round_clock_known = not rounds.clock_rounds(cfg)
        # fragment -> {candidate id: when this merger first saw it} (the grace floor's start;
        # rebuilt every pass from the pending candidates, so it holds no applied ones)
        self._seen: dict[int, dict[str, float]] = {}
        self._heartbeats: dict[str, dict] = {}  # this pass's (read when something is pending)
        self._k: dict[int, int] = {}  # outer.quorum = "auto": fragment -> its K last merge
        self._period: float | None = None  # the shared round clock's period, once known
        # syncer.full_every > 1: every merge writes a full version while this is set (the
        # syncer's last drain: a run ends on full versions)
        self.full_always = False
        self._stopped = False  # control/STOP as this pass read it (merge_once)
        # syncer.full_in_background: due full versions written beside light ones, meanwhile
        self._promotions = BackgroundPromotions(store)
        # the arrays of the versions this merger published last (training/merge/warm.py)
        self._states = FragmentStates(cfg, store, self.shapes, warm_bytes, self._promotions)
        self._warm = self._states.warm  # fragment -> Warm

    def _version(self, head: HeadPointer) -> tuple[dict, records.MergeState]:
        """The manifest of a committed version and its merge state, read and parsed once per
        version (a poll re-reads only the small HEAD pointers)."""
        if head.dir not in self._manifests:
            if len(self._manifests) > 4 * len(self.fragments):
                self._manifests.clear()
            manifest = self.store.fragment_manifest(head)
            ms = records.merge_state_of(manifest)
            cursors = self.store.checked_cursors(head.dir, manifest, ms.cursors)
            self._manifests[head.dir] = (manifest, replace(ms, cursors=cursors))
        return self._manifests[head.dir]

    def _active_islands(self) -> set[str]:
        gone = set(self.store.done()) | set(self.store.stopped_islands())
        return {i.name for i in self.cfg.islands} - gone

    # -- pending work ----------------------------------------------------------------------
    def pending(self) -> dict[int, list[PseudoGradRef]]:
        """Committed, unapplied, unquarantined pseudo-gradients per owned fragment (reads the
        heads' cursors; lists from there, never the history)."""
        heads = self.store.heads(self.fragments)
        cursors = {h.fragment: self._version(h)[1].cursors for h in heads if h}
        if len(cursors) != len(self.fragments):
            return {}
        return self.store.pending_after(cursors, [i.name for i in self.cfg.islands])

    # -- one round ---------------------------------------------------------------------------
    def merge_once(self) -> MergeResult:
        self._reads.reset()  # the last merge's payloads are dead
        result = MergeResult()
        skipped_before = self.store.skipped.count
        heads = self.store.heads(self.fragments)
        if any(h is None for h in heads):
            raise RuntimeError(f"experiment {self.cfg.name!r} has no global version: run init")
        versions = {h.fragment: self._version(h) for h in heads}
        for h in heads:
            if h.dir not in self._repaired:
                self.store.repair_ledger(h, versions[h.fragment][0])
                self._repaired.add(h.dir)
        cursors = {p: ms.cursors for p, (_, ms) in versions.items()}
        # contributions to no fragment of the experiment: quarantined by fragment 0's shard
        strays: list[PseudoGradRef] | None = [] if 0 in self.fragments else None
        pending = self.store.pending_after(
            cursors, [i.name for i in self.cfg.islands], strays, len(self.frags)
        )
        for ref in strays or ():
            reason = admit.check_ref(self.cfg, ref, ref.fragment, -1)
            if isinstance(reason, str):
                self._quarantine(ref.id, reason, result)
        self.store.hit_fault("merge.after-read")  # the store's fault plan (faults/points.py)
        active = self._active_islands()
        self._heartbeats = self.store.heartbeats() if any(pending.values()) else {}
        beats = claims.beats(self._heartbeats)
        # control/STOP, read once a pass and only where a rule uses it (the end's hold-back,
        # light versions' full one at the end)
        wants_stop = self.cfg.outer.end_max_staleness is not None or self.cfg.syncer.full_every > 1
        self._stopped = wants_stop and any(pending.values()) and self.store.stop_requested()
        ending = self.cfg.outer.end_max_staleness is not None and self._stopped
        for head in heads:
            p = head.fragment
            if pending[p]:
                self._merge_fragment(head, *versions[p], pending[p], active, result, beats, ending)
        result.skipped = self.store.skipped.count - skipped_before
        if result.versions:
            self._after_merge(result)
        return result

    def _set_round_clock(self, candidates: Sequence[admit.Candidate]) -> None:
        """Clock rounds (training/protocol/rounds.py): the first valid contribution to fragment 0 sets
        the islands' shared round clock, once (create-only: a racing shard's clock stands)."""
        if self.store.round_clock() is not None:
            self._round_clock_known = True
            return
        first = min(candidates, key=lambda c: (c.published_at, c.island))
        clock = rounds.clock_from_first(
            self.cfg, first.island, first.published_at, first.step_time_s, self.clock()
        )
        if clock is None:
            return  # no step time measured yet: the next contribution sets it
        self._round_clock_known = True
        if self.store.create_round_clock(*clock):
            log.info("round clock set from %s: t0 %.3f, period %.2f s", first.id, *clock)

    def _merge_fragment(
        self,
        head: HeadPointer,
        manifest: dict,
        ms: records.MergeState,
        refs: list[PseudoGradRef],
        active: set[str],
        result: MergeResult,
        beats: dict[str, claims.Beat],
        ending: bool = False,
    ) -> None:
        """One fragment's merge. `ending` (control/STOP exists): contributions staler than
        `outer.end_max_staleness` are held back (admit.judge)."""
        started = time.monotonic()
        p = head.fragment
        base_times, previous = claims.history(ms)
        round_ = claims.Round(
            claims.Limits.from_config(self.cfg), self.clock(), base_times, previous, beats
        )
        candidates, rejected = admit.judge(self.cfg, refs, p, head.version, round_, ending)
        if rejected:
            # Judge only against the current HEAD: a racing merger may have published a newer
            # version these are based on; then they wait for the next round.
            now_head = self.store.head(p)
            if now_head is None or now_head.dir != head.dir:
                log.info("fragment %d moved: not judging %s now", p, sorted(rejected))
                return
            for pg_id, reason in rejected.items():
                self._quarantine(pg_id, reason, result)
        if p == 0 and candidates and not self._round_clock_known:
            self._set_round_clock(candidates)
        now = self.clock()
        seen = self._seen.get(p, {})
        self._seen[p] = seen = {c.id: seen.get(c.id, now) for c in candidates}
        k, k_wait_s = self._quorum(p, candidates, active, now)
        first_seen = min(seen.values(), default=now)
        groups, wait = selection.select(
            self.cfg, candidates, active, now, ms.sync_s, first_seen, k, k_wait_s
        )
        if wait is not None:
            result.waiting_until = min(result.waiting_until or wait, wait)
        if not groups:
            return

        stages = timing.Stages()
        with stages("state"):
            params, outer_tensors, shadow, params_sq = self._fragment_arrays(head, manifest)
        if broadcast.enabled(self.cfg) and shadow is None:
            shadow = {n: v.copy() for n, v in params.items()}  # S = Theta: params change below
        state = outer.state_from_tensors(
            self.cfg.outer, self.shapes[p], outer_tensors, ms.steps, ms.seen
        )
        del outer_tensors
        self._reads.start(groups)
        pending = broadcast.pending_update(shadow, self.cfg.codec, self._buffers.take)
        done = apply.apply_groups(
            self.cfg,
            self.shapes[p],
            head.version,
            params,
            state,
            ms.norms,
            groups,
            [selection.capped_weights(self.cfg.outer, g) for g in groups],
            len(active),
            apply.Io(
                self._reads.payload,
                lambda pg_id, reason: self._quarantine(pg_id, reason, result),
                self._reads.base_params,
            ),
            self._arena,
            params_sq,
            stages,
            pending,
        )
        state, details = done.state, done.details
        applied = [c.id for c in done.applied]
        if not applied:
            return
        took_s = time.monotonic() - started
        merged_at = self.clock()
        next_ms, tokens_merged = merge_state.after_merge(
            self.cfg,
            ms,
            head.version + 1,
            int(manifest["tokens_merged"]),
            state,
            done.norms,
            done.applied,
            took_s,
            merged_at,
        )
        extra = dict(
            tokens_merged=tokens_merged,
            merge_state=next_ms.to_json(),
            contributions=details,
            merged_at=merged_at,
        )
        with stages("encode"):
            payloads, shadow = broadcast.version_payloads(
                params, shadow, self.cfg.codec, extra, self._buffers.take, pending
            )
        full_at = self._full_ancestor(head, manifest)
        how = light.plan(
            self.cfg,
            head.version + 1,
            tokens_merged,
            self.full_always,
            self._stopped,
            lambda: self._age_s(p, full_at),
            payloads is not None,
        )
        if how.light and payloads is not None:
            payloads = {n: t for n, t in payloads.items() if n != broadcast.SHADOW}
        with stages("write"):
            new = self.store.publish_fragment(
                p,
                head.version + 1,
                params,
                None if how.light else outer.state_tensors(state),
                extra,
                applied,
                expected=head,
                payloads=payloads,
                full_at=full_at if how.light else None,
                params_kept=how.params_kept,
            )
        if new is None:
            log.info("fragment %d: lost the head race at version %d", p, head.version + 1)
            result.lost_race = True
            return
        outer_tensors = outer.state_tensors(state)
        self._states.keep(p, new.dir, params, outer_tensors, shadow, done.params_sq)
        if how.background:
            self._promotions.submit(new, params, outer_tensors, shadow)
        result.versions[p] = new.version
        result.applied += applied
        for name, seconds in stages.seconds.items():
            result.stages[name] = result.stages.get(name, 0.0) + seconds
        result.contributions += details
        for d in details:
            d["merged_at"] = merged_at

    def _full_ancestor(self, head: HeadPointer, manifest: dict) -> tuple[int, str]:
        """(version, dir) of the nearest full version at or below `head` (itself if full), or
        the newer light one this merger promoted since (merge/promote.py)."""
        named = records.light_ancestor(manifest) or (head.version, head.dir)
        return self._promotions.ancestor(
            head.fragment, named, lambda v, d: self._on_chain(head, v, d)
        )

    def _on_chain(self, head: HeadPointer, version: int, directory: str) -> bool:
        """Whether version `version` in `directory` is `head` or one of its ancestors (walks
        parent_dir from `head`, the manifests read once)."""
        at = head
        while at.version > version:
            manifest = self._version(at)[0]
            at = HeadPointer(head.fragment, manifest["parent_version"], manifest["parent_dir"], 0)
        return at.version == version and at.dir == directory

    def _age_s(self, fragment: int, version: tuple[int, str]) -> float:
        """Seconds since version (number, dir) of `fragment` was written (its created_at)."""
        created = self._version(HeadPointer(fragment, *version, 0))[0].get("created_at", 0.0)
        return time.time() - float(created)

    def _quorum(
        self, p: int, candidates: Sequence[admit.Candidate], active: set[str], now: float
    ) -> tuple[int | None, float | None]:
        """(K, the longest wait for it) of fragment p's merge now: `outer.quorum` as configured
        (None, None), or with "auto" the K of training/merge/quorum.auto_quorum from the live
        islands' heartbeats and the round period, waiting at most one round. Logs each change."""
        if self.cfg.outer.quorum != "auto" or not candidates:
            return None, None
        step_s = selection.median_step_s(candidates)
        round_s = quorum.round_period(self.cfg.inner.H, self._clock_period(), step_s)
        facts = quorum.facts_of(
            self._heartbeats, active, now, self.cfg.heartbeat_s, round_s, len(self.frags)
        )
        k = quorum.auto_quorum(facts)
        if self._k.get(p) != k:
            log.info("fragment %d: quorum K %s -> %d (%s)", p, self._k.get(p), k, facts)
            self._k[p] = k
        return k, round_s

    def _clock_period(self) -> float | None:
        """The shared round clock's period, read once (it is create-only); None before it is
        set, or without clock rounds."""
        if self._period is None and rounds.clock_rounds(self.cfg):
            clock = self.store.round_clock()
            self._period = None if clock is None else clock[1]
        return self._period

    def _fragment_arrays(self, head: HeadPointer, manifest: dict):
        """The writable arrays of the version `head` names (warm.FragmentStates.take)."""
        return self._states.take(head, manifest)

    def promote_heads(self) -> list[int]:
        """Promote each owned fragment's light HEAD this merger holds warm (it published that
        very version and nothing has merged it since): its full state written beside it
        (warm.FragmentStates.promote_heads), so that whoever merges it next starts there
        instead of replaying the merges since its full ancestor. What the syncer does before
        its memory goes: on SIGTERM, before deferring when idle, at the end of `diloco merge`.
        Returns the fragments promoted now; a HEAD another merger moved is left."""
        return self._states.promote_heads(self.fragments, lambda h: self._version(h)[0])

    def _quarantine(self, pg_id: str, reason: str, result: MergeResult) -> None:
        self.store.quarantine(pg_id, reason)
        result.quarantined[pg_id] = reason
        log.warning("quarantined %s: %s", pg_id, reason)

    def _after_merge(self, result: MergeResult) -> None:
        """Budget, metrics and (at most every SNAPSHOT_EVERY_S) a snapshot, after a round."""
        heads = self.store.heads(self.fragments)
        manifests = [self._version(h)[0] for h in heads if h is not None]
        result.tokens_merged = sum(int(m["tokens_merged"]) for m in manifests) // max(
            len(manifests), 1
        )
        if result.tokens_merged >= self.cfg.token_budget:
            self.store.request_stop(reason="budget")
        now = self.clock()
        self.store.append_metric(
            "merge",
            dict(
                versions={str(p): v for p, v in result.versions.items()},
                version=result.version,
                applied=len(result.applied),
                quarantined=len(result.quarantined),
                skipped=result.skipped,
                tokens_merged=result.tokens_merged,
                stages={k: round(v, 4) for k, v in result.stages.items()},
                contributions=result.contributions,
                at=now,
            ),
        )
        if self.tb is not None:
            for tag, value, step in merge_scalars(result):
                self.tb.add(tag, value, step)
            self.tb.flush()
        if now - self._snapshot_at >= SNAPSHOT_EVERY_S:
            snapshot = self.store.current_snapshot()
            if snapshot is not None:
                self.store.record_snapshot(snapshot, {"by": "merge"})
                self._snapshot_at = now

    def merge_all(self, max_attempts: int = 20) -> list[MergeResult]:
        """Merge until nothing is left to apply now (retrying lost races)."""
        results = []
        for _ in range(max_attempts):
            r = self.merge_once()
            results.append(r)
            if not r.versions and not r.lost_race:
                break
        return results
