"""The arithmetic of one fragment merge, shared by the merger and `diloco replay`.

`apply_groups` takes a fragment version's arrays (params, outer state, the merged-norm history)
and the groups of contributions a merge decided to apply, and does everything that turns them
into the next version's params and outer state: per island, its contributions summed into one
vote as they are read (each checked, its norm judged against the clip limit; with
`outer.anchor = "now"` a stale one re-anchored at the params as they stand), the votes weighted
(each island's weight capped) and combined (combine.Combiner), then the outer step
(outer.outer_step_), group after group. It reads through an `Io` of three callables, so the
merger (training/merge/merger.py: prefetched payloads, quarantine, the store's versions) and
the replay (training/merge/replay.py: the recorded contributions, any refusal a mismatch) run
the same rule: the bits of a replayed version are those of the merge, or a difference to report.

What a merge decides from the clock or the store's state (which candidates, in which groups,
each island's weight cap, how many islands were active) is an input here, never re-decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from training.codecs import host as codecs
from training.config.experiment import ExperimentConfig
from training.merge import admit, combine, norm_bounds, outer, selection, staleness, timing
from training.merge import stream as merge_stream
from training.protocol import broadcast
from training.store import merge_records as records
from training.store.objectstore import StoreError, StoreUnreachable, TransientStoreError


@dataclass(frozen=True)
class Io:
    """What the arithmetic reads and reports through.

    payload(candidate, max_nbytes, max_header): the contribution's payload tensors (a StoreError,
    ValueError or KeyError rejects it; TransientStoreError and StoreUnreachable propagate);
    reject(id, reason): a contribution left out of its island's vote (the merger quarantines it);
    base(fragment, version): the params of a committed version (anchor "now"), or None to leave
    a vote anchored at its base."""

    payload: Callable[[admit.Candidate, int, int], Mapping[str, np.ndarray]]
    reject: Callable[[str, str], None]
    base: Callable[[int, int], Mapping[str, np.ndarray] | None]


@dataclass
class Applied:
    """What `apply_groups` did: the new outer state (the params were updated in place), the
    contributions applied in the order applied, one record per contribution for the manifest,
    and the merged-norm history with this merge's norms appended."""

    state: outer.OuterFragmentState
    applied: list[admit.Candidate]
    details: list[dict]
    norms: list
    # the new params' per-chunk sums of squares (outer.outer_step_), for the next merge's
    # params norm without a pass (None: no outer step ran)
    params_sq: dict[str, list[float]] | None = None


# The fields of a manifest's `contributions` records that replay re-applies a merge from (with
# `reanchored` under outer.anchor = "now", for a stale contribution): the group a contribution
# was merged in (an index into the merge's groups, in order), its island's weight cap in that
# group and the number of islands active at the merge (outer.partial_scaling).
REPLAY_FIELDS = ("group", "cap", "active")


