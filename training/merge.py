"""The merger: apply every committed, unapplied pseudo-gradient exactly once.

One `merge_once()` is one attempt at one new global version:
1. read HEAD; re-create the ledger entries of HEAD's `applied` list (a crash after the head
   compare-and-swap but before the ledger writes is repaired here; by induction every older
   version's entries exist);
2. list committed pseudo-gradients, drop those already in the ledger or in quarantine;
3. validate each (manifest, tree, shapes, dtypes, finiteness, checksum, staleness, replay) and
   quarantine the bad ones with a reason — the merge goes on without them;
4. let the outer method decide which contributions to apply now (quorum, grace window, sync);
5. write the new version (payload first, manifest last) and advance HEAD by compare-and-swap
   from the head read in step 1. Losing the race publishes nothing: the caller retries from the
   new head, whose ledger repair (step 1) makes the winner's contributions visible as applied;
6. write the ledger entries.
So a contribution is applied at most once (only a version that won the CAS counts, and the next
attempt reads its `applied` list), and at least once (it stays pending until a version names it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from training import claims, codecs, model, outer
from training.config import ExperimentConfig
from training.island import fragment_names
from training.pytree import named_to_state, state_to_named
from training.store import records
from training.store.experiment import ExperimentStore, GlobalVersion, PseudoGradRef
from training.store.objectstore import StoreError, StoreUnreachable, TransientStoreError

log = logging.getLogger("diloco.merge")

NORM_HISTORY = 64


@dataclass
class _Round:
    """What one merge_once knows to bound claims (training/claims.py): the limits, the merger's
    clock, when recent versions were published, each island's last applied claim and heartbeat,
    and the claims accepted so far in this round."""

    limits: claims.Limits
    now: float
    base_times: dict[int, float]
    previous: dict[str, claims.Claim]
    heartbeats: dict[str, claims.Beat]
    accepted: dict[tuple[str, int], list[claims.Claim]] = field(default_factory=dict)

    def check(self, claim: claims.Claim) -> str | None:
        return claims.check_claim(
            claim,
            self.limits,
            self.now,
            base_time=self.base_times.get(claim.base_version),
            earlier=self.accepted.get((claim.island, claim.fragment), []),
            previous=self.previous.get(claim.island),
            heartbeat=self.heartbeats.get(claim.island),
        )

    def accept(self, claim: claims.Claim) -> None:
        self.accepted.setdefault((claim.island, claim.fragment), []).append(claim)
        self.previous[claim.island] = claim


def _beats(heartbeats: dict[str, dict]) -> dict[str, claims.Beat]:
    out = {}
    for island, hb in heartbeats.items():  # validated by records.parse_heartbeat
        if hb.get("step") is not None and hb.get("time") is not None:
            out[island] = claims.Beat(int(hb["step"]), float(hb["time"]))
    return out


def _remember(last_claim: dict[str, list], claim: claims.Claim) -> None:
    """Keep an island's newest applied claim (seq, island_step, published_at) in merge_state."""
    if claim.island_step is None or claim.published_at is None:
        return
    known = last_claim.get(claim.island)
    if isinstance(known, list) and known and records.is_real(known[0]) and known[0] >= claim.seq:
        return
    last_claim[claim.island] = [claim.seq, claim.island_step, claim.published_at]


def _claim_history(merge_state: dict) -> tuple[dict[int, float], dict[str, claims.Claim]]:
    """(version -> publish time, island -> last applied claim) kept in merge_state; entries
    that do not parse are ignored (they only loosen the bounds)."""
    times = {}
    for v, t in (merge_state.get("version_times") or {}).items():
        if isinstance(v, str) and v.isascii() and v.isdigit() and records.is_real(t):
            times[int(v)] = float(t)
    previous = {}
    for island, c in (merge_state.get("last_claim") or {}).items():
        if isinstance(c, list) and len(c) == 3 and all(records.is_real(x) for x in c):
            seq, step, at = c
            previous[island] = claims.Claim(island, 0, int(seq), 0, 1, 1, float(at), int(step))
    return times, previous


@dataclass
class Contribution:
    ref: PseudoGradRef
    delta: dict[str, np.ndarray]
    norm: float
    weight: float
    staleness: int
    arrived_at: float
    claim: claims.Claim | None = None


@dataclass
class MergeResult:
    version: int | None = None  # the version published, if any
    applied: list[str] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)
    waiting_until: float | None = None  # decoupled grace window: try again at this time
    lost_race: bool = False
    tokens_merged: int | None = None  # in the global model after this version
    skipped: int = 0  # objects skipped (junk names, broken heartbeats): counted, not fatal


