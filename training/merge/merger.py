"""The merger: apply every committed, unapplied pseudo-gradient exactly once, per fragment.

A `Merger` owns a set of fragments (a syncer shard: all of them by default). One `merge_once()`
makes, for each owned fragment with work, at most one new version:
1. read the fragment's HEAD and manifest; re-create the ledger entries of its `applied` list (a
   crash after the HEAD swap but before the ledger writes is repaired here);
2. find pending pseudo-gradients without listing the history: per island, the listing starts
   after the smallest cursor (`merge_state.cursors[island]`, the highest seq applied) of the
   owned fragments; quarantined ones are skipped;
3. admit each by its manifest (training/merge_rules.check_manifest), quarantining the bad ones;
4. let the method decide what to apply now (quorum, grace window, sync);
5. stream: load the fragment's params and outer state once (or keep the arrays of the version
   this merger published last, if HEAD still names it: `warm_bytes`, from the shard's memory
   by training/merge/memory.py; a light HEAD with
   nothing warm is replayed forward from its full ancestor: replay.state_at), read each contribution
   chunk by chunk from its codes (checked as decoded, its norms in the same pass), fold each
   island's vote into one float32 accumulator, apply the outer step in place, chunk by chunk;
6. write the new version (payloads, manifest, then HEAD by compare-and-swap from the head read
   in step 1; a light one without outer state and shadow, and under update broadcast without
   params, unless full is due: `syncer.full_every`) and the ledger entries. Losing the race publishes nothing: the next attempt starts
   again at 1.
So a contribution is applied at most once (only a version that won the CAS counts, and its
cursors and `applied` list are what the next attempt reads) and at least once (it stays pending
until a version of its fragment names it). Fragments are independent: two shards never contend.

The arithmetic of step 5 (votes, combination, outer step) is training/merge/apply.py, shared
with `diloco replay`. Length: about 500 lines, on purpose: the decisions are in rules.py, the
arithmetic in apply.py and stream.py; what is left is the I/O of one merge round in the order
above, which reads best unbroken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from training.codecs import host as codecs
from training.codecs import native
from training.config.experiment import ExperimentConfig
from training.merge import apply, memory, quorum, replay, rules, timing
from training.merge import stream as merge_stream
from training.merge.fetch import Prefetch
from training.merge.promote import BackgroundPromotions
from training.model import definition as model
from training.model.runtime import fragment_names
from training.protocol import broadcast, claims, rounds
from training.store import merge_records as records
from training.store.buffers import BufferPool
from training.store.experiment import ExperimentStore, HeadPointer, PseudoGradRef
from training.store.objectstore import StoreError, StoreUnreachable, TransientStoreError
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
        state = rules.init_state(cfg.outer, {n: v.shape for n, v in frag.items()})
        ms = records.MergeState(state.steps, state.seen, version_times={"0": time.time()})
        extra = dict(tokens_merged=0, merge_state=ms.to_json())
        created |= store.publish_fragment(p, 0, frag, rules.state_tensors(state), extra) is not None
    return 0 if created else None


class Warm(NamedTuple):
    """A fragment version's state a merger keeps resident for its next merge of it."""

    dir: str  # the version's directory (HEAD must still name it)
    params: dict
    outer: dict  # the outer-state tensors
    shadow: dict | None  # the broadcast shadow (None: broadcast off, or S = params)
    nbytes: int
    params_sq: dict | None  # the params' per-chunk sums of squares (the outer step took them)


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
        # fragment -> the arrays of the version this merger published last
        self._warm: dict[int, Warm] = {}
        self._arena = merge_stream.Arena()  # the accumulators, reused merge after merge
        # the payloads' read buffers and the update's codes, reused merge after merge
        self._buffers = BufferPool()
        native.set_threads(cfg.syncer.threads)  # the C loops over chunks (the same bits)
        self.store = store
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
        shapes = {k: tuple(v.shape) for k, v in model.abstract_params(cfg.model).items()}
        self.shapes = [{n: shapes[n] for n in names} for names in self.frags]
        # the state kept resident between merges (training/merge/memory.py): all of it when
        # the shard's memory holds it, else the most recently merged fragments'
        if warm_bytes is None:
            frags = memory.shard_memory(cfg, self.fragments, self.shapes)
            budget = memory.shard_budget(cfg)
            memory.check_fits(frags, budget, f"merge shard of fragments {self.fragments}")
            warm_bytes = memory.warm_limit(frags, budget)
            if warm_bytes < sum(f.state for f in frags):
                log.warning(
                    "%s keeps %s of the %s of state of fragments %s resident: the others "
                    "start cold (syncer.memory_gib, docs/AIRFLOW.md)",
                    memory.size(budget),
                    memory.size(warm_bytes),
                    memory.size(sum(f.state for f in frags)),
                    self.fragments,
                )
        self.warm_bytes = warm_bytes
        self._fragment_limits = [apply.fragment_limits(s) for s in self.shapes]
        self._snapshot_at = 0.0
        # version dir -> (manifest, its merge state) (immutable once committed)
        self._manifests: dict[str, tuple[dict, records.MergeState]] = {}
        self._repaired: set[str] = set()  # version dirs whose ledger entries this merger wrote
        self._fetch = Prefetch([], self._load_payload, 1)  # a merge's payload downloads
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
        # the last merge's payloads are dead: its downloads stopped, its buffers free again
        self._fetch.close(wait=True)
        self._buffers.release_all()
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
            reason = rules.check_manifest(
                self.cfg,
                ref.id,
                ref.island,
                ref.seq,
                ref.fragment,
                ref.manifest,
                -1,
                None,
                ref.error,
            )
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
            if pending[head.fragment]:
                self._merge_fragment(
                    head,
                    *versions[head.fragment],
                    pending[head.fragment],
                    active,
                    result,
                    beats,
                    ending,
                )
        result.skipped = self.store.skipped.count - skipped_before
        if result.versions:
            self._after_merge(result)
        return result

    def _set_round_clock(self, candidates: Sequence[rules.Candidate]) -> None:
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
        `outer.end_max_staleness` are held back (rules.held_back_at_end)."""
        started = time.monotonic()
        p = head.fragment
        base_times, previous = claims.history(ms)
        round_ = claims.Round(
            claims.Limits.from_config(self.cfg), self.clock(), base_times, previous, beats
        )
        candidates, rejected = [], {}
        for ref in sorted(refs, key=lambda r: (r.island, r.seq)):
            checked = rules.check_manifest(
                self.cfg,
                ref.id,
                ref.island,
                ref.seq,
                p,
                ref.manifest,
                head.version,
                round_,
                ref.error,
            )
            if isinstance(checked, str):
                rejected[ref.id] = checked
            elif ending and (held := rules.held_back_at_end(self.cfg.outer, checked.staleness)):
                rejected[ref.id] = held
            else:
                candidates.append(checked)
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
        groups, wait = rules.select(
            self.cfg,
            candidates,
            active,
            now,
            ms.sync_s,
            min(seen.values(), default=now),
            k,
            k_wait_s,
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
        state = rules.state_from_tensors(
            self.cfg.outer, self.shapes[p], outer_tensors, ms.steps, ms.seen
        )
        del outer_tensors
        cursors = dict(ms.cursors)
        last_claim = ms.last_claim
        tokens_merged = int(manifest["tokens_merged"])
        self._prefetch(groups)
        done = apply.apply_groups(
            self.cfg,
            self.shapes[p],
            head.version,
            params,
            state,
            ms.norms,
            groups,
            [rules.capped_weights(self.cfg.outer, g) for g in groups],
            len(active),
            apply.Io(
                lambda c, *limits: self._fetch.get(c.id, (c, *limits)),
                lambda pg_id, reason: self._quarantine(pg_id, reason, result),
                self._base_params,
            ),
            self._arena,
            params_sq,
            stages,
        )
        state, norms, details = done.state, done.norms, done.details
        applied = [c.id for c in done.applied]
        for c in done.applied:
            cursors[c.island] = max(cursors.get(c.island, -1), c.seq)
            tokens_merged += c.tokens
            last_claim = claims.remember(last_claim, self._claim(c))
        if not applied:
            return
        sync_s = 0.8 * ms.sync_s + 0.2 * (time.monotonic() - started)
        merged_at = self.clock()
        times = claims.version_times(
            ms, head.version + 1, merged_at, self.cfg.outer.max_staleness + 1
        )
        next_ms = records.MergeState(
            steps=state.steps,
            seen=state.seen,
            cursors=cursors,
            norms=tuple(norms[-rules.NORM_HISTORY :]),
            sync_s=sync_s,
            version_times=times,
            last_claim=last_claim,
        )
        extra = dict(
            tokens_merged=tokens_merged,
            merge_state=next_ms.to_json(),
            contributions=details,
            merged_at=merged_at,
        )
        with stages("encode"):
            payloads, shadow = broadcast.version_payloads(
                params, shadow, self.cfg.codec, extra, self._buffers.take
            )
        full_at = self._full_ancestor(head, manifest)
        due = self._full_due(p, head.version + 1, full_at, tokens_merged)
        # a periodic full version goes light now and is promoted in the background (the
        # ending ones are written full by the merge: a run ends on full versions)
        later = due and self._full_later(tokens_merged)
        light = not due or later
        if light and payloads is not None:
            payloads = {n: t for n, t in payloads.items() if n != broadcast.SHADOW}
        # a light version with an update leaves its params out (their checksum recorded),
        # unless stale votes read base versions' params (outer.anchor "now")
        kept = not light or payloads is None or self.cfg.outer.anchor == "now"
        with stages("write"):
            new = self.store.publish_fragment(
                p,
                head.version + 1,
                params,
                None if light else rules.state_tensors(state),
                extra,
                applied,
                expected=head,
                payloads=payloads,
                full_at=full_at if light else None,
                params_kept=kept,
            )
        if new is None:
            log.info("fragment %d: lost the head race at version %d", p, head.version + 1)
            result.lost_race = True
            return
        outer_tensors = rules.state_tensors(state)
        self._keep_warm(p, new.dir, params, outer_tensors, shadow, done.params_sq)
        if later:
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

    def _full_later(self, tokens: int) -> bool:
        """Whether a due full version is written in the background (syncer.full_in_background,
        full_every > 1), not by the merge: never for the run's ending merges (the last
        drain, control/STOP, the token budget reached)."""
        syncer = self.cfg.syncer
        ending = self.full_always or self._stopped or tokens >= self.cfg.token_budget
        return syncer.full_in_background and syncer.full_every > 1 and not ending

    def _full_due(self, p: int, version: int, full_at: tuple[int, str], tokens: int) -> bool:
        """Whether the new `version` is written full (docs/STORE.md, "Light versions"): always
        with syncer.full_every = 1; else every full_every-th version, once full_every_s passed
        since the full ancestor was written, in the syncer's last drain, once control/STOP
        exists, and once the fragment's `tokens` merged reach the token budget (the merge that
        ends a run on its budget, and every one after it, is full)."""
        every, every_s = self.cfg.syncer.full_every, self.cfg.syncer.full_every_s
        if every == 1 or version % every == 0 or self.full_always:
            return True
        if tokens >= self.cfg.token_budget:
            return True
        if every_s > 0:
            created = self._version(HeadPointer(p, *full_at, 0))[0].get("created_at", 0.0)
            if time.time() - float(created) >= every_s:
                return True
        return self._stopped

    def _quorum(
        self, p: int, candidates: Sequence[rules.Candidate], active: set[str], now: float
    ) -> tuple[int | None, float | None]:
        """(K, the longest wait for it) of fragment p's merge now: `outer.quorum` as configured
        (None, None), or with "auto" the K of training/merge/quorum.auto_quorum from the live
        islands' heartbeats and the round period, waiting at most one round. Logs each change."""
        if self.cfg.outer.quorum != "auto" or not candidates:
            return None, None
        round_s = self._round_period(candidates)
        window = quorum.live_window(self.cfg.heartbeat_s, round_s)
        live = quorum.live_islands(self._heartbeats, active, now, window)
        facts = quorum.QuorumFacts(
            len(live), round_s, quorum.slowest_download_s(live), len(self.frags)
        )
        k = quorum.auto_quorum(facts)
        if self._k.get(p) != k:
            log.info("fragment %d: quorum K %s -> %d (%s)", p, self._k.get(p), k, facts)
            self._k[p] = k
        return k, round_s

    def _round_period(self, candidates: Sequence[rules.Candidate]) -> float | None:
        """The round period: the shared round clock's (read once: it is create-only), else H
        times the candidates' median step time (None when no step time is known)."""
        if self._period is None and rounds.clock_rounds(self.cfg):
            clock = self.store.round_clock()
            self._period = None if clock is None else clock[1]
        if self._period is not None:
            return self._period
        step_s = rules.median_step_s(candidates)
        return self.cfg.inner.H * step_s if step_s > 0 else None

    def _fragment_arrays(self, head: HeadPointer, manifest: dict):
        """(params, outer-state tensors, broadcast shadow, the params' per-chunk sums of
        squares or None) of the version `head` names,
        writable: the arrays this merger published as that very version if it still holds them
        (HEAD names the directory it wrote: the bytes are those it checksummed), else read and
        verified from the store. The shadow is None when broadcast is off or the version has
        none (then S = its params). Taken out of the warm set either way: the merge mutates
        them."""
        self._promotions.wait(head.fragment)  # its arrays may still be being written
        warm = self._warm.pop(head.fragment, None)
        if warm is not None and warm.dir == head.dir:
            shadow = warm.shadow if broadcast.enabled(self.cfg) else None
            return warm.params, warm.outer, shadow, warm.params_sq
        if records.light_ancestor(manifest) is None:
            arrays = apply.load_arrays(
                self.cfg, self.store, head, manifest, self.shapes[head.fragment]
            )
            return (*arrays, None)
        # a light HEAD and nothing warm (a cold start: after a crash, on another worker): its
        # nearest full version and the merges since re-applied, each checked (replay.state_at)
        started = time.monotonic()
        state = replay.state_at(
            self.cfg,
            self.store,
            self.shapes[head.fragment],
            head,
            manifest,
            lambda version: self.store.hit_fault("merge.cold-replay"),
        )
        log.info(
            "fragment %d: cold start at version %d, replayed from its full version in %.2f s",
            head.fragment,
            head.version,
            time.monotonic() - started,
        )
        return state.params, state.outer, state.shadow, None

    def _keep_warm(
        self,
        fragment: int,
        directory: str,
        params: dict,
        outer_tensors: dict,
        shadow: dict | None = None,
        params_sq: dict | None = None,
    ):
        """Hold a just-published version's arrays (and its params' norm terms) for the next
        merge of its fragment, within `warm_bytes` in all (the oldest let go first)."""
        size = sum(v.nbytes for d in (params, outer_tensors, shadow or {}) for v in d.values())
        self._warm[fragment] = Warm(directory, params, outer_tensors, shadow, size, params_sq)
        while sum(w.nbytes for w in self._warm.values()) > self.warm_bytes:
            self._warm.pop(next(iter(self._warm)))

    def promote_heads(self) -> list[int]:
        """Promote each owned fragment's light HEAD this merger holds warm (it published that
        very version and nothing has merged it since): its params, outer state and shadow
        written beside it (training/store/promotions.py), so that whoever merges it next starts
        there instead of replaying the merges since its full ancestor. What the syncer does
        before its memory goes: on SIGTERM, before deferring when idle, at the end of `diloco
        merge`. Returns the fragments promoted now; a HEAD another merger moved is left."""
        self._promotions.wait_all()
        promoted = []
        for p in self.fragments:
            warm = self._warm.get(p)
            head = self.store.head(p)
            if warm is None or head is None or head.dir != warm.dir:
                continue
            manifest = self._version(head)[0]
            params, outer_tensors, shadow = warm.params, warm.outer, warm.shadow
            if broadcast.enabled(self.cfg) and shadow is None:
                shadow = params  # S = Theta (a version made without a shadow)
            if self.store.promote_version(head, manifest, params, outer_tensors, shadow):
                log.info("fragment %d: promoted light version %d", p, head.version)
                self._promotions.promoted[p] = (head.version, head.dir)  # later ones name it
                promoted.append(p)
        return promoted

    def _load_payload(self, item) -> dict[str, np.ndarray]:
        c, max_nbytes, max_header = item
        return self.store.load_pseudograd(
            self._ref(c),
            max_nbytes,
            max_header,
            f" of fragment {c.fragment} in {c.codec}",
            into=self._buffers.take,
        )

    def _prefetch(self, groups) -> None:
        """Start fetching the payloads of `groups` in the order `_vote` sums them
        (training/merge/fetch.py): groups, islands sorted, contributions in group order."""
        self._fetch.close()  # an earlier merge's, if it ended early (an error)
        order = []
        for group in groups:
            for c in sorted(group, key=lambda c: c.island):  # stable: group order per island
                limits = codecs.payload_limits(self.shapes[c.fragment], c.codec)
                order.append((c.id, (c, *limits)))
        self._fetch = Prefetch(order, self._load_payload, self.cfg.syncer.fetch_concurrency)

    def _base_params(self, fragment: int, version: int) -> dict | None:
        """The params of fragment version `version`, for a stale vote re-anchored at the
        fragment as it stands (apply._anchored_now). A version the store no longer holds
        (garbage-collected) or refuses: None (the vote stays anchored at its base), logged."""
        try:
            at = self.store.find_version(fragment, version)
            return self.store.load_fragment(at, max_nbytes=self._fragment_limits[fragment]).params
        except (TransientStoreError, StoreUnreachable):
            raise  # the store's fault, not the base's: retry later
        except StoreError as err:  # collected (ObjectNotFound) or refused
            log.warning(
                "fragment %d: version %d unreadable, votes anchored at it stay so: %s",
                fragment,
                version,
                err,
            )
            return None

    @staticmethod
    def _claim(c: rules.Candidate) -> claims.Claim:
        step = c.manifest.get("island_step")
        return claims.Claim(
            c.island,
            c.fragment,
            c.seq,
            0,
            c.steps,
            c.tokens,
            c.published_at if "published_at" in c.manifest else None,
            step if isinstance(step, int) else None,
        )

    def _ref(self, c: rules.Candidate) -> PseudoGradRef:
        payload = c.manifest.get("payload")
        return PseudoGradRef(
            c.island,
            c.seq,
            c.fragment,
            c.id,
            dict(c.manifest),
            payload if isinstance(payload, str) else "",
        )

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
