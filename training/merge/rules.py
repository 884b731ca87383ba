"""The merge's decisions and arithmetic as pure functions, testable without a store.

The merger (training/merge/merger.py) is the I/O shell around these:
- `check_manifest`: is a committed pseudo-gradient admissible (its manifest parsed strictly by
  records.parse_pseudograd_manifest, staleness, codec, the claims' bounds of training/protocol/claims.py)?
  A `Candidate` or the reason to quarantine it. Reads no payload.
- `capped_weights`: the vote weights of a group, each island's capped (claims.cap_weights).
- `select`: which candidates of one fragment to apply now (quorum K, grace window, sync).
- `check_payload`: a payload's structure checked (codecs.checked_codes) and wrapped as a vote
  read chunk by chunk (training/merge/stream.py); `vote_sq_norms` checks its values (finite,
  valid codes) in the one pass that computes its norms.
- `Combiner`: folds islands' votes into one update, tensor by tensor, in float32: radial-
  directional averaging (RDA) over the non-embedding tensors, the weighted mean for embeddings.
  It holds one fragment-sized accumulator, never every contribution, and never a decoded one.
- `outer_step_`: the outer optimizer applied in place on host arrays, with its state as one
  typed `OuterFragmentState` per fragment. `tests/test_merge_rules.py` checks it against the
  optax transforms of tests/reference_outer.py (`optax.sgd(..., nesterov=True)`, `delayed_nesterov`).

Sign convention: deltas are pseudo-gradients (global minus local, training/protocol/pseudograd.py); the
outer step moves the parameters against them.

Length: just past 500 lines: every pure rule of the merge in one place, beside the tests that
derive them by hand (tests/test_merge_rules.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from training.codecs import host as codecs
from training.codecs import native
from training.config.experiment import ExperimentConfig, OuterConfig
from training.merge import stream as merge_stream
from training.protocol import claims
from training.protocol.fragments import is_embedding
from training.store import merge_records as records
from training.store.safejson import show

NORM_HISTORY = 64  # merged norms kept per fragment for the clipping median
QUARANTINE_FACTOR = 1000.0  # a norm over this x the clip limit is quarantined, not clipped


# -- outer optimizer state and step ------------------------------------------------------------


class OuterFragmentState(NamedTuple):
    """All outer-optimizer state of one fragment (serialized: training/merge/merger.py)."""

    steps: int  # outer steps applied
    seen: int  # contributions seen (Delayed Nesterov's counter)
    momentum: dict[str, np.ndarray]  # per tensor; empty when momentum = 0
    buffer: dict[str, np.ndarray]  # Delayed Nesterov's D; empty for other methods


def _state_kinds(outer: OuterConfig) -> list[str]:
    """The per-tensor state a method keeps: momentum (if any), Delayed Nesterov's buffer."""
    kinds = ["momentum"] if outer.momentum else []
    return kinds + (["buffer"] if outer.method == "delayed_nesterov" and outer.momentum else [])


def init_state(outer: OuterConfig, shapes: Mapping[str, tuple[int, ...]]) -> OuterFragmentState:
    kinds = _state_kinds(outer)
    zeros = {k: {n: np.zeros(s, np.float32) for n, s in shapes.items()} for k in kinds}
    return OuterFragmentState(0, 0, zeros.get("momentum", {}), zeros.get("buffer", {}))


def outer_lr(outer: OuterConfig, steps: int) -> float:
    """The outer learning rate of a fragment's outer step number `steps` + 1: `outer.lr`, ramped
    linearly over the first `outer.lr_warmup` steps (lr / W, 2 lr / W, ..., lr)."""
    if outer.lr_warmup <= 0:
        return outer.lr
    return outer.lr * min(1.0, (steps + 1) / outer.lr_warmup)


