"""A fragment's merge state after a merge: what the next merge and the claims' checks read
(training/store/merge_records.MergeState: the outer steps, cursors, merged norms, sync time,
version times, each island's last claim), and the fragment's tokens merged. Pure functions: the
merger computes it from the version it read and what `apply.apply_groups` applied.
"""

from __future__ import annotations

from collections.abc import Sequence

from training.config.experiment import ExperimentConfig
from training.merge.admit import Candidate
from training.merge.norm_bounds import NORM_HISTORY
from training.merge.outer import OuterFragmentState
from training.protocol import claims
from training.store import merge_records as records


def claim_of(c: Candidate) -> claims.Claim:
    """The claim an applied candidate leaves as its island's last (claims.remember)."""
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


def after_merge(
    cfg: ExperimentConfig,
    ms: records.MergeState,
    version: int,
    tokens_merged: int,
    state: OuterFragmentState,
    norms: Sequence[records.IslandNorm],
    applied: Sequence[Candidate],
    seconds: float,
    merged_at: float,
) -> tuple[records.MergeState, int]:
    """(the merge state of the new `version`, the fragment's tokens merged) after a merge that
    applied `applied` (in order) on a version of merge state `ms` and `tokens_merged` tokens:
    each island's cursor at its highest seq applied, its last claim remembered; the outer
    state's counters; the last NORM_HISTORY merged norms; the running sync time (a merge of
    `seconds` weighs 0.2); the version times the claims' checks keep
    (outer.max_staleness + 1 versions, the new one at `merged_at`)."""
    cursors = dict(ms.cursors)
    last_claim = ms.last_claim
    for c in applied:
        cursors[c.island] = max(cursors.get(c.island, -1), c.seq)
        tokens_merged += c.tokens
        last_claim = claims.remember(last_claim, claim_of(c))
    sync_s = 0.8 * ms.sync_s + 0.2 * seconds
    times = claims.version_times(ms, version, merged_at, cfg.outer.max_staleness + 1)
    next_ms = records.MergeState(
        steps=state.steps,
        seen=state.seen,
        cursors=cursors,
        norms=tuple(norms[-NORM_HISTORY:]),
        sync_s=sync_s,
        version_times=times,
        last_claim=last_claim,
    )
    return next_ms, tokens_merged
