"""Bounds on what a contribution claims: its steps, its tokens, and the weight they buy it.

A pseudo-gradient's manifest says how many inner steps and tokens it holds; the merger weights
it by tokens^2 / steps and adds its tokens to the experiment's budget. An island can write any
number there, so every claim is checked against what the island can have done (pure functions,
no store access; the merger gathers the facts):

1. `steps <= 2 * H`: steps count from the fragment's previous publish; fragment p is first due
   at H + its offset (< H), then every H steps (training/protocol/fragments.py), and DyLU only lowers H.
2. `tokens <= steps * batch_size * seq_len`: one step is one batch (of that island: its
   `islands[].batch_size`, else `data.batch_size`).
3. `published_at <= now + skew`: no claim from the future (on the merger's clock).
4. Since the base version: an island adopts version b only after the merger published it (at
   merger time T_b, its `merged_at`, else `created_at`), and each contribution holds at most
   tau steps trained before the adoption. So the island's contributions for one fragment
   based on b or later, this one included, hold at most
   `tau * count + max_steps_per_s * (now - T_b + skew)` steps. When the merger's clock and
   T_b disagree by more than the skew (a virtual-clock bench, a clock-less version 0) the rule
   is skipped: only merger-side facts switch it off, never anything an island writes.
5. Against its previous contribution to the fragment (lower seq): `island_step` may not grow
   faster than `max_steps_per_s` on the island's own clock, and `steps <= island_step`.
6. Against its heartbeat: a contribution published after the heartbeat's `time` is at most
   `max_steps_per_s * (published_at - time + skew)` steps past the heartbeat's `step`.
7. Exactly once for the island's work (docs/STORE.md "Each step counted once"): a contribution
   holds the island's steps `(island_step - steps, island_step]`; those ranges of one island
   on one fragment never overlap. A contribution whose range starts before the end of its
   previous one (applied, or accepted earlier in the same merge) counts steps that are
   already counted: an island restarted from a checkpoint older than its last publish that
   published those steps again. The island itself never does (training/island/process.py
   learns what it committed past its checkpoint); this is the second line of defence.

`max_steps_per_s` must exceed the fastest honest island (the default, 1000 steps/s, is 50x the
tiny model on one CPU core); it is also the pace at which a lying island can push the token
budget. Each rule returns the reason to quarantine, or None.

The norm median (`norm_median`) is per island for the same reason.

The weight cap (`cap_weights`): within one merge, an island's vote weight is capped at
`WEIGHT_CAP` (k = 8) times the median of the other votes' weights, so no single claim swamps
the merge however its tokens and steps were chosen: with two islands the larger share is at
most k / (k + 1) = 89%. Honest weights (tokens^2 / steps = steps x (batch x seq_len)^2) scale
with steps, so with DyLU with the islands' speeds: k = 8 leaves islands up to 8x apart alone
(mixed accelerators run within about 2-4x); a finishing island's short last interval next to
a full one is the case it does touch (1 step against 32: 89% instead of 97%).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.store.merge_records import LastClaim, MergeState

MAX_STEPS_PER_S = 1000.0
CLOCK_SKEW_S = 5.0
WEIGHT_CAP = 8.0


@dataclass(frozen=True)
class Claim:
    """What one contribution claims (from its validated manifest)."""

    island: str
    fragment: int
    seq: int
    base_version: int
    steps: int
    tokens: int
    published_at: float | None = None
    island_step: int | None = None

    @classmethod
    def of(cls, manifest: Any) -> Claim:
        """From a `merge_records.PseudoGradManifest`."""
        return cls(
            manifest.island,
            manifest.fragment,
            manifest.seq,
            manifest.base_version,
            manifest.steps,
            manifest.tokens,
            manifest.published_at,
            manifest.island_step,
        )


@dataclass(frozen=True)
class Limits:
    """The experiment's numbers the rules need."""

    H: int
    tokens_per_step: int  # an island's not in `island_tokens_per_step` (data.batch_size)
    tau: int = 0
    max_steps_per_s: float = MAX_STEPS_PER_S
    clock_skew_s: float = CLOCK_SKEW_S
    island_tokens_per_step: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, **overrides: float) -> Limits:
        """The limits of an ExperimentConfig; the rate and skew are this module's constants
        (read at call time), unless given."""
        fields = {"max_steps_per_s": MAX_STEPS_PER_S, "clock_skew_s": CLOCK_SKEW_S, **overrides}
        return cls(
            H=cfg.inner.H,
            tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
            tau=cfg.inner.tau,
            island_tokens_per_step={i.name: cfg.tokens_per_step(i.name) for i in cfg.islands},
            **fields,
        )

    def tokens_per_step_of(self, island: str) -> int:
        """Tokens one inner step of `island` trains (its batch x seq_len)."""
        return self.island_tokens_per_step.get(island, self.tokens_per_step)

    @property
    def max_interval_steps(self) -> int:
        return 2 * self.H