def _per_island(group: list[Contribution]) -> tuple[list[dict], list[float]]:
    """One vote per island: an island's several pending contributions (published while a merge
    was late) become their weighted mean, with their summed weight."""
    by_island: dict[str, list[Contribution]] = {}
    for c in group:
        by_island.setdefault(c.ref.island, []).append(c)
    deltas, weights = [], []
    for contribs in by_island.values():
        ws = [c.weight for c in contribs]
        if len(contribs) == 1:
            deltas.append(contribs[0].delta)
        else:
            names = contribs[0].delta
            deltas.append(
                {n: outer.weighted_mean([c.delta[n] for c in contribs], ws) for n in names}
            )
        weights.append(float(sum(ws)))
    return deltas, claims.cap_weights(weights)


def initial_version(cfg: ExperimentConfig, store: ExperimentStore) -> int | None:
    """Create version 0 (fresh parameters, zero outer state); None if the experiment has one."""
    if store.head() is not None:
        return None
    params = {
        k: np.asarray(v, np.float32) for k, v in model.init_params(cfg.model, cfg.seed).items()
    }
    merger = Merger(cfg, store)
    state = merger.init_outer_state(params)
    extra = dict(
        fragment_versions=[0] * cfg.fragments.count,
        tokens_merged=0,
        merge_state=dict(norms=[], last_seq={}, sync_s=0.0, version_times={"0": time.time()}),
    )
    head = store.publish_global(0, params, state, extra, applied=[], expected=None)
    return None if head is None else 0


