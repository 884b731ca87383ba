"""Selection and weights: which of a fragment's candidates to apply now, in which groups
(`select`: quorum K, grace window, sync rounds), and how much each island's vote weighs
(`vote_weight`, `island_weight`, `capped_weights`). Pure functions, no store.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from training.config.experiment import ExperimentConfig, OuterConfig
from training.merge.admit import Candidate
from training.protocol import claims


def vote_weight(outer: OuterConfig, tokens: int, steps: int, staleness: int) -> float:
    """Quantity x quality (tokens^2 / steps), divided by 1 + staleness (fragment versions)."""
    weight = float(tokens) ** 2 / float(steps) if outer.token_weighting else 1.0
    return weight / (1.0 + staleness) if outer.staleness_decay else weight


def island_weight(outer: OuterConfig, contribs: Sequence[Candidate]) -> float:
    """The vote weight of one island's contributions to a fragment, summed into one vote."""
    tokens, steps = sum(c.tokens for c in contribs), sum(c.steps for c in contribs)
    staleness = max(c.staleness for c in contribs)
    return vote_weight(outer, tokens, steps, staleness)


def capped_weights(outer: OuterConfig, group: Sequence[Candidate]) -> dict[str, float]:
    """island -> the cap on its vote weight in `group`: claims.cap_weights over the islands'
    claimed weights (k x the others' median). Computed from the manifests before any payload
    is read; a contribution dropped later only loosens the others' caps."""
    by_island: dict[str, list[Candidate]] = {}
    for c in group:
        by_island.setdefault(c.island, []).append(c)
    islands = sorted(by_island)
    weights = [island_weight(outer, by_island[i]) for i in islands]
    return dict(zip(islands, claims.cap_weights(weights), strict=True))


# -- which candidates, when ---------------------------------------------------------------------


def median_step_s(group: Sequence[Candidate]) -> float:
    """The group's median claimed step time: one island's claim cannot stretch a window."""
    return float(np.median([c.step_time_s for c in group]))


def grace_seconds(
    cfg: ExperimentConfig, group: Sequence[Candidate], sync_s: float, quorum: int = 1
) -> float:
    """The paper's adaptive window: gamma * (tau * step_time - time to quorum - sync time),
    capped at max_grace_s, >= 0, counted from the first publish (step_time: median_step_s)."""
    o = cfg.outer
    step_s = median_step_s(group)
    quorum_at = group[min(quorum, len(group)) - 1].published_at
    slack = cfg.inner.tau * step_s - (quorum_at - group[0].published_at) - sync_s
    return float(min(o.max_grace_s, max(0.0, o.grace_gamma * slack)))


def grace_floor_seconds(cfg: ExperimentConfig, group: Sequence[Candidate]) -> float:
    """grace_min_steps x the group's median step time, capped at max_grace_s: counted from
    when the merger first saw the group (not from the publish: an upload on a loaded host can
    take longer than a step, and the window must not be spent before the merger knows).

    The adaptive window waits while the merged result would still reach the islands within
    their tau overlap steps. When the syncer takes longer than that (a slow shared CPU, short
    steps) it is 0, and every merge fired on its first contribution: islands publishing at the
    same clock boundary a fraction of a step apart merged one by one (the demo: 1.5
    contributions per merge for 3 islands in phase). The floor waits a step or two for them:
    the result is late either way, and islands keep looking for it (Adopter.rearm)."""
    o = cfg.outer
    return float(min(o.max_grace_s, max(0.0, o.grace_min_steps * median_step_s(group))))


def select(
    cfg: ExperimentConfig,
    candidates: Sequence[Candidate],
    active: set[str],
    now: float,
    sync_s: float,
    seen_at: float | None = None,
    quorum: int | None = None,
    quorum_wait_s: float | None = None,
) -> tuple[list[list[Candidate]], float | None]:
    """The groups of one fragment's candidates to apply now (one outer step each, in order),
    and when to look again if the grace window holds them back (else None). `seen_at`: when
    the merger first saw any of them (default: now); the grace floor counts from there.
    `quorum`: K (default `outer.quorum`, which must then be a number); `quorum_wait_s`: how
    long after `seen_at` a merge short of K waits at most (None: until K arrive, as a fixed
    quorum does)."""
    cands = sorted(candidates, key=lambda c: (c.published_at, c.island, c.seq))
    if not cands:
        return [], None
    method = cfg.outer.method
    if method in ("nesterov", "delayed_nesterov"):
        return [[c] for c in cands], None
    if method == "sync":
        # a round: each active island's oldest contribution, once every active island has
        # one; with none active (all done or gone) their last ones are merged as they are,
        # a round at a time, so a run's end never waits for islands that will not publish
        first: dict[str, Candidate] = {}
        for c in cands:
            first.setdefault(c.island, c)
        if active <= set(first):
            return [[first[i] for i in sorted(first)]], None
        return [], None
    k = cfg.outer.quorum if quorum is None else quorum
    if not isinstance(k, int):
        raise ValueError(f"outer.quorum {k!r}: the merger passes the K it chose")
    islands = {c.island for c in cands}
    if len(islands) < min(k, max(len(active), 1)):
        if quorum_wait_s is None:
            return [], None
        # from when the merger first saw them (an upload over a thin link can take most of
        # a round: the others' take as long)
        until = (now if seen_at is None else seen_at) + quorum_wait_s
        if now < until:
            return [], until
        return [g for g in _by_finality(cands) if g], None  # waited a round: merge what came
    deadline = max(
        cands[0].published_at + grace_seconds(cfg, cands, sync_s, k),
        (now if seen_at is None else seen_at) + grace_floor_seconds(cfg, cands),
    )
    if not active <= islands and now < deadline:
        return [], deadline
    return [g for g in _by_finality(cands) if g], None


def _by_finality(cands: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(regular contributions, islands' last partial ones): one outer step each."""
    return [c for c in cands if not c.final], [c for c in cands if c.final]