def fragment_limits(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """The largest payloads of a fragment version: its fp32 size (params; outer state: the
    momentum and Delayed Nesterov buffers, "momentum/<name>", "buffer/<name>")."""
    return {
        "params": codecs.payload_limits(shapes, "fp32")[0],
        "outer_state": codecs.payload_limits(
            {f"{k}/{n}": v for k in ("momentum", "buffer") for n, v in shapes.items()}, "fp32"
        )[0],
    }


def load_arrays(cfg: ExperimentConfig, store, head, manifest: dict, shapes) -> tuple:
    """(params, outer-state tensors, broadcast shadow) of the version `head` names, read and
    verified from the store, writable. The shadow is None when broadcast is off or the version
    has none (then S = its params)."""
    fv = store.load_fragment(
        head, outer_state=True, manifest=manifest, max_nbytes=fragment_limits(shapes)
    )
    shadow = None
    if broadcast.enabled(cfg) and broadcast.adoptable(manifest) == broadcast.SHADOW:
        shadow = broadcast.read_full(store, head, manifest, shapes).tensors
        # the new shadow is made in place (broadcast.encode_update)
        shadow = {n: v if v.flags.writeable else v.copy() for n, v in shadow.items()}
    return fv.params, fv.outer_state, shadow


def outer_period(cfg: ExperimentConfig) -> int:
    return cfg.outer.delay_period or len(cfg.islands)


def apply_groups(
    cfg: ExperimentConfig,
    shapes: Mapping[str, tuple[int, ...]],
    head_version: int,
    params: dict[str, np.ndarray],
    state: outer.OuterFragmentState,
    norms: Sequence,
    groups: Sequence[Sequence[admit.Candidate]],
    caps: Sequence[Mapping[str, float]],
    active: int,
    io: Io,
    arena: merge_stream.Arena | None = None,
    params_sq: Mapping[str, Sequence[float]] | None = None,
    stages: timing.Stages | None = None,
    encode: codecs.PendingStep | None = None,
) -> Applied:
    """Apply `groups` (each with its islands' weight caps `caps`) to the fragment version
    `head_version`'s `params` (in place) and outer `state`; `active`: the number of islands
    active at the merge (outer.partial_scaling). `arena`: the accumulators' memory, reused
    across merges (merge_stream.Arena); `params_sq`: the params' per-chunk sums of squares
    as the merge that wrote them took them (Applied.params_sq), else a pass computes them (the
    same float either way: merge_stream.sq_total). `stages`: seconds per stage, added to
    (training/merge/timing.py). `encode` (broadcast.pending_update of the shadow): handed to
    the last group's outer step, which writes the params the version keeps, to encode the
    update as it goes (outer.outer_step_); broadcast.version_payloads makes the rest."""
    arena = arena or merge_stream.Arena()
    stages = stages or timing.Stages()  # numbers nobody reads
    if params_sq is None or set(params_sq) != set(params):
        params_sq = merge_stream.chunk_sq_of(params)
    params_norm = math.sqrt(merge_stream.sq_total(params_sq, list(params)))
    new_sq = None
    norms = list(norms)
    applied, details = [], []
    # outer.anchor = now: stale votes re-anchored at the params as they stand (`_vote`)
    now = (head_version, params, {}) if cfg.outer.anchor == "now" else None
    for index, (group, group_caps) in enumerate(zip(groups, caps, strict=True)):
        combiner = combine.Combiner(shapes, cfg.outer.rda and cfg.outer.method != "sync", arena)
        voted: list[admit.Candidate] = []
        by_island: dict[str, list[admit.Candidate]] = {}
        for c in group:
            by_island.setdefault(c.island, []).append(c)
        for island, contribs in sorted(by_island.items()):
            vote, kept, vote_norms, (total_sq, body_sq) = _vote(
                cfg,
                shapes,
                contribs,
                norms,
                params_norm,
                combiner,
                io,
                now,
                state.momentum,
                stages,
            )
            if vote is None:
                continue
            norm = math.sqrt(total_sq)
            scale, _ = norm_bounds.norm_verdict(
                cfg.outer, norm, norm_bounds.clip_limit(cfg.outer, norms), params_norm
            )
            weight = (
                1.0
                if cfg.outer.method == "sync"
                else min(selection.island_weight(cfg.outer, kept), group_caps[island])
            )
            with stages("fold"):  # a fold at FOLD_BYTES happens here
                combiner.add(vote, weight, scale, body_sq)
            del vote
            voted += kept
            norms += [records.IslandNorm(island, n) for n in vote_norms]
            for c in kept:
                details.append(
                    dict(
                        id=c.id,
                        island=c.island,
                        fragment=c.fragment,
                        weight=weight,
                        norm=norm,
                        staleness=c.staleness,
                        tokens=c.tokens,
                        steps=c.steps,
                        published_at=c.published_at,
                        loss=c.manifest.get("loss"),
                        final=c.final,
                        # what replay needs to re-apply the merge (REPLAY_FIELDS)
                        group=index,
                        cap=group_caps[island],
                        active=active,
                    )
                )
        if not voted:
            continue
        with stages("fold"):
            delta, gains = combiner.finish(lazy=True)
        share = 1.0
        if cfg.outer.method == "decoupled" and cfg.outer.partial_scaling:
            share = min(1.0, len({c.island for c in voted}) / max(active, 1))
            if share < 1.0:
                for factors in gains.values():
                    factors.append(np.float32(share))
        with stages("outer"):
            state = outer.outer_step_(
                cfg.outer,
                outer_period(cfg),
                params,
                state,
                delta,
                final=all(c.final for c in voted),
                gains=gains,
                share=share,
                params_sq=(new_sq := {}),
                encode=encode if index == len(groups) - 1 else None,
            )
        del delta, combiner
        applied += voted
    if now is not None:  # whether each stale vote was re-anchored (its base was readable)
        for d in details:
            if d["staleness"] > 0:
                d["reanchored"] = now[2][head_version - d["staleness"]] is not None
    return Applied(state, applied, details, norms, new_sq)


def _vote(
    cfg,
    shapes,
    contribs,
    norms,
    params_norm,
    combiner,
    io: Io,
    now=None,
    momentum=None,
    stages: timing.Stages | None = None,
):
    """One island's vote on a fragment: its pending contributions, each checked and its
    norms computed in one streaming pass, summed (they are consecutive increments: an
    island never publishes the same progress twice). Returns (vote or None, the
    contributions in it, their norms, the vote's (squared norm, squared body norm)).
    One summed vote is held, and at most `syncer.fetch_concurrency` payloads beside the
    one being summed (fetched ahead: training/merge/fetch.py).

    `now` (only with `outer.anchor = "now"`) = (HEAD's version, its params as they stand, a
    cache of base versions' params): a stale contribution is re-anchored at them
    (`_anchored_now`). `momentum` (the fragment's outer momentum): a stale contribution is then
    corrected by `outer.staleness` (training/merge/staleness.py); its norm as published is what
    the clipping history and the quarantine judge, the corrected vote is what is folded."""
    vote: merge_stream.Vote | None = None
    kept, vote_norms, sqs = [], [], (0.0, 0.0)
    limit = norm_bounds.clip_limit(cfg.outer, norms)
    buf = combiner.scratch
    stages = stages or timing.Stages()  # numbers nobody reads
    for c in contribs:
        max_nbytes, max_header = codecs.payload_limits(shapes, c.codec)
        try:
            with stages("read"):
                payload = io.payload(c, max_nbytes, max_header)
        except (TransientStoreError, StoreUnreachable):
            raise  # not the payload's fault: retry later, quarantine nothing
        except (StoreError, ValueError, KeyError) as err:
            io.reject(c.id, f"unreadable payload: {err}")
            continue
        try:
            with stages("norms"):
                this = admit.check_payload(payload, c.codec, shapes, c.fragment)
                if now is not None and c.staleness > 0:
                    this = _anchored_now(shapes, c, this, *now, buf, io)
                total_sq, body_sq = admit.vote_sq_norms(this, shapes, combiner.body, buf)
        except (ValueError, KeyError) as err:
            io.reject(c.id, str(err).strip("'\""))
            continue
        finally:
            del payload
        norm = math.sqrt(total_sq)
        _, reason = norm_bounds.norm_verdict(cfg.outer, norm, limit, params_norm)
        if reason is not None:
            io.reject(c.id, reason)
            continue
        fixed = staleness.stale_correction(
            cfg.outer, this, c.staleness, momentum or {}, shapes, buf
        )
        if fixed is not None:
            this = fixed
            total_sq, body_sq = merge_stream.sq_norms(this, shapes, combiner.body, buf)
        vote = this if vote is None else merge_stream.add_votes(vote, this, shapes, buf)
        sqs = (total_sq, body_sq) if not kept else None
        kept.append(c)
        vote_norms.append(norm)
    if vote is not None and sqs is None:
        sqs = merge_stream.sq_norms(vote, shapes, combiner.body, buf)
    return vote, kept, vote_norms, sqs or (0.0, 0.0)


def _anchored_now(shapes, c, vote, head_version, params, bases, buf, io: Io):
    """`outer.anchor = "now"`: the contribution's outer gradient anchored at the fragment as
    it stands, Theta(now) - theta_m = Delta + (Theta(now) - Theta(base)), with Theta(base)
    the committed version it was computed against (version HEAD - staleness; read once per
    merge and held to its end: one fragment per distinct stale base, at most
    `outer.max_staleness`). A base `io.base` does not give (garbage-collected, refused) leaves
    the vote as published, anchored at its base."""
    version = head_version - c.staleness
    if version not in bases:
        bases[version] = io.base(c.fragment, version)
    base = bases[version]
    if base is None:
        return vote
    drift = merge_stream.DenseVote(
        {n: np.subtract(params[n], base[n], dtype=np.float32) for n in shapes},
        owned=True,
    )
    return merge_stream.add_votes(drift, vote, shapes, buf)