class Merger:
    def __init__(
        self,
        cfg: ExperimentConfig,
        store: ExperimentStore,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.frags = fragment_names(cfg)
        self.frag_of = {n: p for p, names in enumerate(self.frags) for n in names}
        self.shapes = {k: tuple(v.shape) for k, v in model.abstract_params(cfg.model).items()}
        self.tx = outer.outer_optimizer(cfg.outer, len(cfg.islands))

    # -- outer state: one serializable flat dict, "f000/0000" per leaf ------------------------

    def _frag_template(self, p: int):
        shapes = {n: jax.ShapeDtypeStruct(self.shapes[n], np.float32) for n in self.frags[p]}
        return jax.eval_shape(self.tx.init, shapes)

    def init_outer_state(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {}
        for p, names in enumerate(self.frags):
            state.update(state_to_named(self.tx.init({n: params[n] for n in names}), f"f{p:03d}/"))
        return state

    # -- validation -------------------------------------------------------------------------

    def _validate(
        self,
        ref: PseudoGradRef,
        head_version: int,
        merge_state: dict,
        params_norm: float | None = None,
        round_: _Round | None = None,
    ) -> Contribution | str:
        """A checked contribution, or the reason to quarantine it.

        Norms: over k x the running median of merged norms (k = clip_multiplier; one vote per
        island, claims.norm_median) is clipped to it; over 1000x that and over k x
        `params_norm` it is quarantined. Until four norms are merged there is no median: a
        norm over 1000 x k x `params_norm` (the global parameters' norm) is quarantined.
        Manifests are parsed by records.parse_pseudograd_manifest, claims bounded by
        training/claims.py, payloads over codecs.payload_limits refused before they are read.
        """

        if ref.error is not None:
            return ref.error
        try:
            m = records.parse_pseudograd_manifest(ref.manifest, ref.id, self.cfg.name)
        except records.BadRecord as err:
            return str(err)
        if not 0 <= ref.fragment < len(self.frags):
            return f"fragment {ref.fragment} out of range (P = {len(self.frags)})"
        last = merge_state["last_seq"].get(f"{ref.island}/{ref.fragment}")
        if last is not None and ref.seq <= last:
            return f"replayed sequence number {ref.seq} (already merged up to {last})"
        base = m.base_version
        if base > head_version:
            return f"base_version {base!r} is not a committed version (head {head_version})"
        staleness = head_version - base
        if staleness > self.cfg.outer.max_staleness * len(self.frags):
            return f"stale: base version {base}, head {head_version}"
        steps, tokens, codec = m.steps, m.tokens, m.codec
        claim = claims.Claim.of(m)
        round_ = round_ or self._round(merge_state, {})
        reason = round_.check(claim)
        if reason is not None:
            return reason
        names = self.frags[ref.fragment]
        max_nbytes, max_header = codecs.payload_limits({n: self.shapes[n] for n in names}, codec)
        try:
            payload = self.store.load_pseudograd(
                ref, max_nbytes, max_header, f" of fragment {ref.fragment} in {codec}"
            )
            delta = codecs.decode(payload, codec)
        except (TransientStoreError, StoreUnreachable):
            raise  # not the payload's fault: retry the merge later, quarantine nothing
        except (StoreError, ValueError, KeyError) as err:
            return f"unreadable payload: {err}"
        if sorted(delta) != names:
            extra = sorted(set(delta) - set(names))[:3]
            missing = sorted(set(names) - set(delta))[:3]
            return f"wrong tree for fragment {ref.fragment}: extra {extra}, missing {missing}"
        for n, v in delta.items():
            if v.dtype != np.float32:
                return f"wrong dtype for {n}: {v.dtype}"
            if tuple(v.shape) != self.shapes[n]:
                return f"wrong shape for {n}: {tuple(v.shape)}, expected {self.shapes[n]}"
            if not np.all(np.isfinite(v)):
                return f"non-finite values in {n}"
        norm = outer.global_norm(delta)
        history = merge_state["norms"]
        median = claims.norm_median(history) if len(history) >= 4 else 0.0
        k = self.cfg.outer.clip_multiplier
        if median > 0:
            limit = k * median
            # a norm within k x the parameters' own norm is clipped, never quarantined: a
            # median dragged down by one island's tiny norms cannot reject everyone else
            plausible = params_norm is not None and norm <= k * params_norm
            if not norm <= 1000 * limit and not plausible:
                return f"norm {norm:.3g} is over 1000x the clip limit {limit:.3g}"
            delta, _ = outer.clip_to(delta, limit)
        elif params_norm and not norm <= 1000 * k * params_norm:
            return (
                f"norm {norm:.3g} is over 1000x the bound {k * params_norm:.3g} "
                "(k x the global parameters' norm; no running median yet)"
            )
        weight = outer.token_weight(tokens, steps) if self.cfg.outer.token_weighting else 1.0
        if self.cfg.outer.staleness_decay:
            # staleness counts global versions; with P fragments a round is about P versions
            weight /= 1.0 + staleness / len(self.frags)
        round_.accept(claim)
        arrived = m.published_at or 0.0
        return Contribution(ref, delta, norm, weight, staleness, arrived, claim)

    def _round(self, merge_state: dict, heartbeats: dict[str, dict]) -> _Round:
        times, previous = _claim_history(merge_state)
        limits = claims.Limits.from_config(self.cfg)
        return _Round(limits, self.clock(), times, previous, _beats(heartbeats))

    # -- policies ---------------------------------------------------------------------------

    def _active_islands(self) -> set[str]:
        gone = set(self.store.done()) | set(self.store.stopped_islands())
        return {i.name for i in self.cfg.islands} - gone

    def _select(
        self,
        by_frag: dict[int, list[Contribution]],
        merge_state: dict,
        result: MergeResult,
        active: set[str],
    ):
        """Per fragment, the contributions to apply now, as a list of groups (one outer step each)."""
        method = self.cfg.outer.method
        plan: dict[int, list[list[Contribution]]] = {}
        for p, contribs in sorted(by_frag.items()):
            contribs.sort(key=lambda c: (c.arrived_at, c.ref.island, c.ref.seq))
            if method in ("nesterov", "delayed_nesterov"):
                plan[p] = [[c] for c in contribs]
            elif method == "sync":
                first: dict[str, Contribution] = {}
                for c in contribs:
                    first.setdefault(c.ref.island, c)
                if active and active <= set(first):
                    plan[p] = [[first[i] for i in sorted(first)]]
            else:  # decoupled
                islands = {c.ref.island for c in contribs}
                if len(islands) < min(self.cfg.outer.quorum, max(len(active), 1)):
                    continue
                deadline = contribs[0].arrived_at + self._grace(contribs, merge_state)
                if not active <= islands and self.clock() < deadline:
                    result.waiting_until = min(result.waiting_until or deadline, deadline)
                    continue
                plan[p] = [contribs]
        return plan

    def _grace(self, contribs: list[Contribution], merge_state: dict) -> float:
        """Grace window: gamma * (tau * step_time - time to quorum - sync time), capped, >= 0."""
        o = self.cfg.outer
        step_s = float(np.median([c.ref.manifest.get("step_time_s", 0.0) for c in contribs]))
        quorum_at = contribs[min(o.quorum, len(contribs)) - 1].arrived_at
        slack = self.cfg.inner.tau * step_s - (quorum_at - contribs[0].arrived_at)
        slack -= merge_state.get("sync_s", 0.0)
        return float(min(o.max_grace_s, max(0.0, o.grace_gamma * slack)))

    # -- one merge --------------------------------------------------------------------------

    def merge_once(self) -> MergeResult:
        result = MergeResult()
        started = time.monotonic()
        skipped_before = self.store.skipped.count
        head = self.store.head()
        if head is None:
            raise RuntimeError(f"experiment {self.cfg.name!r} has no global version: run init")
        g: GlobalVersion = self.store.load_global(head)
        self.store.record_applied(g.manifest.get("applied", []), g.version)
        merge_state = g.manifest["merge_state"]
        params_norm = outer.global_norm(g.params)
        applied = self.store.applied()
        quarantined = self.store.quarantined()
        by_frag: dict[int, list[Contribution]] = {}
        head_moved = False
        round_ = self._round(merge_state, self.store.heartbeats())
        for ref in self.store.list_pseudograds():
            if ref.id in applied or ref.id in quarantined:
                continue
            checked = self._validate(ref, g.version, merge_state, params_norm, round_)
            if isinstance(checked, str):
                # Judge only against the current HEAD: a racing merger may have published a
                # newer version this ref is based on (or whose norms move the median).
                head_moved = head_moved or getattr(self.store.head(), "dir", None) != head.dir
                if head_moved:
                    log.info("not judging %s against an old head: %s", ref.id, checked)
                    continue
                self.store.quarantine(ref.id, checked)
                result.quarantined[ref.id] = checked
                log.warning("quarantined %s: %s", ref.id, checked)
                continue
            by_frag.setdefault(ref.fragment, []).append(checked)
        from training.faults import fault_point

        fault_point("merge.after-read")
        active = self._active_islands()
        plan = self._select(by_frag, merge_state, result, active)
        result.skipped = self.store.skipped.count - skipped_before
        if not plan:
            return result

        params = dict(g.params)
        state = dict(g.outer_state)
        frag_versions = list(g.manifest["fragment_versions"])
        norms = list(merge_state["norms"])
        last_seq = dict(merge_state["last_seq"])
        last_claim = dict(merge_state.get("last_claim") or {})
        tokens_merged = int(g.manifest["tokens_merged"])
        details = []
        for p, groups in plan.items():
            names = self.frags[p]
            frag_params = {n: params[n] for n in names}
            frag_state = named_to_state(
                {k[5:]: v for k, v in state.items() if k.startswith(f"f{p:03d}/")},
                self._frag_template(p),
            )
            for group in groups:
                if self.cfg.outer.method == "sync":
                    delta = outer.combine([c.delta for c in group], [1.0] * len(group), rda=False)
                else:
                    deltas, weights = _per_island(group)
                    delta = outer.combine(deltas, weights, self.cfg.outer.rda)
                    if self.cfg.outer.method == "decoupled" and self.cfg.outer.partial_scaling:
                        share = len({c.ref.island for c in group}) / max(len(active), 1)
                        delta = outer.scale(delta, min(1.0, share))
                frag_params, frag_state = outer.apply_outer(self.tx, frag_params, frag_state, delta)
                for c in group:
                    result.applied.append(c.ref.id)
                    norms.append([c.ref.island, c.norm])
                    key = f"{c.ref.island}/{p}"
                    last_seq[key] = max(last_seq.get(key, -1), c.ref.seq)
                    tokens_merged += c.claim.tokens
                    _remember(last_claim, c.claim)
                    details.append(
                        dict(
                            id=c.ref.id,
                            island=c.ref.island,
                            fragment=p,
                            weight=c.weight,
                            norm=c.norm,
                            staleness=c.staleness,
                            loss=c.ref.manifest.get("loss"),
                        )
                    )
            params.update(frag_params)
            state.update(state_to_named(frag_state, f"f{p:03d}/"))
            frag_versions[p] = g.version + 1

        sync_s = time.monotonic() - started
        merged_at = self.clock()
        keep = self.cfg.outer.max_staleness * len(self.frags) + 1
        times = dict(merge_state.get("version_times") or {}, **{str(g.version + 1): merged_at})
        times = dict(sorted(times.items(), key=lambda kv: -int(kv[0]))[:keep])
        extra = dict(
            fragment_versions=frag_versions,
            tokens_merged=tokens_merged,
            merge_state=dict(
                norms=norms[-NORM_HISTORY:],
                last_seq=last_seq,
                sync_s=0.8 * merge_state.get("sync_s", 0.0) + 0.2 * sync_s,
                version_times=times,
                last_claim=last_claim,
            ),
            contributions=details,
            merged_at=merged_at,
        )
        new_head = self.store.publish_global(
            g.version + 1, params, state, extra, applied=result.applied, expected=head
        )
        if new_head is None:
            log.info("lost the head race at version %d; retrying from the new head", g.version + 1)
            return MergeResult(lost_race=True, quarantined=result.quarantined)
        result.version = g.version + 1
        result.tokens_merged = tokens_merged
        if tokens_merged >= self.cfg.token_budget:
            self.store.request_stop()
        self.store.append_metric(
            "merge",
            dict(
                version=result.version,
                applied=len(result.applied),
                quarantined=len(result.quarantined),
                skipped=result.skipped,
                tokens_merged=tokens_merged,
                seconds=sync_s,
                at=self.clock(),
            ),
        )
        return result

    def merge_all(self, max_attempts: int = 20) -> list[MergeResult]:
        """Merge until nothing is left to apply now (retrying lost races)."""
        results = []
        for _ in range(max_attempts):
            r = self.merge_once()
            results.append(r)
            if r.version is None and not r.lost_race:
                break
        return results
