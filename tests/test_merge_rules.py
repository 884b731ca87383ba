"""The merge's pure rules: the in-place outer step against optax, the streaming combiner against
the whole-array reference, and the end-of-run rule for final remainders."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import reference_outer as outer
from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.config.experiment import OuterConfig
from training.merge import admit
from training.merge.combine import Combiner
from training.merge.merger import Merger
from training.merge.outer import init_state, outer_step_

SHAPES = {"blocks/0/w": (3, 4), "blocks/1/b": (5,), "embed/tokens": (6, 2)}


def _deltas(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]


def _run_optax(tx, steps):
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = tx.init(params)
    for g in steps:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("nesterov", [True, False])
def test_in_place_outer_step_equals_optax_sgd_with_momentum(nesterov):
    cfg = OuterConfig(method="decoupled", lr=0.7, momentum=0.9, nesterov=nesterov)
    steps = _deltas(4)
    expected = _run_optax(optax.sgd(0.7, momentum=0.9, nesterov=nesterov), steps)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    state = init_state(cfg, SHAPES)
    for g in steps:
        state = outer_step_(cfg, 1, params, state, {k: v.copy() for k, v in g.items()})
    assert state.steps == 4
    for k in SHAPES:
        np.testing.assert_allclose(params[k], np.asarray(expected[k]), rtol=1e-5, atol=1e-6)


def test_in_place_delayed_nesterov_equals_the_optax_transform():
    cfg = OuterConfig(method="delayed_nesterov", lr=0.5, momentum=0.8, delay_period=2)
    steps = _deltas(5, seed=1)
    expected = _run_optax(outer.delayed_nesterov(0.5, 0.8, period=2), steps)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    state = init_state(cfg, SHAPES)
    for g in steps:
        state = outer_step_(cfg, 2, params, state, {k: v.copy() for k, v in g.items()})
    for k in SHAPES:
        np.testing.assert_allclose(params[k], np.asarray(expected[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rda", [True, False])
def test_streaming_combiner_equals_the_whole_array_combine(rda):
    votes, weights = _deltas(3, seed=2), [1.0, 3.0, 0.5]
    expected = outer.combine(votes, weights, rda=rda)
    combiner = Combiner(SHAPES, rda)
    for v, w in zip(votes, weights, strict=True):
        combiner.add({k: x.copy() for k, x in v.items()}, w)
    got = combiner.result()
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6)


def test_rda_keeps_the_norm_of_orthogonal_votes():
    # two orthogonal body votes of norm 2: the mean has norm sqrt(2), RDA keeps 2
    shapes = {"blocks/0/w": (2,)}
    combiner = Combiner(shapes, rda=True)
    combiner.add({"blocks/0/w": np.array([2.0, 0.0], np.float32)}, 1.0)
    combiner.add({"blocks/0/w": np.array([0.0, 2.0], np.float32)}, 1.0)
    assert np.linalg.norm(combiner.result()["blocks/0/w"]) == pytest.approx(2.0)


def test_a_final_remainder_moves_the_parameters_by_lr_times_delta_only():
    cfg = OuterConfig(method="decoupled", lr=0.5, momentum=0.9)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    state = init_state(cfg, SHAPES)
    for g in _deltas(3, seed=3):  # build up momentum
        state = outer_step_(cfg, 1, params, state, g)
    before = {k: v.copy() for k, v in params.items()}
    momentum = {k: v.copy() for k, v in state.momentum.items()}
    tiny = {k: np.full(s, 1e-3, np.float32) for k, s in SHAPES.items()}
    after_state = outer_step_(cfg, 1, params, state, dict(tiny), final=True)
    for k in SHAPES:  # -lr * delta (to float32 rounding); a momentum step adds ~lr*beta^2*m
        np.testing.assert_allclose(params[k] - before[k], -0.5 * tiny[k], atol=1e-6)
        np.testing.assert_array_equal(after_state.momentum[k], momentum[k])
    assert after_state.steps == state.steps


def test_merger_applies_an_islands_final_remainder_without_a_momentum_step():
    """The end-of-run degradation: a remainder of a few steps merged with a full Nesterov step
    moves the model by lr * beta^2 * m, whatever its own size. Merged as final, it moves by
    lr * delta only."""
    cfg = small_config(outer={"method": "decoupled", "lr": 0.5, "momentum": 0.9, "rda": False})
    store = new_store(cfg)
    theta = store.load_params()
    merger = Merger(cfg, store)
    for seq in range(3):  # momentum builds up over three merged rounds of both islands
        for n, island in enumerate("ab"):
            publish_delta(store, cfg, island, seq, random_delta(theta, 10 * seq + n), seq)
        assert merger.merge_once().version == seq + 1
    before = store.load_params()
    tiny = {k: np.full(v.shape, 1e-4, np.float32) for k, v in theta.items()}
    for island in "ab":
        payload_ref = publish_delta(
            store, cfg, island, 3, tiny, base_version=3, steps=1, tokens=128
        )
        manifest = dict(payload_ref.manifest, final=True)
        store.store.write(store.object_key(f"pseudograds/{payload_ref.id}.json"), _json(manifest))
    r = merger.merge_once()
    assert sorted(r.applied) == ["a/00000003-f000", "b/00000003-f000"]
    after = store.load_params()
    for k in theta:
        np.testing.assert_allclose(after[k] - before[k], -0.5 * tiny[k], atol=1e-6)


def _json(obj):
    from training.store.layout import dump_json

    return dump_json(obj)


BIG = {"blocks/0/w": (3, 100_003), "embed/tokens": (300_001,)}  # several chunks, odd sizes


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "bf16", "fp32"])
def test_a_payload_read_in_chunks_folds_as_its_decoded_arrays(codec):
    """Same norms, same fold (quantized codes fold the vote's coefficient into their block
    scales, rounded once: equal to float32 rounding; fp32 / bf16 bit for bit)."""
    from training.codecs import host as codecs
    from training.merge import stream as merge_stream

    rng = np.random.default_rng(4)
    deltas = [{k: rng.normal(0, 1e-2, s).astype(np.float32) for k, s in BIG.items()}]
    deltas.append({k: v * -0.5 + 1e-3 for k, v in deltas[0].items()})
    payloads = [codecs.encode(d, codec)[0] for d in deltas]
    streamed, whole = Combiner(BIG, True), Combiner(BIG, True)
    for payload, w in zip(payloads, [1.0, 2.5], strict=True):
        vote = admit.check_payload(payload, codec, BIG)
        total, body = admit.vote_sq_norms(vote, BIG, streamed.body, streamed.scratch)
        decoded = codecs.decode(payload, codec)
        exact = sum(float(np.vdot(v.astype(np.float64), v)) for v in decoded.values())
        assert total == pytest.approx(exact, rel=1e-5)  # float32 dots per chunk
        streamed.add(vote, w, 0.5, body)
        whole.add(decoded, w, 0.5)
    got, want = streamed.result(), whole.result()
    for k in BIG:
        if codec in ("fp32", "bf16"):
            np.testing.assert_array_equal(got[k], want[k])
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-9)
    votes = [admit.check_payload(p, codec, BIG) for p in payloads]
    summed = merge_stream.add_votes(votes[0], votes[1], BIG, streamed.scratch)
    summed = merge_stream.add_votes(summed, votes[0], BIG, streamed.scratch)  # in place
    decoded = [codecs.decode(p, codec) for p in payloads]
    for k in BIG:
        expected = decoded[0][k] + decoded[1][k]
        expected += decoded[0][k]
        np.testing.assert_array_equal(summed.flat[k].reshape(BIG[k]), expected)


def test_a_payload_value_problem_is_found_by_the_norm_pass():
    from training.codecs import host as codecs

    payload, _ = codecs.encode({k: np.ones(s, np.float32) for k, s in BIG.items()}, "int8")
    bad = dict(payload, **{"embed/tokens": payload["embed/tokens"].copy()})
    bad["embed/tokens"][200_000] = -128
    vote = admit.check_payload(bad, "int8", BIG)
    with pytest.raises(
        ValueError, match="unreadable payload: payload tensor 'embed/tokens' has codes"
    ):
        admit.vote_sq_norms(vote, BIG, [], np.empty(1 << 17, np.float32))
    nan = dict(payload, **{"embed/tokens.__scale": payload["embed/tokens.__scale"].copy()})
    nan["embed/tokens.__scale"][-1] = np.nan
    with pytest.raises(ValueError, match="non-finite values in embed/tokens"):
        admit.vote_sq_norms(admit.check_payload(nan, "int8", BIG), BIG, [], np.empty(1 << 17))


def test_an_islands_two_pending_contributions_are_summed_into_one_vote():
    """Decoupled, RDA, outer SGD lr 1: island a's two contributions are one vote (their sum),
    island b's one; the new parameters are theta - combine([a1 + a2, b]) (the whole-array
    reference of tests/reference_outer.py), equal weights."""
    cfg = small_config(
        outer={
            "method": "decoupled",
            "lr": 1.0,
            "momentum": 0.0,
            "token_weighting": False,
            "staleness_decay": False,
            "partial_scaling": False,
        },
        codec="fp32",
    )
    store = new_store(cfg)
    theta = store.load_params()
    a1, a2, b = (random_delta(theta, s) for s in (1, 2, 3))
    publish_delta(store, cfg, "a", 0, a1)
    publish_delta(store, cfg, "a", 1, a2)
    publish_delta(store, cfg, "b", 0, b)
    r = Merger(cfg, store).merge_once()
    assert sorted(r.applied) == ["a/00000000-f000", "a/00000001-f000", "b/00000000-f000"]
    expected = outer.combine([{k: a1[k] + a2[k] for k in a1}, b], [1.0, 1.0], rda=True)
    new = store.load_params()
    for k in theta:
        np.testing.assert_allclose(new[k], theta[k] - expected[k], rtol=1e-5, atol=1e-6)


def _one_step(share: float, fractional: bool) -> tuple[float, float]:
    """theta, m after one Nesterov outer step from theta 0, m 1 with g = 0.2 at `share`."""
    cfg = OuterConfig(method="decoupled", lr=0.5, momentum=0.8, fractional_momentum=fractional)
    shapes = {"w": (1,)}
    state = init_state(cfg, shapes)
    state.momentum["w"][...] = 1.0
    params = {"w": np.zeros(1, np.float32)}
    state = outer_step_(cfg, 1, params, state, {"w": np.full(1, 0.2, np.float32)}, share=share)
    return float(params["w"][0]), float(state.momentum["w"][0])


def test_fractional_momentum_makes_a_half_merge_half_an_outer_step():
    # share 0.5: m = 0.8^0.5 x 1 + 0.2 = 1.094427; theta = -0.5 (0.2 + 0.5 x 0.8 x m) = -0.318885
    # (the plain rule: m = 1.0, theta = -0.5 (0.2 + 0.8) = -0.5, the whole momentum re-applied)
    theta, m = _one_step(0.5, fractional=True)
    assert (theta, m) == pytest.approx((-0.318885, 1.094427), abs=1e-6)
    assert _one_step(0.5, fractional=False) == pytest.approx((-0.5, 1.0), abs=1e-6)


def test_fractional_momentum_leaves_a_full_merge_as_it_was():
    assert _one_step(1.0, fractional=True) == _one_step(1.0, fractional=False)
