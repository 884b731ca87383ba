"""Outer optimizers and combiners: sign, FedAvg identity, Delayed Nesterov, RDA, token weights."""

import numpy as np
import optax
import pytest

from tests import reference_outer as outer
from training.config.experiment import OuterConfig
from training.protocol.pseudograd import delta


def _tree(rng, scale=1.0):
    return {
        "blocks/0/w": rng.normal(size=(3, 4)).astype(np.float32) * scale,
        "embed/embedding": rng.normal(size=(5, 2)).astype(np.float32) * scale,
    }


def _pseudo_gradient(base, local):
    """The island's pseudo-gradient of a tree: `delta` per tensor (as the device encoder)."""
    return {k: delta(base[k], local[k]) for k in local}


def test_pseudo_gradient_is_global_minus_local():
    base = np.array([1.0, 2.0], np.float32)
    local = np.array([0.5, 3.0], np.float32)
    # (1 - 0.5, 2 - 3) = (0.5, -1)
    np.testing.assert_array_equal(delta(base, local), [0.5, -1.0])


def test_outer_sgd_lr1_on_mean_delta_equals_parameter_average():
    """The sign test: a flipped pseudo-gradient would move the global away from the islands."""
    rng = np.random.default_rng(0)
    theta = _tree(rng)
    islands = [_tree(rng) for _ in range(3)]
    deltas = [_pseudo_gradient(theta, isl) for isl in islands]
    mean_delta = outer.combine(deltas, [1.0, 1.0, 1.0], rda=False)
    tx = optax.sgd(1.0)
    new, _ = outer.apply_outer(tx, theta, tx.init(theta), mean_delta)
    for k in theta:
        np.testing.assert_allclose(new[k], np.mean([i[k] for i in islands], axis=0), atol=1e-6)


def test_delayed_nesterov_with_period_1_is_nesterov():
    rng = np.random.default_rng(1)
    params = _tree(rng)
    dn, ref = outer.delayed_nesterov(0.7, 0.9, period=1), optax.sgd(0.7, 0.9, nesterov=True)
    p1, s1 = params, dn.init(params)
    p2, s2 = params, ref.init(params)
    for _ in range(4):
        g = _tree(rng)
        p1, s1 = outer.apply_outer(dn, p1, s1, g)
        p2, s2 = outer.apply_outer(ref, p2, s2, g)
    for k in params:
        np.testing.assert_allclose(p1[k], p2[k], rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_moves_momentum_once_per_period():
    # lr 1, beta 0.5, N 2, scalar contributions g1 = 2, g2 = 4:
    # t=1: update -g1/N = -1 (momentum untouched)
    # t=2: m = 0.5*0 + (2+4)/2 = 3; update -(g2/N + beta*m) = -(2 + 1.5) = -3.5
    tx = outer.delayed_nesterov(1.0, 0.5, period=2)
    p = {"w": np.zeros((), np.float32)}
    s = tx.init(p)
    p, s = outer.apply_outer(tx, p, s, {"w": np.float32(2.0)})
    assert float(p["w"]) == pytest.approx(-1.0)
    p, s = outer.apply_outer(tx, p, s, {"w": np.float32(4.0)})
    assert float(p["w"]) == pytest.approx(-4.5)
    assert float(s.momentum["w"]) == pytest.approx(3.0)
    assert float(s.buffer["w"]) == 0.0


def test_rda_keeps_norm_of_orthogonal_updates():
    # two orthogonal unit vectors: the mean has norm 1/sqrt(2), RDA keeps norm 1
    a, b = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    rda = outer.radial_directional_average([a, b], [1.0, 1.0])
    assert np.linalg.norm(rda) == pytest.approx(1.0)
    np.testing.assert_allclose(rda, [2**-0.5, 2**-0.5], rtol=1e-6)
    assert np.linalg.norm(outer.weighted_mean([a, b], [1.0, 1.0])) == pytest.approx(2**-0.5)


def test_rda_of_identical_vectors_is_that_vector():
    v = np.array([3.0, -4.0], np.float32)
    np.testing.assert_allclose(outer.radial_directional_average([v, v, v], [1, 2, 3]), v, rtol=1e-6)


def test_combine_uses_weighted_mean_for_embeddings_and_rda_for_the_rest():
    d1 = {
        "embed/embedding": np.array([1.0, 0.0], np.float32),
        "blocks/0/w": np.array([1.0, 0.0], np.float32),
    }
    d2 = {
        "embed/embedding": np.array([0.0, 1.0], np.float32),
        "blocks/0/w": np.array([0.0, 1.0], np.float32),
    }
    out = outer.combine([d1, d2], [1.0, 1.0], rda=True)
    np.testing.assert_allclose(out["embed/embedding"], [0.5, 0.5])
    np.testing.assert_allclose(out["blocks/0/w"], [2**-0.5, 2**-0.5], rtol=1e-6)


def test_token_weight_is_tokens_squared_over_steps():
    # 1000 tokens in 10 steps: 1000^2 / 10 = 100000
    assert outer.token_weight(1000, 10) == 100_000
    with pytest.raises(ValueError):
        outer.token_weight(0, 10)


def test_clip_to_scales_down_only_large_deltas():
    d = {"w": np.array([3.0, 4.0], np.float32)}  # norm 5
    same, clipped = outer.clip_to(d, 10.0)
    assert not clipped and same is d
    small, clipped = outer.clip_to(d, 1.0)
    assert clipped and outer.global_norm(small) == pytest.approx(1.0)


def test_delayed_nesterov_period_defaults_to_the_number_of_islands():
    tx = outer.outer_optimizer(OuterConfig(method="delayed_nesterov", momentum=0.9), 4)
    state = tx.init({"w": np.zeros(2, np.float32)})
    for i in range(4):  # momentum moves once per 4 updates (delay_period unset: M = 4)
        _, state = tx.update({"w": np.ones(2, np.float32)}, state)
        np.testing.assert_allclose(state.momentum["w"], 1.0 if i == 3 else 0.0)


def test_decoupled_without_momentum_is_sgd_at_the_outer_lr():
    cfg = OuterConfig(method="decoupled", momentum=0.0)
    tx = outer.outer_optimizer(cfg, 4)
    p = {"w": np.ones(2, np.float32)}
    new, _ = outer.apply_outer(tx, p, tx.init(p), {"w": np.ones(2, np.float32)})
    np.testing.assert_allclose(new["w"], 1 - cfg.lr)  # 1 - 0.5: the default outer lr