def _outer_step_c(lib, n: int, arrays, factors: np.ndarray, flags, scalars) -> list[float]:
    """native.c `outer_step_sq` on one tensor (params, g, momentum or None, buffer or None),
    threads over chunks (native.over_chunks: the same bits); returns the new params'
    per-chunk sums of squares."""
    step = codecs.chunk_step()
    sums = np.empty(-(-n // step), np.float64)
    bases = [native.address(a) for a in arrays]

    def run(s: int, e: int, k0: int) -> None:
        at = [None if a is None else a + 4 * s for a in bases]
        fixed = (factors.ctypes.data, factors.size, *flags, *scalars)
        lib.outer_step_sq(e - s, *at, *fixed, step, sums.ctypes.data + 8 * k0)

    native.over_chunks(n, step, run)
    return sums.tolist()


def outer_step_(
    outer: OuterConfig,
    period: int,
    params: dict[str, np.ndarray],
    state: OuterFragmentState,
    delta: dict[str, np.ndarray],
    final: bool = False,
    gains: Mapping[str, Sequence[np.float32]] | None = None,
    share: float = 1.0,
    params_sq: dict[str, list[float]] | None = None,
) -> OuterFragmentState:
    """theta <- outer step(theta, delta), in place on `params` and the state's arrays.

    - momentum 0: theta -= lr * g;
    - SGD with momentum (Nesterov or not), as optax.sgd: m <- beta m + g; theta -= lr (g + beta
      m) with Nesterov, lr m without;
    - Delayed Nesterov with period N (arXiv 2401.09135): D += g; on every N-th contribution
      m <- beta m + D / N, theta -= lr (g / N + beta m), D <- 0; otherwise theta -= lr g / N.
    lr is `outer_lr` of the state's step count. `final` (an island's last, partial interval):
    theta -= lr g and the state does not move, so a few steps' remainder never buys a full
    momentum step (the end-of-run degradation).
    `share` < 1 with `outer.fractional_momentum` (a merge of n of M islands, share n/M): the
    step is that fraction of an outer step for the momentum as well: m <- beta^share m + g;
    Nesterov theta -= lr (g + share beta m), else theta -= lr (share m + (1 - share) g). At
    share 1 both are the plain rule; two half-merges of g/2 come out near one full merge of g
    (where each would otherwise re-apply beta m whole). numpy only (no C loop for it yet).
    g = delta[n] multiplied in turn by each factor of `gains[n]` (Combiner.finish). Applied
    chunk by chunk (codecs.chunk_spans), so its temporaries stay in cache, or in one pass of
    training/codecs/native.c's loop where it loaded (the same bits). `delta` may be overwritten.
    `params_sq` (a dict, filled): per tensor, the float64 sums of squares of the new params'
    chunks, taken while each chunk is in cache (merge_stream.sq_total: the next merge's
    params norm without a pass).
    """
    lr, beta = np.float32(outer_lr(outer, state.steps)), np.float32(outer.momentum)
    plain = final or not outer.momentum
    delayed = outer.method == "delayed_nesterov" and not plain
    seen = state.seen + 1
    flush = delayed and seen % period == 0
    inv = np.float32(1.0 / period)
    mode = 0 if plain else (2 if delayed else 1)
    frac = mode == 1 and outer.fractional_momentum and share < 1.0
    decay = np.float32(outer.momentum**share) if frac else beta
    look = np.float32(outer.momentum * share) if frac else beta
    keep = np.float32(share) if frac else np.float32(1.0)
    for n, g_all in delta.items():
        factors = np.asarray((gains or {}).get(n, ()), np.float32)
        arrays = [
            params[n],
            g_all,
            state.momentum[n] if mode else None,
            state.buffer[n] if delayed else None,
        ]
        lib = native.library() if not frac and native.fits_float32(*arrays) else None
        if lib is not None:  # one C pass, the numpy loop below bit for bit
            flags = (mode, int(outer.nesterov), int(flush))
            sums = _outer_step_c(lib, g_all.size, arrays, factors, flags, (lr, beta, inv))
            if params_sq is not None:
                params_sq[n] = sums
            continue
        flat = {"p": params[n].reshape(-1), "g": g_all.reshape(-1)}
        if not plain:
            flat["m"] = state.momentum[n].reshape(-1)
        if delayed:
            flat["d"] = state.buffer[n].reshape(-1)
        for s, e in codecs.chunk_spans(flat["g"].size):
            c = {k: v[s:e] for k, v in flat.items()}
            g = c["g"]
            for factor in (gains or {}).get(n, ()):
                g *= factor
            if plain:
                c["p"] -= lr * g
            elif delayed:
                d, m = c["d"], c["m"]
                d += g
                g *= inv
                if flush:
                    m *= beta
                    m += inv * d
                    d[...] = 0
                    g += beta * m
                c["p"] -= lr * g
            else:
                m = c["m"]
                m *= decay
                m += g
                if outer.nesterov:
                    g += look * m
                    c["p"] -= lr * g
                elif frac:
                    c["p"] -= lr * (keep * m + (np.float32(1.0) - keep) * g)
                else:
                    c["p"] -= lr * m
            if params_sq is not None:
                params_sq.setdefault(n, []).append(merge_stream.sq(c["p"]))
    if final:
        return state
    return state._replace(steps=state.steps + 1, seen=seen)


def state_tensors(state: OuterFragmentState) -> dict[str, np.ndarray]:
    """The state's arrays as named tensors ("momentum/<name>", "buffer/<name>")."""
    out = {f"momentum/{n}": v for n, v in state.momentum.items()}
    out.update({f"buffer/{n}": v for n, v in state.buffer.items()})
    return out


def state_from_tensors(
    outer: OuterConfig,
    shapes: Mapping[str, tuple[int, ...]],
    tensors: Mapping[str, np.ndarray],
    steps: int,
    seen: int,
) -> OuterFragmentState:
    """Rebuild a fragment's state; ValueError naming the first tensor that does not fit."""
    # the names and shapes init_state would make (without making its zeros)
    expected = {f"{k}/{n}": tuple(s) for k in _state_kinds(outer) for n, s in shapes.items()}
    if sorted(tensors) != sorted(expected):
        raise ValueError(f"outer state tensors {sorted(tensors)[:4]} != {sorted(expected)[:4]}")
    for k, v in tensors.items():
        if v.dtype != np.float32 or v.shape != expected[k]:
            raise ValueError(f"outer state {k}: {v.dtype} {v.shape}, expected {expected[k]}")
    pick = {
        kind: {n[len(kind) + 1 :]: v for n, v in tensors.items() if n.startswith(kind + "/")}
        for kind in ("momentum", "buffer")
    }
    return OuterFragmentState(steps, seen, pick["momentum"], pick["buffer"])


# -- admission: manifests ----------------------------------------------------------------------


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


# -- selection -----------------------------------------------------------------------------------


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


# -- payloads ------------------------------------------------------------------------------------


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


# A restored outer state's norm over the bound its chain's merged norms allow: refused (a
# promotion, replayed instead). The momentum is a decaying sum of combined updates, each at
# most the largest merged norm; the margin covers older, larger norms that left the history.
STATE_NORM_MARGIN = 100.0


def check_outer_state_bound(
    outer: OuterConfig, tensors: Mapping[str, np.ndarray], norms: Sequence[Any]
) -> None:
    """ValueError when an outer state read from the bucket (a promotion's) is larger than its
    version's history allows: each of its momentum and Delayed Nesterov buffer norms at most
    STATE_NORM_MARGIN x the largest merged norm of the version's history / (1 - momentum)
    (times the delay period for the buffer, which sums that many updates). No bound before a
    norm is recorded (a version 0 state is zeros)."""
    recorded = [float(n[1]) for n in norms if math.isfinite(float(n[1]))]
    if not recorded:
        return
    beta = min(outer.momentum, 0.999)
    bound = STATE_NORM_MARGIN * max(recorded) / (1.0 - beta)
    for kind in ("momentum", "buffer"):
        names = [n for n in tensors if n.startswith(f"{kind}/")]
        if not names:
            continue
        norm = merge_stream.norm_of(tensors, names)
        limit = bound * (outer.delay_period or 64 if kind == "buffer" else 1)
        if not norm <= limit:
            raise ValueError(
                f"outer state {kind} norm {norm:.4g} is over the {limit:.4g} its version's "
                "merged norms allow"
            )


def clip_limit(outer: OuterConfig, norms: Sequence[Any]) -> float | None:
    """k x the running median of merged norms (entries [island, norm]: one vote per island,
    claims.norm_median), or None until four norms are known."""
    return outer.clip_multiplier * claims.norm_median(norms) if len(norms) >= 4 else None


def norm_verdict(
    outer: OuterConfig, norm: float, limit: float | None, params_norm: float
) -> tuple[float, str | None]:
    """(scale to apply, reason to quarantine or None) for a contribution of norm `norm`.

    Over the clip limit it is scaled down to it; over 1000x the limit and over k x the
    parameters' norm it is quarantined (a norm within k x the parameters' own norm is clipped,
    never quarantined: a median dragged down by one island's tiny norms cannot reject everyone
    else). Until the median exists the bound is 1000 x k x the fragment parameters' norm.
    """
    if limit is not None and limit > 0:
        plausible = norm <= outer.clip_multiplier * params_norm
        if not norm <= QUARANTINE_FACTOR * limit and not plausible:
            return 0.0, f"norm {norm:.3g} is over 1000x the clip limit {limit:.3g}"
        return (limit / norm if norm > limit else 1.0), None
    bound = QUARANTINE_FACTOR * outer.clip_multiplier * params_norm
    if params_norm > 0 and not norm <= bound:
        return 0.0, (
            f"norm {norm:.3g} is over 1000x the bound {bound / QUARANTINE_FACTOR:.3g} "
            "(k x the parameters' norm; no running median yet)"
        )
    return 1.0, None


# -- combination ---------------------------------------------------------------------------------


# Votes a Combiner holds before folding them (their payloads' bytes): beyond it they are folded
# into the accumulators and let go (the same bits, one more pass over the accumulators).
FOLD_BYTES = 4 * 2**30


class Combiner:
    """Folds weighted votes into one update for a fragment, tensor by tensor, in float32.

    RDA (arXiv 2604.21428) over the non-embedding tensors taken together as one vector:
    `(sum w |v| / sum w) * unit(sum w unit(v))`; the weighted mean for embedding tensors (and
    for everything when rda=False). One accumulator per tensor; a vote (a dict of arrays, or a
    training/merge_stream.Vote read chunk by chunk) is folded in once.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        rda: bool,
        arena: merge_stream.Arena | None = None,
    ):
        self.rda = rda
        self.shapes = dict(shapes)
        # the accumulators (set by the 1st vote): views of `arena`, reused merge after merge
        # (no fragment-sized allocation, no page faults), else new arrays
        arena = arena or merge_stream.Arena()
        self.acc = arena.tensors(self.shapes)
        self.body = [n for n in shapes if rda and not is_embedding(n)]
        self.total_weight = 0.0
        self.norm_sum = 0.0  # sum w |v_body|
        self.votes = 0
        self.scratch = arena.scratch  # one chunk, shared with the merger's reads
        # votes added but not yet folded: (vote, its coefficient per tensor), folded together
        # chunk by chunk (`_fold`) when finish() is called or they hold FOLD_BYTES of payload
        self._pending: list[tuple[merge_stream.Vote, dict[str, np.float32]]] = []
        self._pending_bytes = 0
        self._folded = 0  # votes already in the accumulators

    def add(self, vote: Any, weight: float, scale: float = 1.0, body_sq: float | None = None):
        """Fold one island's vote (scaled by `scale`, e.g. a clip) with `weight`; `body_sq`:
        the vote's squared body norm if already known (merge_stream.sq_norms). The fold itself
        waits for the next votes (`_fold`: one pass over the accumulators for all of them)."""
        if weight <= 0:
            raise ValueError(f"vote weight must be positive, got {weight}")
        if not isinstance(vote, merge_stream.Vote):
            vote = merge_stream.DenseVote(vote)
        if body_sq is None:
            body_sq = merge_stream.sq_norms(vote, self.shapes, self.body, self.scratch)[1]
        body_norm = math.sqrt(body_sq) * scale
        direction = np.float32(weight * scale / body_norm) if body_norm > 0 else np.float32(0)
        mean = np.float32(weight * scale)
        body = set(self.body)
        self._pending.append((vote, {n: direction if n in body else mean for n in self.shapes}))
        self._pending_bytes += vote.nbytes
        if self._pending_bytes > FOLD_BYTES:
            self._fold(sums=False)
        self.total_weight += weight
        self.norm_sum += weight * body_norm
        self.votes += 1

    def finish(self) -> tuple[dict[str, np.ndarray], dict[str, list[np.float32]]]:
        """(accumulators, per-tensor gains): the combined update is acc[n] x gains[n]
        (outer_step_ applies them chunk by chunk; the Combiner is spent)."""
        if not self.votes:
            raise ValueError("no votes to combine")
        inv = np.float32(1.0 / self.total_weight)
        body = set(self.body)
        body_sq = self._fold(sums=bool(body))
        gains = {n: [inv] for n in self.acc if n not in body}
        if body:
            # the body accumulators' norm from the sums the last fold took of each chunk
            direction_norm = math.sqrt(merge_stream.sq_total(body_sq, self.body))
            target = self.norm_sum / self.total_weight
            factor = np.float32(target / direction_norm) if direction_norm > 0 else np.float32(0)
            gains.update({n: [factor] for n in self.body})
        return self.acc, gains

    def _fold(self, sums: bool) -> dict[str, list[float]]:
        """Fold the pending votes into the accumulators, tensor by tensor, chunk by chunk, every
        vote into a chunk before the next chunk (merge_stream.fold_votes): element by element
        the operations of folding them one after another, in one pass over the accumulators;
        returns, with `sums`, the body tensors' per-chunk sums of squares after it."""
        out: dict[str, list[float]] = {}
        if self._pending:
            for n in self.shapes:
                got = merge_stream.fold_votes(
                    [(vote, coefs[n]) for vote, coefs in self._pending],
                    n,
                    self.acc[n].reshape(-1),
                    self._folded == 0,
                    self.scratch,
                    sums and n in self.body,
                )
                if got is not None:
                    out[n] = got
            self._folded += len(self._pending)
            self._pending, self._pending_bytes = [], 0
        elif sums:  # nothing pending (a fold at FOLD_BYTES took the last vote): a pass
            out = merge_stream.chunk_sq_of(self.acc, self.body)
        return out

    def result(self) -> dict[str, np.ndarray]:
        """The combined update (in place in the accumulators: the Combiner is spent)."""
        acc, gains = self.finish()
        for n, factors in gains.items():
            for f in factors:
                acc[n] *= f
        return acc
