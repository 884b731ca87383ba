"""Staleness-aware outer updates: a stale contribution corrected before islands are combined.

`outer.staleness` (training/config/sections.py) picks the rule; the merger (training/merge/
merger.py `_vote`) applies it to each contribution of staleness s > 0 (fragment versions
merged since its base), after its payload and norms are checked and before its island's vote
is folded into the Combiner. Staleness 0, or `outer.staleness = "none"`, leaves the vote as it is
(the same object: the same bits as without this module).

- `momentum`: HeLoCo (Al Asif et al., arXiv 2606.00271), as written out in the zij optimizer
  canon (github.com/junaidaliop/zij, docs/math/heloco.md; the paper's own hyperparameter values
  were not available here, so the constants below are ours). Per tensor b, with the fragment's
  outer momentum m as the reference of the current trajectory: u = Delta_b / |Delta_b|,
  v = m_b / |m_b|, c = u . v, conf = |Delta_b| / (|Delta_b| + kappa |m_b| (1 - beta) + eps);
    c >= KEEP:      Delta_b kept;
    c < 0:          Delta_b - shrink c |Delta_b| v, shrink = min(K_S (-c) conf, SHRINK_MAX)
                    (part of the component against the momentum removed);
    0 <= c < KEEP:  |Delta_b| w / |w|, w = (1 - lam) u + lam v, lam = min(K_D (1 - c) conf, 1)
                    (turned toward the momentum, its norm kept).
  Our momentum is a sum (m <- beta m + g, as optax.sgd) where HeLoCo's is an average
  (m <- mu m + (1 - mu) G): `(1 - beta) |m|` is the norm comparable to a contribution's, hence
  that factor in conf. Each corrected tensor is a Delta_b + b m_b: `heloco_coefficients`.
- `age`: CGAD (Shah and Sun, arXiv 2605.09126) scales an incoming pseudo-gradient by
  sigma(s) = gamma(s) exp(-alpha s), a cosine gate gamma that reaches 0 at a cut-off; here
  alpha = `outer.staleness_rate` and the gate is (1 + cos(pi s / (S + 1))) / 2 with S =
  `outer.max_staleness`, so every admitted contribution keeps a positive scale and the gate
  closes where the merger drops contributions anyway (the paper's exact gate shape was not
  available here: this one is ours). CGAD feeds Adam; we feed the outer Nesterov step.

How `age` differs from `outer.staleness_decay` (weight / (1 + s)): that is a vote weight among
the islands of one merge, and RDA normalizes weights, so a merge of one island (quorum 1) is the
same step at any staleness; the age scale multiplies the contribution itself, so it shrinks the
step (and the momentum it feeds) even when it merges alone.

Arithmetic: dot products and norms are exact float64 products summed by numpy's pairwise sum
chunk by chunk in a fixed order (as training/merge/stream.py `_sq`); the corrected tensors are
float32 `a x Delta + b x m`, elementwise: the same bits on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from training.config.experiment import OuterConfig
from training.merge import stream as merge_stream

# HeLoCo's constants (names as in its equations): c_ok, k_s, beta_max, k_d, kappa.
KEEP = 0.2  # c_ok: a tensor at least this aligned with the momentum is kept
K_S = 1.0  # shrink strength: at c = -1 and conf 1/2, half the conflicting component goes
SHRINK_MAX = 1.0  # beta_max: at most the whole conflicting component
K_D = 0.5  # reorientation strength: at c = 0 and conf 1/2, a quarter of the way to the momentum
KAPPA = 1.0  # the momentum norm's weight in the confidence
EPS = 1e-12


def age_scale(outer: OuterConfig, staleness: int) -> float:
    """CGAD's sigma(s) = exp(-rate s) x (1 + cos(pi s / (max_staleness + 1))) / 2; 1 at s = 0."""
    if staleness <= 0:
        return 1.0
    cut = outer.max_staleness + 1
    gate = 0.5 * (1.0 + math.cos(math.pi * min(staleness, cut) / cut))
    return math.exp(-outer.staleness_rate * staleness) * gate


def heloco_coefficients(
    delta_norm: float, momentum_norm: float, dot: float, beta: float
) -> tuple[float, float]:
    """(a, b): HeLoCo's corrected tensor is a x Delta_b + b x m_b (module docstring), given
    |Delta_b|, |m_b|, Delta_b . m_b and the outer momentum coefficient beta. (1, 0): kept (also
    when either norm is 0: no direction to compare)."""
    if delta_norm <= 0 or momentum_norm <= 0:
        return 1.0, 0.0
    c = max(-1.0, min(1.0, dot / (delta_norm * momentum_norm)))
    if c >= KEEP:
        return 1.0, 0.0
    conf = delta_norm / (delta_norm + KAPPA * (1.0 - beta) * momentum_norm + EPS)
    if c < 0:
        shrink = min(K_S * -c * conf, SHRINK_MAX)
        return 1.0, -shrink * c * delta_norm / momentum_norm
    lam = min(K_D * (1.0 - c) * conf, 1.0)
    # |w| for w = (1 - lam) u + lam v, unit u, v with u . v = c: at least 1/sqrt(2) for c >= 0
    w_norm = math.sqrt((1.0 - lam) ** 2 + lam**2 + 2.0 * lam * (1.0 - lam) * c)
    return (1.0 - lam) / w_norm, lam * delta_norm / (momentum_norm * w_norm)


def _stats(
    vote: merge_stream.Vote, name: str, m: np.ndarray, buf: np.ndarray
) -> tuple[float, float, float]:
    """(|Delta_n|, |m_n|, Delta_n . m_n) in float64, chunk by chunk in a fixed order."""
    flat = m.reshape(-1)
    dsq = msq = dot = 0.0
    for s, e in merge_stream.spans(m.shape):
        x = vote.chunk(name, s, e, buf[: e - s])
        y = flat[s:e]
        dsq += float(np.add.reduce(np.square(x, dtype=np.float64)))
        msq += float(np.add.reduce(np.square(y, dtype=np.float64)))
        dot += float(np.add.reduce(np.multiply(x, y, dtype=np.float64)))
    return math.sqrt(dsq), math.sqrt(msq), dot


def stale_correction(
    outer: OuterConfig,
    vote: merge_stream.Vote,
    staleness: int,
    momentum: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    buf: np.ndarray,
) -> merge_stream.DenseVote | None:
    """The contribution `vote` corrected for its staleness by `outer.staleness`, as new float32
    tensors, or None where nothing changes (rule none, staleness 0, every tensor kept).
    `momentum`: the fragment's outer momentum per tensor (empty without momentum: kept)."""
    if outer.staleness == "none" or staleness <= 0:
        return None
    if outer.staleness == "age":
        scale = age_scale(outer, staleness)
        coefs = {n: (scale, 0.0) for n in shapes}
    else:
        coefs = {
            n: heloco_coefficients(*_stats(vote, n, momentum[n], buf), outer.momentum)
            for n in shapes
            if n in momentum
        }
    if all(ab == (1.0, 0.0) for ab in coefs.values()):
        return None
    out = merge_stream.DenseVote({n: np.empty(s, np.float32) for n, s in shapes.items()}, True)
    for n, shape in shapes.items():
        a, b = coefs.get(n, (1.0, 0.0))
        a32, b32 = np.float32(a), np.float32(b)
        target_all = out.flat[n]
        m = momentum[n].reshape(-1) if b else None
        for s, e in merge_stream.spans(shape):
            target = target_all[s:e]
            got = vote.chunk(n, s, e, target)
            np.multiply(got, a32, out=target)
            if m is not None:
                target += b32 * m[s:e]
    return out
