"""Admission: is a committed pseudo-gradient mergeable? Pure functions, no store.

- `check_manifest` (one contribution) and `judge` (a fragment's pending ones, in (island, seq)
  order against one `claims.Round`): its manifest parsed strictly
  (records.parse_pseudograd_manifest), its fragment, base version and staleness, `final`, the
  claims' bounds of training/protocol/claims.py. A `Candidate`, or the reason to quarantine it.
  Reads no payload.
- `held_back_at_end`: once the run ends, a contribution too stale to be the last merge.
- `check_payload`: a payload's structure checked (codecs.checked_codes) and wrapped as a vote
  read chunk by chunk (training/merge/stream.py); `vote_sq_norms` checks its values (finite,
  valid codes) in the one pass that computes its norms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from training.codecs import host as codecs
from training.config.experiment import ExperimentConfig, OuterConfig
from training.merge import stream as merge_stream
from training.protocol import claims
from training.store import merge_records as records
from training.store.experiment import PseudoGradRef
from training.store.safejson import show


@dataclass(frozen=True)
class Candidate:
    """A committed pseudo-gradient whose manifest passed `check_manifest`."""

    id: str
    island: str
    seq: int
    fragment: int
    tokens: int
    steps: int
    staleness: int
    published_at: float
    step_time_s: float
    codec: str
    final: bool
    manifest: Mapping[str, Any]


def check_manifest(
    cfg: ExperimentConfig,
    ref_id: str,
    island: str,
    seq: int,
    fragment: int,
    manifest: Mapping[str, Any],
    head_version: int,
    round_: claims.Round | None = None,
    error: str | None = None,
) -> Candidate | str:
    """A Candidate, or the one-line reason to quarantine the pseudo-gradient.

    `error`: why its marker could not be read (the reason, as is). The manifest is parsed by
    records.parse_pseudograd_manifest (names, payload key, types, codec); then the fragment's
    range, the base version (committed, no staler than `outer.max_staleness` fragment
    versions), `final`, and, given a `round_`, the claims' bounds (claims.check_claim; an
    accepted claim is added to the round).
    """
    if error is not None:
        return error
    try:
        m = records.parse_pseudograd_manifest(dict(manifest), ref_id, cfg.name)
    except records.BadRecord as err:
        return str(err)
    if (m.island, m.seq, m.fragment) != (island, seq, fragment):
        return "manifest island/fragment do not match its name"
    if not 0 <= fragment < cfg.fragments.count:
        return f"fragment {fragment} out of range (P = {cfg.fragments.count})"
    base = m.base_version
    if base > head_version:
        return f"base_version {base!r} is not a committed version (head {head_version})"
    staleness = head_version - base
    if staleness > cfg.outer.max_staleness:
        return f"stale: base version {base}, fragment head {head_version}"
    final = m.raw.get("final", False)
    if not isinstance(final, bool):
        return f"bad final flag in manifest: {show(final)}"
    if round_ is not None:
        claim = claims.Claim.of(m)
        reason = round_.check(claim)
        if reason is not None:
            return reason
        round_.accept(claim)
    return Candidate(
        ref_id,
        island,
        seq,
        fragment,
        m.tokens,
        m.steps,
        staleness,
        m.published_at or 0.0,
        m.step_time_s or 0.0,
        m.codec,
        final,
        m.raw,
    )


HELD_BACK = "held back at the end of the run"  # how such a quarantine reason starts


def held_back_at_end(outer: OuterConfig, staleness: int) -> str | None:
    """Once the run ends (control/STOP), the reason to hold back a contribution `staleness`
    fragment versions old, or None to merge it. At the end no later merge dilutes a step taken
    from an old base and no eval precedes the final one (issue 24: a lone contribution of a
    just-rejoined island at staleness 4 was the last merge and raised the eval loss 13%)."""
    bound = outer.end_max_staleness
    if bound is None or staleness <= bound:
        return None
    return f"{HELD_BACK}: staleness {staleness} > outer.end_max_staleness {bound}"


def check_ref(
    cfg: ExperimentConfig,
    ref: PseudoGradRef,
    fragment: int,
    head_version: int,
    round_: claims.Round | None = None,
) -> Candidate | str:
    """`check_manifest` of a listed pseudo-gradient (its name's island and seq, its manifest
    and the reason its marker could not be read) as a contribution to `fragment`."""
    return check_manifest(
        cfg,
        ref.id,
        ref.island,
        ref.seq,
        fragment,
        ref.manifest,
        head_version,
        round_,
        ref.error,
    )


def judge(
    cfg: ExperimentConfig,
    refs: Sequence[PseudoGradRef],
    fragment: int,
    head_version: int,
    round_: claims.Round,
    ending: bool = False,
) -> tuple[list[Candidate], dict[str, str]]:
    """(candidates, {id: reason to quarantine}) of a fragment's pending pseudo-gradients, judged
    in (island, seq) order against one round of claims (`round_`, which each accepted claim
    joins). `ending` (control/STOP exists): contributions staler than
    `outer.end_max_staleness` are held back (`held_back_at_end`)."""
    candidates, rejected = [], {}
    for ref in sorted(refs, key=lambda r: (r.island, r.seq)):
        checked = check_ref(cfg, ref, fragment, head_version, round_)
        if isinstance(checked, str):
            rejected[ref.id] = checked
        elif ending and (held := held_back_at_end(cfg.outer, checked.staleness)):
            rejected[ref.id] = held
        else:
            candidates.append(checked)
    return candidates, rejected


def check_payload(
    payload: Mapping[str, np.ndarray],
    codec: str,
    shapes: Mapping[str, tuple[int, ...]],
    fragment: int = 0,
) -> merge_stream.PayloadVote:
    """The payload as a vote to read chunk by chunk, its structure checked (codecs.checked_codes:
    tree, payload keys, dtypes, sizes, shapes); ValueError with the reason at the first problem.
    Its values (finiteness, valid codes) are checked as they are first decoded
    (merge_stream.sq_norms)."""
    return merge_stream.PayloadVote(codecs.checked_codes(payload, codec, shapes, fragment))


def vote_sq_norms(
    vote: merge_stream.Vote, shapes: Mapping[str, tuple[int, ...]], body: Sequence[str], buf
) -> tuple[float, float]:
    """merge_stream.sq_norms with the quarantine reasons of a payload's values."""
    try:
        return merge_stream.sq_norms(vote, shapes, body, buf)
    except ValueError as err:
        reason = str(err)
        if reason.startswith("non-finite"):
            raise
        raise ValueError(f"unreadable payload: {reason.strip(chr(39))}") from None
