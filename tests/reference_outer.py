"""Outer optimization: optimizers as optax transforms, and how contributions are combined.

Every function here takes pseudo-gradients in the sign of `training.protocol.pseudograd` (global minus
local): an outer transform's update is *added* to the global parameters, as in optax.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from training.config.experiment import OuterConfig
from training.protocol.fragments import is_embedding


class DelayedNesterovState(NamedTuple):
    count: jax.Array  # contributions seen
    buffer: optax.Updates  # D: sum of contributions since the last momentum update
    momentum: optax.Updates  # m


def delayed_nesterov(
    learning_rate: float, momentum: float = 0.9, period: int = 1
) -> optax.GradientTransformation:
    """Delayed Nesterov (arXiv 2401.09135): momentum moves once every `period` contributions.

    On contribution g_t (t = 1, 2, ...): D <- D + g_t; if t mod N != 0 the update is -lr * g_t / N,
    else m <- beta * m + D / N, the update is -lr * (g_t / N + beta * m) and D <- 0.
    With N = 1 this is exactly `optax.sgd(lr, momentum, nesterov=True)`.
    """
    if period < 1:
        raise ValueError(f"delayed_nesterov: period must be >= 1, got {period}")

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        flush = count % period == 0
        new_m = jax.tree.map(
            lambda m, d: jnp.where(flush, momentum * m + d / period, m), state.momentum, buffer
        )
        out = jax.tree.map(
            lambda g, m: jnp.where(
                flush, -learning_rate * (g / period + momentum * m), -learning_rate * g / period
            ),
            updates,
            new_m,
        )
        buffer = jax.tree.map(lambda d: jnp.where(flush, jnp.zeros_like(d), d), buffer)
        return out, DelayedNesterovState(count, buffer, new_m)

    return optax.GradientTransformation(init_fn, update_fn)


def outer_optimizer(cfg: OuterConfig, num_islands: int) -> optax.GradientTransformation:
    """The outer transform for a method; one instance (and state) per fragment."""
    if cfg.method == "delayed_nesterov":
        return delayed_nesterov(cfg.lr, cfg.momentum, cfg.delay_period or num_islands)
    momentum = cfg.momentum or None
    return optax.sgd(cfg.lr, momentum=momentum, nesterov=cfg.nesterov and momentum is not None)


def token_weight(tokens: int, steps: int) -> float:
    """Quantity x quality: tokens^2 / steps (more data, and larger batches per step, weigh more)."""
    if tokens <= 0 or steps <= 0:
        raise ValueError(f"token_weight: tokens {tokens} and steps {steps} must be positive")
    return float(tokens) ** 2 / float(steps)


def weighted_mean(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    return (np.tensordot(w / w.sum(), np.stack(vectors), axes=1)).astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(x))
    return x / n if n > 0 else x


def radial_directional_average(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """RDA = (sum w |v| / sum w) * unit(sum w unit(v) / sum w).

    The norm is the weighted mean of the norms and the direction the weighted mean of directions, so
    averaging near-orthogonal updates does not shrink the step (a plain mean of M orthogonal vectors
    of equal norm has norm |v| / sqrt(M)).
    """
    w = np.asarray(weights, np.float64)
    w = w / w.sum()
    norms = np.array([np.linalg.norm(v) for v in vectors], np.float64)
    direction = np.tensordot(w, np.stack([_unit(v) for v in vectors]), axes=1)
    return (float(w @ norms) * _unit(direction)).astype(np.float32)


def combine(
    deltas: list[dict[str, np.ndarray]], weights: list[float], rda: bool
) -> dict[str, np.ndarray]:
    """Combine contributions to one fragment: RDA over its non-embedding tensors taken together as
    one vector, the plain weighted mean for embedding tensors (and for everything when rda=False)."""
    names = sorted(deltas[0])
    out = {n: weighted_mean([d[n] for d in deltas], weights) for n in names if is_embedding(n)}
    body = [n for n in names if not is_embedding(n)]
    if not body:
        return out
    if not rda:
        out.update({n: weighted_mean([d[n] for d in deltas], weights) for n in body})
        return out
    flat = [np.concatenate([d[n].ravel() for n in body]) for d in deltas]
    merged = radial_directional_average(flat, weights)
    offset = 0
    for n in body:
        size = deltas[0][n].size
        out[n] = merged[offset : offset + size].reshape(deltas[0][n].shape)
        offset += size
    return out


def scale(delta: dict[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    return {k: v * np.float32(factor) for k, v in delta.items()}


def global_norm(delta: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.vdot(v, v)) for v in delta.values())))


def clip_to(delta: dict[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], bool]:
    """Scale `delta` down to `max_norm` if it is larger; returns (delta, clipped)."""
    norm = global_norm(delta)
    if norm <= max_norm or norm == 0:
        return delta, False
    scale = np.float32(max_norm / norm)
    return {k: v * scale for k, v in delta.items()}, True


def apply_outer(
    tx: optax.GradientTransformation,
    params: dict[str, np.ndarray],
    state,
    delta: dict[str, np.ndarray],
):
    """One outer step on one fragment: returns (new params, new state), host arrays."""
    updates, state = tx.update({k: jnp.asarray(v) for k, v in delta.items()}, state, params)
    new = {k: np.asarray(params[k] + np.asarray(updates[k]), np.float32) for k in params}
    return new, state
