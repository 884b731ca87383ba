"""The merge's one pass (native.c `fold_outer_encode_sq`): an update kept as the votes to fold
(kernels.Folded, never written out) gives the outer step, the update's encode and the new
params' norm terms of the accumulator fold_votes writes, bit for bit, on any thread count and
past a block the encode refuses; a Combiner finishes into it with the same gains; and a merge
of quantized votes holds no fragment-sized accumulator."""

import numpy as np
import pytest

from training.codecs import host as codecs
from training.codecs import kernels, native
from training.config.experiment import OuterConfig
from training.merge import combine
from training.merge import stream as merge_stream
from training.merge.outer import init_state, outer_step_

needs_native = pytest.mark.skipif(
    native.library() is None,
    reason="the C loops are not loaded (no C compiler, or DILOCO_NATIVE=0)",
)
SHAPES = {"w": (3 * kernels.CHUNK + 77,), "b": (1001,)}


def _bits(arrays) -> list[bytes]:
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrays]


def _folded(seed: int, codecs_of=("int4", "int8", "int4"), zero_at=None) -> dict:
    """Per tensor, a kernels.Folded of three votes (codes of random values; `zero_at`: 300
    elements of "w" zero in every vote, so their update is 0 there)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, shape in SHAPES.items():
        votes = []
        for i, codec in enumerate(codecs_of):
            x = rng.normal(0, 1e-2, shape).astype(np.float32)
            if zero_at is not None and n == "w":
                x[zero_at : zero_at + 300] = 0.0
            payload, _ = codecs.encode({n: x}, codec)
            t = codecs.tensor_codes(payload, n, codec)
            votes.append((codec, t.data, t.scales * np.float32(0.5 + i)))
        out[n] = kernels.Folded(votes, shape[0], codecs.DEFAULT_BLOCK)
    return out


def _run(folded: bool, encode: bool, seed: int = 3, zero_at=None) -> tuple:
    """The outer step (and the update's encode against a shadow) of the votes' accumulator,
    handed over as kernels.Folded or as the array fold_votes writes; what it all writes."""
    outer = OuterConfig(method="decoupled", lr=0.7, momentum=0.9)
    rng = np.random.default_rng(seed)
    params = {n: rng.normal(0, 1, s).astype(np.float32) for n, s in SHAPES.items()}
    state = init_state(outer, SHAPES)
    for n in SHAPES:
        state.momentum[n][...] = rng.normal(0, 1e-2, SHAPES[n])
    shadow = {n: v - np.float32(1e-3) for n, v in params.items()}
    if zero_at is not None:  # params, momentum and the update 0 there, the update's block 1e-38
        params["w"][zero_at : zero_at + 300] = 0.0
        state.momentum["w"][zero_at : zero_at + 300] = 0.0
        shadow["w"][zero_at : zero_at + 300] = np.float32(-1e-38)
    votes = _folded(seed + 1, zero_at=zero_at)
    delta = votes if folded else {n: f.dense() for n, f in votes.items()}
    gains = {"w": [np.float32(0.5)], "b": [np.float32(2.0)]}
    pending = codecs.PendingStep(shadow, "int4") if encode else None
    sums: dict = {}
    outer_step_(outer, 4, params, state, delta, gains=gains, params_sq=sums, encode=pending)
    payload = pending.payload(params) if encode else {}
    arrays = [*params.values(), *state.momentum.values(), *shadow.values(), *payload.values()]
    return sums, _bits(arrays)


@needs_native
@pytest.mark.parametrize("encode", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_an_update_folded_in_the_outer_steps_pass_is_the_accumulators_step(
    encode, threads, chunk_threads
):
    chunk_threads(threads)
    assert _run(folded=True, encode=encode) == _run(folded=False, encode=encode)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_past_a_block_the_encode_refuses_the_folded_pass_is_the_accumulators(
    threads, chunk_threads
):
    # chunk 1 of "w" holds a block whose update is 1e-38 (7 / 1e-38 overflows float32): the
    # C loop stops there; the blocks after it are folded and stepped without the encode, the
    # encode from the refused block on redone outside it
    chunk_threads(threads)
    at = kernels.CHUNK + 256
    assert _run(True, True, zero_at=at) == _run(False, True, zero_at=at)


@needs_native
def test_the_folded_accumulators_chunk_sums_are_the_written_ones():
    folded = _folded(5)["w"]
    acc = np.empty(folded.size, np.float32)
    step = codecs.chunk_step()
    want = np.empty(-(-folded.size // step), np.float64)
    kernels.fold_votes(folded.votes, folded.size, folded.block, step, acc, True, want)
    assert folded.sums(step) == want.tolist()


def _combiner(lazy: bool):
    rng = np.random.default_rng(11)
    shapes = {"embed": (2, 300), "w": (kernels.CHUNK + 5,)}
    c = combine.Combiner(shapes, rda=True)
    for i in range(3):
        payload, _ = codecs.encode(
            {n: rng.normal(0, 1e-2, s).astype(np.float32) for n, s in shapes.items()}, "int4"
        )
        vote = merge_stream.PayloadVote(
            {n: codecs.tensor_codes(payload, n, "int4") for n in shapes}
        )
        c.add(vote, weight=1.0 + i)
    acc, gains = c.finish(lazy=lazy)
    dense = {n: a.dense() if isinstance(a, kernels.Folded) else a for n, a in acc.items()}
    return _bits(dense.values()), gains


@needs_native
def test_a_combiner_finishes_lazily_into_the_same_update_and_gains():
    lazy, eager = _combiner(True), _combiner(False)
    assert lazy == eager


@needs_native
def test_a_merge_of_quantized_votes_writes_no_accumulator():
    from tests.helpers import new_store, publish_delta, random_delta, small_config
    from training.merge.merger import Merger

    cfg = small_config(islands=("a", "b"), codec="int4", outer={"method": "decoupled"})
    store = new_store(cfg)
    params = store.load_params()
    for seq, island in enumerate(("a", "b")):
        publish_delta(store, cfg, island, seq, random_delta(params, seed=seq), 0)
    merger = Merger(cfg, store)
    assert merger.merge_once().applied
    assert merger._arena._flat.size == 0