@dataclass(frozen=True)
class Beat:
    """An island's heartbeat: its step count at `time` (the island's clock)."""

    step: int
    time: float


def check_claim(
    claim: Claim,
    limits: Limits,
    now: float,
    *,
    base_time: float | None = None,
    earlier: Iterable[Claim] = (),
    previous: Claim | None = None,
    heartbeat: Beat | None = None,
) -> str | None:
    """The reason `claim` is implausible, or None (rules 1-6 of the module docstring).

    `base_time`: when the merger published the claim's base version (merger clock, as `now`);
    `earlier`: this island's contributions for the same fragment accepted before this one and
    not yet merged; `previous`: this island's last accepted contribution to the same fragment
    (applied, as the fragment's merge state keeps it, or accepted earlier in this merge);
    `heartbeat`: its latest heartbeat.
    """
    steps, tokens = claim.steps, claim.tokens
    if steps < 1 or tokens < 1:
        return f"claims {steps} steps and {tokens} tokens: both must be positive"
    if steps > limits.max_interval_steps:
        return (
            f"claims {steps} steps since its last publish of fragment {claim.fragment}; "
            f"at most 2 x H = {limits.max_interval_steps}"
        )
    per_step = limits.tokens_per_step_of(claim.island)
    if tokens > steps * per_step:
        return f"tokens {tokens} exceed {steps} steps x {per_step} tokens per step"
    skew, rate = limits.clock_skew_s, limits.max_steps_per_s
    if claim.published_at is not None and claim.published_at > now + skew:
        return f"published_at is {claim.published_at - now:.3g} s in the future"
    if base_time is not None and now >= base_time - skew:
        same = [c for c in earlier if c.base_version >= claim.base_version] + [claim]
        total = sum(c.steps for c in same)
        bound = limits.tau * len(same) + rate * (now - base_time + skew)
        if total > bound:
            return (
                f"claims {total} steps in {len(same)} contribution(s) on base version "
                f"{claim.base_version}, published {now - base_time:.3g} s ago: over "
                f"{bound:.0f} at {rate:g} steps/s"
            )
    return _against_history(claim, limits, previous, heartbeat)


def _against_history(
    claim: Claim, limits: Limits, previous: Claim | None, heartbeat: Beat | None
) -> str | None:
    """Rules 5, 6 and 7: the island's own clock and step counter."""
    s1, t1 = claim.island_step, claim.published_at
    if s1 is None:
        return None
    if claim.steps > s1:
        return f"claims {claim.steps} steps but its island_step is {s1}"
    overlap = overlapping(claim, previous)
    if overlap is not None:
        return overlap
    skew, rate = limits.clock_skew_s, limits.max_steps_per_s
    if t1 is None:
        return None
    if previous is not None and previous.island_step is not None and previous.published_at:
        s0, t0 = previous.island_step, previous.published_at
        if previous.seq < claim.seq and s1 > s0 and s1 - s0 > rate * (max(0.0, t1 - t0) + skew):
            return (
                f"island_step went from {s0} to {s1} in {t1 - t0:.3g} s "
                f"(seq {previous.seq} -> {claim.seq}): over {rate:g} steps/s"
            )
    if heartbeat is not None and t1 > heartbeat.time:
        bound = heartbeat.step + rate * (t1 - heartbeat.time + skew)
        if s1 > bound:
            return (
                f"island_step {s1} is over {bound:.0f}: its heartbeat said step "
                f"{heartbeat.step} {t1 - heartbeat.time:.3g} s before it published"
            )
    return None


def overlapping(claim: Claim, previous: Claim | None) -> str | None:
    """Rule 7: the reason `claim`'s steps overlap those of `previous` (the same island's
    contribution to the same fragment with a lower seq), or None. Ranges are
    `(island_step - steps, island_step]`; a claim without island_step is not judged."""
    if previous is None or previous.island_step is None or claim.island_step is None:
        return None
    first = claim.island_step - claim.steps + 1
    if previous.seq < claim.seq and first <= previous.island_step:
        return (
            f"steps {first}..{claim.island_step} overlap steps up to {previous.island_step} "
            f"already counted for this fragment (seq {previous.seq}): counted once"
        )
    return None


