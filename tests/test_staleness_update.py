"""Staleness-aware outer updates (training/merge/staleness.py): HeLoCo's momentum correction and
CGAD's age scale, on hand-derived cases, through the merger, and wired into a virtual-clock run."""

import math

import numpy as np
import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.bench.sim import run_islands
from training.config.experiment import OuterConfig
from training.merge import staleness
from training.merge import stream as merge_stream
from training.merge.merger import Merger

# |Delta| = 1, |m| = 10, beta = 0.9: conf = 1 / (1 + kappa (1 - 0.9) 10) = 1/2 (kappa = 1)
NORM_M, BETA = 10.0, 0.9


def _corrected(delta, m):
    """a Delta + b m with HeLoCo's coefficients for one 2-element tensor."""
    delta, m = np.asarray(delta, np.float64), np.asarray(m, np.float64)
    a, b = staleness.heloco_coefficients(
        float(np.linalg.norm(delta)), float(np.linalg.norm(m)), float(delta @ m), BETA
    )
    return a * delta + b * m


@pytest.mark.parametrize("m", [(10.0, 0.0), (5.0, 5.0 * math.sqrt(3))], ids=["c=1", "c=0.5"])
def test_an_aligned_tensor_is_kept(m):
    # c = 1 and c = cos 60 deg = 0.5, both >= KEEP = 0.2: (a, b) = (1, 0)
    assert staleness.heloco_coefficients(1.0, NORM_M, m[0], BETA) == (1.0, 0.0)


def test_an_opposed_tensor_loses_half_its_conflicting_component():
    # c = -1, conf = 1/2: shrink = min(K_S x 1 x 1/2, 1) = 1/2;
    # Delta - shrink c |Delta| v = (1, 0) - 1/2 (-1) (-1, 0) = (0.5, 0)
    np.testing.assert_allclose(_corrected((1, 0), (-NORM_M, 0)), (0.5, 0.0), atol=1e-9)


def test_a_partly_opposed_tensor_keeps_its_orthogonal_part():
    # v = (-0.6, 0.8), c = -0.6, conf = 1/2: shrink = 0.6 x 1/2 = 0.3;
    # (1, 0) + 0.3 x 0.6 x (-0.6, 0.8) = (1 - 0.108, 0.144) = (0.892, 0.144)
    got = _corrected((1, 0), (-0.6 * NORM_M, 0.8 * NORM_M))
    np.testing.assert_allclose(got, (0.892, 0.144), atol=1e-9)


def test_an_orthogonal_tensor_turns_toward_the_momentum_keeping_its_norm():
    # c = 0, conf = 1/2: lam = min(K_D x (1 - 0) x 1/2, 1) = 1/4; w = 3/4 u + 1/4 v =
    # (0.75, 0.25), |w| = sqrt(0.625) = 0.790569; |Delta| w / |w| = (0.948683, 0.316228)
    np.testing.assert_allclose(_corrected((1, 0), (0, NORM_M)), (0.948683, 0.316228), atol=1e-6)


def test_zero_momentum_keeps_the_contribution():
    assert staleness.heloco_coefficients(1.0, 0.0, 0.0, BETA) == (1.0, 0.0)


@pytest.mark.parametrize(
    "rate, s, expected",
    [
        (0.1, 0, 1.0),  # the rule's fixed point: a fresh contribution is untouched
        # cut = max_staleness + 1 = 4: exp(-0.1) (1 + cos(pi/4)) / 2 = 0.904837 x 0.853553
        (0.1, 1, 0.772328),
        # exp(-0.3) (1 + cos(3 pi/4)) / 2 = 0.740818 x 0.146447
        (0.1, 3, 0.108490),
        (0.0, 2, 0.5),  # no decay, the gate alone at half the cut: (1 + cos(pi/2)) / 2
    ],
)
def test_the_age_scale(rate, s, expected):
    outer = OuterConfig(staleness="age", staleness_rate=rate, max_staleness=3)
    assert staleness.age_scale(outer, s) == pytest.approx(expected, abs=1e-6)


def _vote():
    return merge_stream.DenseVote({"w": np.array([1.0, 0.0], np.float32)})