def cap_weights(weights: Sequence[float], k: float = WEIGHT_CAP) -> list[float]:
    """Each weight capped at k x the median of the others' (computed from the uncapped
    weights). A single weight, or others with median 0, are left as they are."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    out = []
    for i, w in enumerate(weights):
        others = [x for j, x in enumerate(weights) if j != i]
        median = statistics.median(others) if others else 0.0
        out.append(min(w, k * median) if median > 0 else w)
    return out


def norm_median(history: Sequence[Any]) -> float:
    """The running median the merger clips norms against, one vote per island: the median of
    each island's median over `history` entries `[island, norm]` (a bare number, as older
    merge states hold, is a vote of its own). So one island publishing tiny (or huge) norms
    moves the median by at most one island's vote: it cannot drag the clip limit down until
    every honest contribution looks absurd. 0.0 for an empty history."""
    per_island: dict[Any, list[float]] = {}
    for i, entry in enumerate(history):
        if isinstance(entry, list | tuple) and len(entry) == 2:
            per_island.setdefault(("island", entry[0]), []).append(float(entry[1]))
        else:
            per_island[("legacy", i)] = [float(entry)]
    votes = [statistics.median(norms) for norms in per_island.values()]
    return float(statistics.median(votes)) if votes else 0.0


@dataclass
class Round:
    """What one merge of a fragment knows to bound claims: the limits, the merger's clock, when
    recent versions of the fragment were published, each island's last applied claim and its
    heartbeat, and the claims accepted so far in this round. Pure: the merger gathers the facts
    (`history` reads them from the fragment's parsed merge state)."""

    limits: Limits
    now: float
    base_times: dict[int, float]
    previous: dict[str, Claim]
    heartbeats: dict[str, Beat]
    accepted: dict[tuple[str, int], list[Claim]] = field(default_factory=dict)

    def check(self, claim: Claim) -> str | None:
        """The reason `claim` is implausible (check_claim against this round), or None."""
        return check_claim(
            claim,
            self.limits,
            self.now,
            base_time=self.base_times.get(claim.base_version),
            earlier=self.accepted.get((claim.island, claim.fragment), []),
            previous=self.previous.get(claim.island),
            heartbeat=self.heartbeats.get(claim.island),
        )

    def accept(self, claim: Claim) -> None:
        self.accepted.setdefault((claim.island, claim.fragment), []).append(claim)
        self.previous[claim.island] = claim


def beats(heartbeats: dict[str, dict]) -> dict[str, Beat]:
    """island -> Beat of the heartbeats (validated by island_records.parse_heartbeat) that say both."""
    out = {}
    for island, hb in heartbeats.items():
        if hb.get("step") is not None and hb.get("time") is not None:
            out[island] = Beat(int(hb["step"]), float(hb["time"]))
    return out


def history(state: MergeState) -> tuple[dict[int, float], dict[str, Claim]]:
    """(version -> merger time of its publication, island -> its last applied claim), as kept
    in a fragment's parsed merge state (`version_times`, `last_claim`)."""
    times = {int(v): float(t) for v, t in state.version_times.items()}
    previous = {
        island: Claim(island, 0, int(c.seq), 0, 1, 1, float(c.published_at), int(c.island_step))
        for island, c in state.last_claim.items()
    }
    return times, previous


def remember(last_claim: Mapping[str, LastClaim], claim: Claim) -> dict[str, LastClaim]:
    """`last_claim` with `claim` as its island's newest applied claim (a new mapping). Left as
    it is when the claim lacks island_step or published_at, or the island's known claim is of
    this seq or a later one."""
    if claim.island_step is None or claim.published_at is None:
        return dict(last_claim)
    known = last_claim.get(claim.island)
    if known is not None and known.seq >= claim.seq:
        return dict(last_claim)
    new = LastClaim(claim.seq, claim.island_step, claim.published_at)
    return {**last_claim, claim.island: new}


def version_times(state: MergeState, version: int, at: float, keep: int) -> dict[str, float]:
    """The merge state's version_times with `version` published at `at`, the newest `keep`
    kept."""
    times = {**state.version_times, str(version): at}
    return dict(sorted(times.items(), key=lambda kv: -int(kv[0]))[:keep])