def test_a_fresh_contribution_or_the_rule_none_is_the_same_vote():
    m, shapes = {"w": np.array([0.0, 10.0], np.float32)}, {"w": (2,)}
    buf = merge_stream.scratch()
    for outer, s in [(OuterConfig(staleness="momentum"), 0), (OuterConfig(), 3)]:
        assert staleness.stale_correction(outer, _vote(), s, m, shapes, buf) is None


def test_a_stale_vote_is_corrected_tensor_by_tensor():
    # tensor "w": the orthogonal case above (0.948683, 0.316228); tensor "k": aligned, kept
    outer = OuterConfig(staleness="momentum", momentum=BETA)
    vote = merge_stream.DenseVote(
        {"w": np.array([1.0, 0.0], np.float32), "k": np.array([2.0, 1.0], np.float32)}
    )
    m = {"w": np.array([0.0, 10.0], np.float32), "k": np.array([4.0, 2.0], np.float32)}
    shapes = {"w": (2,), "k": (2,)}
    out = staleness.stale_correction(outer, vote, 2, m, shapes, merge_stream.scratch())
    np.testing.assert_allclose(out.flat["w"], (0.948683, 0.316228), atol=1e-6)
    assert out.flat["k"].tolist() == [2.0, 1.0]


def test_momentum_correction_needs_momentum():
    with pytest.raises(ValueError, match="outer.staleness = momentum"):
        OuterConfig(staleness="momentum", momentum=0.0)


def _two_merges(outer):
    """Island a's g1 merged (version 1), then island b's g2 = -g1 from base 0 (staleness 1);
    returns (g1, the parameters after each merge)."""
    cfg = small_config(outer={"method": "nesterov", "lr": 1.0, **outer})
    store = new_store(cfg)
    theta0 = store.load_params()
    g1 = random_delta(theta0, 0)
    publish_delta(store, cfg, "a", 0, g1)
    Merger(cfg, store).merge_once()
    theta1 = store.load_params()
    publish_delta(store, cfg, "b", 0, {k: -v for k, v in g1.items()}, base_version=0)
    Merger(cfg, store).merge_once()
    return g1, theta1, store.load_params()


def test_the_merger_corrects_a_stale_conflicting_contribution_with_the_momentum():
    # momentum after merge 1: m = g1. b's g2 = -g1: per tensor c = -1, |g2| = |m|, so conf =
    # 1 / (1 + 0.1) = 10/11, shrink = 10/11, g = -g1 + 10/11 g1 = -g1/11; Nesterov, lr 1:
    # m2 = 0.9 g1 - g1/11, theta2 = theta1 - (g + 0.9 m2)
    g1, theta1, theta2 = _two_merges({"momentum": 0.9, "staleness": "momentum"})
    for k, v in g1.items():
        g = -v.astype(np.float64) / 11
        np.testing.assert_allclose(theta2[k], theta1[k] - (g + 0.9 * (0.9 * v + g)), atol=1e-6)


def test_the_merger_scales_a_stale_contribution_by_its_age():
    # momentum 0, lr 1: theta2 = theta1 - sigma(1) g2 = theta1 + 0.772328 g1 (rate 0.1, S = 3)
    outer = {"momentum": 0.0, "staleness": "age", "max_staleness": 3}
    g1, theta1, theta2 = _two_merges(outer)
    for k, v in g1.items():
        np.testing.assert_allclose(theta2[k], theta1[k] + 0.772328 * v, atol=1e-6)


def test_the_switch_changes_a_virtual_clock_run_only_through_stale_contributions():
    # two islands at speeds 1 and 0.5, quorum 1, no grace: b's contributions arrive after a's
    # merges (staleness > 0), so the age rule changes the final parameters; none does not
    def run(rule):
        cfg = small_config(
            islands=({"name": "a", "speed": 1.0}, {"name": "b", "speed": 0.5}),
            outer={
                "method": "decoupled",
                "max_grace_s": 0.0,
                "grace_min_steps": 0.0,
                "staleness": rule,
            },
            token_budget=12 * 4 * 4 * 32,
        )
        return run_islands(cfg, eval_dt=1e9, trace_every=1)

    none, age = run("none"), run("age")
    stale = [
        c["staleness"] for m in none["trace"] if m["kind"] == "merge" for c in m["contributions"]
    ]
    assert max(stale) > 0
    assert age["params_sha256"] != none["params_sha256"]
