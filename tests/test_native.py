"""The C loops (training/codecs/native.c) give the numpy path's bits, and the fused steps are
what they replace."""

import numpy as np
import pytest

from training.codecs import host as codecs
from training.codecs import kernels, native

LEVELS = {"int8": 127.0, "int4": 7.0, "int2": 1.5}

needs_native = pytest.mark.skipif(
    native.library() is None,
    reason="the C loops are not loaded (no C compiler, or DILOCO_NATIVE=0)",
)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    tiny = np.full(300, 1e-38, np.float32)  # levels / absmax overflows: the chunk goes to numpy
    tiny[::3] = 0.0
    zeros = np.zeros(513, np.float32)
    zeros[::2] = -0.0
    return {
        "chunks": rng.normal(0, 1e-2, 3 * kernels.CHUNK + 77).astype(np.float32),
        "odd": rng.normal(0, 1, 1001).astype(np.float32),
        "signs": np.array([-0.3, -0.0, 0.0, 0.3, -1e-30, 1e-30, 2.5, -2.5, 3e38], np.float32),
        "tiny": tiny,
        "zeros": zeros,
        "heavy": (rng.standard_t(2, 4099) * 1e3).astype(np.float32),
        # int4: absmax 7 = levels, so x * inv = x: halves round to even (2.5 -> 2, -0.5 -> -0.0)
        "ties": np.tile(np.array([7, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 6.5], np.float32), 64),
    }


def _bits(arrays) -> list[bytes]:
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrays]


@needs_native
@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_encode_matches_numpy(codec, with_residual, numpy_only):
    for name, x in _tensors().items():
        r = np.random.default_rng(1).normal(0, 1e-4, x.size).astype(np.float32)
        r = r if with_residual else None
        if codec == "bf16":
            got, want = kernels.encode_bf16(x, r), numpy_only(kernels.encode_bf16, x, r)
        else:
            args = (x, r, LEVELS[codec], 256, codec)
            got, want = kernels.encode_quantized(*args), numpy_only(kernels.encode_quantized, *args)
        assert _bits(got) == _bits(want), f"{codec} {name}"


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_a_block_not_starting_on_a_byte_is_packed_as_numpy_does(codec, numpy_only):
    x = np.random.default_rng(5).normal(size=1001).astype(np.float32)
    args = (x, None, LEVELS[codec], 3, codec)
    assert _bits(kernels.encode_quantized(*args)) == _bits(
        numpy_only(kernels.encode_quantized, *args)
    )


@needs_native
@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_native_decode_matches_numpy_written_and_added(codec, numpy_only):
    x = _tensors()["chunks"]
    data, scales, _ = kernels.encode_quantized(x, None, LEVELS[codec], 256, codec)
    levels = {"int8": 127, "int4": 7, "int2": 0}[codec]
    base = np.random.default_rng(2).normal(size=x.size).astype(np.float32)
    for s, e in codecs.chunk_spans(x.size):
        for accumulate in (False, True):
            got, want = base[s:e].copy(), base[s:e].copy()
            args = (codec, data, scales, s, e, 256)
            kernels.decode_range(*args, got, levels, accumulate)
            numpy_only(kernels.decode_range, *args, want, levels, accumulate)
            assert got.tobytes() == want.tobytes()


@needs_native
@pytest.mark.parametrize(("codec", "bad"), [("int8", 0x80), ("int4", 0x80), ("int4", 0x08)])
def test_native_decode_refuses_invalid_codes(codec, bad):
    data = np.full(300 if codec == "int8" else 150, 0x11, np.uint8)
    data[77] = bad
    scales = np.ones(2, np.float32)
    out = np.zeros(300, np.float32)
    with pytest.raises(ValueError, match="codes outside"):
        kernels.decode_range(
            codec,
            data.view(np.int8) if codec == "int8" else data,
            scales,
            0,
            300,
            256,
            out,
            {"int8": 127, "int4": 7}[codec],
        )
    assert not out.any()


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "int2"])
def test_step_is_encode_then_decode_then_add(codec):
    """encode_*_step(target, base): the payload of target - base, and base + decode(it)."""
    for name, target in _tensors().items():
        base = np.random.default_rng(3).normal(0, 1e-3, target.size).astype(np.float32)
        delta = np.subtract(target, base, dtype=np.float32)
        shape = (target.size,)
        payload, _ = codecs.encode({"x": delta.reshape(shape)}, codec)
        want = np.add(base, codecs.decode(payload, codec)["x"], dtype=np.float32)
        stepped = base.copy()
        if codec == "bf16":
            got = [kernels.encode_bf16_step(target, stepped)]
            expected = [payload["x"].view(np.uint16)]
        else:
            got = list(kernels.encode_quantized_step(target, stepped, LEVELS[codec], 256, codec))
            expected = [payload["x"].reshape(-1), payload["x.__scale"]]
        assert _bits(got) == _bits(expected), f"{codec} {name}: payload"
        assert stepped.tobytes() == want.tobytes(), f"{codec} {name}: new base"


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_non_finite_input_raises(codec):
    x = np.ones(1000, np.float32)
    x[999] = np.nan
    with pytest.raises(kernels.NonFinite):
        if codec == "bf16":
            kernels.encode_bf16(x, None)
        else:
            kernels.encode_quantized(x, None, 127.0, 256, codec)


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_encode_step_is_the_payload_of_the_difference(codec):
    rng = np.random.default_rng(4)
    target = {"w": rng.normal(size=(37, 30)).astype(np.float32), "b": np.float32(rng.normal())}
    target["b"] = np.asarray(target["b"], np.float32)
    base = {n: np.asarray(v + rng.normal(0, 1e-2, v.shape), np.float32) for n, v in target.items()}
    delta = {n: np.subtract(target[n], base[n], dtype=np.float32) for n in target}
    payload, _ = codecs.encode(delta, codec)
    decoded = codecs.decode(payload, codec)
    want = {n: np.add(base[n], decoded[n], dtype=np.float32) for n in base}
    got = codecs.encode_step(target, base, codec)
    assert sorted(got) == sorted(payload)
    for k in payload:
        assert got[k].dtype == payload[k].dtype and got[k].shape == payload[k].shape, k
        assert np.asarray(got[k]).tobytes() == np.asarray(payload[k]).tobytes(), k
    assert all(base[n].tobytes() == want[n].tobytes() for n in base)


@needs_native
@pytest.mark.parametrize(
    ("method", "momentum", "nesterov", "final", "seen"),
    [
        ("decoupled", 0.0, True, False, 0),
        ("decoupled", 0.9, True, False, 0),
        ("decoupled", 0.9, False, False, 0),
        ("decoupled", 0.9, True, True, 0),
        ("delayed_nesterov", 0.9, True, False, 0),  # no flush
        ("delayed_nesterov", 0.9, True, False, 3),  # the 4th contribution flushes (period 4)
    ],
)
def test_native_outer_step_matches_numpy(method, momentum, nesterov, final, seen, numpy_only):
    from training.config.experiment import OuterConfig
    from training.merge.outer import init_state, outer_step_

    outer = OuterConfig(method=method, lr=0.7, momentum=momentum, nesterov=nesterov)
    rng = np.random.default_rng(6)
    shapes = {"w": (300, 301), "b": (7,)}

    def run(step):
        params = {n: rng_copy(n, 1) for n in shapes}
        state = init_state(outer, shapes)._replace(seen=seen)
        for k in ("momentum", "buffer"):
            for n in getattr(state, k):
                getattr(state, k)[n][...] = rng_copy(n, 2 if k == "momentum" else 3)
        delta = {n: rng_copy(n, 4) for n in shapes}
        gains = {"w": [np.float32(0.5), np.float32(1.3)]}
        state = step(outer, 4, params, state, delta, final, gains)
        return [params[n] for n in shapes] + [
            v for k in ("momentum", "buffer") for v in getattr(state, k).values()
        ]

    seeds = {n: rng.integers(1 << 30) for n in shapes}

    def rng_copy(n, k):
        return np.random.default_rng(seeds[n] + k).normal(size=shapes[n]).astype(np.float32)

    assert _bits(run(outer_step_)) == _bits(numpy_only(run, outer_step_))


def _numpy_sq(x: np.ndarray) -> float:
    """The definition (training/merge/stream.py `sq`): numpy's pairwise float64 sum."""
    return float(np.add.reduce(np.square(x, dtype=np.float64)))


def _wide(rng: np.random.Generator, n: int) -> np.ndarray:
    """n float32 values whose exponents spread over 2^-12 to 2^12 of a scale from 1e-20 to 1e20:
    their float64 squares round at most adds, so a sum in another order shows."""
    scale = 10.0 ** rng.integers(-20, 20)
    return (rng.standard_t(3, n) * np.exp2(rng.integers(-12, 13, n)) * scale).astype(np.float32)


@needs_native
def test_native_sum_of_squares_is_numpys_on_every_length():
    # numpy's pairwise sum changes its shape at 8 and 128 elements and splits above 128 at
    # n / 2 rounded down to a multiple of 8: every length to 600 walks each branch (leaves of
    # 64 to 128 elements, their rests of 0 to 7), the chunk lengths (and one past) the ones a
    # merge uses
    rng = np.random.default_rng(11)
    lengths = [*range(601), 1000, 4097, codecs.chunk_step() - 1, codecs.chunk_step()]
    for n in lengths:
        x = _wide(rng, n)
        got = native.chunk_sumsq(x, max(n, 1))
        assert got.tolist() == ([_numpy_sq(x)] if n else []), n


@needs_native
@pytest.mark.parametrize("n", [codecs.chunk_step() + 1, 3 * codecs.chunk_step() + 77, 1_000_003])
def test_native_sum_of_squares_is_numpys_per_chunk_and_whole(n):
    # several chunks (the last short) and the whole tensor as one tree (leaves of many lengths)
    x = _wide(np.random.default_rng(n), n)
    x[:: 1 + n % 97] = np.float32(1e-40)  # subnormals, squared exactly in float64
    step = codecs.chunk_step()
    want = [_numpy_sq(x[s : s + step]) for s in range(0, n, step)]
    assert (native.chunk_sumsq(x, step).tolist(), native.chunk_sumsq(x, n).tolist()) == (
        want,
        [_numpy_sq(x)],
    )


@needs_native
def test_native_chunk_sums_are_each_chunks():
    # 3 chunks and 77 elements: four sums, the last of 77 elements
    x = _tensors()["chunks"]
    step = kernels.CHUNK
    got = native.chunk_sumsq(x, step)
    want = [_numpy_sq(x[s : s + step]) for s in range(0, x.size, step)]
    assert len(want) == 4 and got.tolist() == want


@needs_native
@pytest.mark.parametrize("init", [False, True])
def test_votes_folded_in_one_c_loop_are_decode_chunk_vote_after_vote(init, numpy_only):
    # int8, int4 and int2 votes with their coefficients folded into the scales, over a tensor
    # of 2 chunks and 1001 elements: the C loop (chunk by chunk, every vote into a chunk) gives
    # the bits of decoding each vote over the whole tensor in turn, and each chunk's sums
    from training.merge import stream as merge_stream

    x = np.random.default_rng(5).normal(0, 1, 2 * codecs.chunk_step() + 1001).astype(np.float32)
    codes = [_codes(c, x * (i + 1)) for i, c in enumerate(("int8", "int4", "int2"))]
    votes = [(merge_stream.PayloadVote({"w": c}), np.float32(0.5 + i)) for i, c in enumerate(codes)]
    base = np.random.default_rng(6).normal(0, 1, x.size).astype(np.float32)

    def fold():
        acc = base.copy()
        sums = merge_stream.fold_votes(votes, "w", acc, init, merge_stream.scratch(), True)
        return _bits([acc]), sums

    want_acc = base.copy()
    for k, (vote, coef) in enumerate(votes):
        folded = vote.codes["w"]._replace(scales=vote.codes["w"].scales * coef)
        for s, e in codecs.chunk_spans(x.size):
            first = init and k == 0
            codecs.decode_chunk(folded, s, e, want_acc[s:e], check=False, accumulate=not first)
    want_sums = [_numpy_sq(want_acc[s:e]) for s, e in codecs.chunk_spans(x.size)]
    assert fold() == (_bits([want_acc]), want_sums) == numpy_only(fold)


@needs_native
@pytest.mark.parametrize("k", [1, 2, 5, 70])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize(
    "size", [5, 300, codecs.chunk_step() + 512, 2 * codecs.chunk_step() + 1001]
)
def test_int8_and_int4_votes_folded_group_by_group_are_numpys_vote_after_vote(
    k, init, size, numpy_only
):
    # every vote int4 or int8: the C loop folds groups of elements with every vote added in
    # registers (70 votes: 64, then the rest); sizes below one leaf of the sum, one block and a
    # partial one, a chunk and 2 whole blocks, 2 chunks and a partial block: acc and the
    # chunks' sums are numpy's folding one vote after another over the whole tensor
    from training.merge import stream as merge_stream

    rng = np.random.default_rng(size + k)
    kinds = [("int4", "int8", "int4", "int4", "int8")[i % 5] for i in range(k)]
    codes = [
        _codes(c, rng.normal(0, 10.0 ** rng.integers(-3, 3), size).astype(np.float32))
        for c in kinds
    ]
    coefs = rng.uniform(-1.5, 1.5, k).astype(np.float32)
    votes = [
        (merge_stream.PayloadVote({"w": c}), coef) for c, coef in zip(codes, coefs, strict=True)
    ]
    base = rng.normal(0, 1, size).astype(np.float32)

    def fold(sums):
        acc = base.copy()
        got = merge_stream.fold_votes(votes, "w", acc, init, merge_stream.scratch(), sums)
        return acc.tobytes(), got

    assert [fold(False), fold(True)] == [numpy_only(fold, False), numpy_only(fold, True)]


@needs_native
@pytest.mark.parametrize("method", ["decoupled", "delayed_nesterov"])
def test_outer_step_carries_the_new_params_norm_terms(method, numpy_only):
    from training.config.experiment import OuterConfig
    from training.merge import stream as merge_stream
    from training.merge.outer import init_state, outer_step_

    outer = OuterConfig(method=method, lr=0.7, momentum=0.9)
    shapes = {"w": (3 * kernels.CHUNK + 77,), "b": (7,)}

    def run():
        rng = np.random.default_rng(3)
        params = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
        delta = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
        carried: dict = {}
        outer_step_(outer, 4, params, init_state(outer, shapes), delta, params_sq=carried)
        return carried, merge_stream.chunk_sq_of(params)

    carried, recomputed = run()
    assert carried == recomputed  # the C pass's terms are a norm pass's, term by term
    assert numpy_only(run) == (carried, recomputed)  # and the numpy loop's


def _codes(codec: str, x: np.ndarray) -> codecs.TensorCodes:
    payload, _ = codecs.encode({"w": x}, codec)
    return codecs.tensor_codes(payload, "w", codec)


@needs_native
@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_the_norm_from_codes_is_the_same_in_c_and_numpy(codec, numpy_only):
    # odd sizes and partial last blocks (the pad nibble of int4, the spare codes of int2),
    # tensors of several chunks
    for name, x in _tensors().items():
        codes = _codes(codec, x)
        got, want = codecs.codes_sq(codes), numpy_only(codecs.codes_sq, codes)
        assert got == want, f"{codec} {name}"


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_the_norm_from_codes_is_the_decoded_values_norm(codec):
    # the codes' norm is that of code x scale before rounding to float32: within a few float32
    # roundings (2^-24 relative each) of the decoded values' norm
    x = _tensors()["chunks"]
    codes = _codes(codec, x)
    sums, error = codecs.codes_sq(codes)
    values = np.empty(x.size, np.float32)
    for s, e in codecs.chunk_spans(x.size):
        codecs.decode_chunk(codes, s, e, values[s:e])
    assert error is None
    assert sum(sums) == pytest.approx(float(np.square(values, dtype=np.float64).sum()), rel=1e-6)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_norm_from_codes_stops_at_an_invalid_code(codec, numpy_only):
    x = _tensors()["chunks"]  # 3 chunks and 77 elements
    payload, _ = codecs.encode({"w": x}, codec)
    raw = payload["w"].reshape(-1).view(np.uint8)
    at = kernels.CHUNK + 10  # an element of the second chunk
    raw[at // (2 if codec == "int4" else 1)] = 0x80 if codec == "int8" else 0x70  # code -8
    codes = codecs.tensor_codes(payload, "w", codec)
    for run in (codecs.codes_sq, lambda c: numpy_only(codecs.codes_sq, c)):
        sums, error = run(codes)
        assert len(sums) == 1 and "codes outside" in error


@pytest.mark.parametrize("scale", [np.inf, np.nan, np.float32(3e38)])
def test_a_scale_that_cannot_decode_gives_a_non_finite_norm(scale, numpy_only):
    # 3e38 x 127 overflows float32: a code of 127 would decode to inf
    x = _tensors()["odd"]
    payload, _ = codecs.encode({"w": x}, "int8")
    payload["w" + codecs.SCALE_SUFFIX].reshape(-1)[1] = scale
    codes = codecs.tensor_codes(payload, "w", "int8")
    for run in (codecs.codes_sq, lambda c: numpy_only(codecs.codes_sq, c)):
        sums, error = run(codes)
        assert error is None and not np.isfinite(sum(sums))


@needs_native
def test_threads_over_chunks_give_one_threads_bits():
    # a tensor of 3 chunks and 77 elements: 2 threads take chunks [0, 2) and [2, 4), 3 threads
    # one or two each; every result the same bits as on one thread
    from training.config.experiment import OuterConfig
    from training.merge import stream as merge_stream
    from training.merge.outer import init_state, outer_step_

    x = _tensors()["chunks"]
    outer = OuterConfig(method="decoupled", lr=0.7, momentum=0.9)

    def everything():
        codes = [_codes(c, x * (i + 1)) for i, c in enumerate(("int8", "int4", "int2"))]
        out = [codecs.codes_sq(c) for c in codes]
        acc = np.empty(x.size, np.float32)
        votes = [
            (merge_stream.PayloadVote({"w": c}), np.float32(0.3 + i)) for i, c in enumerate(codes)
        ]
        out.append(merge_stream.fold_votes(votes, "w", acc, True, merge_stream.scratch(), True))
        params, delta = {"w": x.copy()}, {"w": acc.copy()}
        carried: dict = {}
        state = outer_step_(
            outer, 4, params, init_state(outer, {"w": x.shape}), delta, params_sq=carried
        )
        out += [native.chunk_sumsq(x, kernels.CHUNK).tolist(), carried]
        return out, _bits([acc, params["w"], state.momentum["w"]])

    one = everything()
    for threads in (2, 3):
        native.set_threads(threads)
        try:
            assert everything() == one, threads
        finally:
            native.set_threads(1)


def _fused_case(seed: int, tiny_at: int | None = None):
    """(shapes, params, momentum, delta) for the fused outer step and encode: two tensors, one
    of three chunks and 77 elements; `tiny_at`: 300 elements of "w" from there with params,
    momentum and delta zero (the outer step leaves them 0), for a shadow that makes the
    update's block there 1e-38 (levels / absmax overflows: C refuses that chunk)."""
    rng = np.random.default_rng(seed)
    shapes = {"w": (3 * kernels.CHUNK + 77,), "b": (1001,)}
    made = [{n: rng.normal(0, 1, s).astype(np.float32) for n, s in shapes.items()} for _ in "pmd"]
    if tiny_at is not None:
        for t in made:
            t["w"][tiny_at : tiny_at + 300] = 0.0
    return shapes, *made


def _fused_run(codec: str, fused: bool, seed: int = 5, tiny_at: int | None = None):
    """The outer step then the update's encode against a shadow near the new params, fused
    (codecs.PendingStep into outer_step_) or one after the other; everything they write."""
    from training.config.experiment import OuterConfig
    from training.merge.outer import init_state, outer_step_

    outer = OuterConfig(method="decoupled", lr=0.7, momentum=0.9)
    shapes, params, momentum, delta = _fused_case(seed, tiny_at)
    # the shadow: the new params (as the step writes them, computed on copies) less noise
    after = {n: v.copy() for n, v in params.items()}
    state = init_state(outer, shapes)._replace(momentum={n: v.copy() for n, v in momentum.items()})
    outer_step_(outer, 4, after, state, {n: v.copy() for n, v in delta.items()})
    noise = np.random.default_rng(seed + 1)
    shadow = {n: v - noise.normal(0, 1e-2, v.shape).astype(np.float32) for n, v in after.items()}
    if tiny_at is not None:
        shadow["w"][tiny_at : tiny_at + 300] = np.float32(-1e-38)
    state = init_state(outer, shapes)._replace(momentum=momentum)
    sums: dict = {}
    if fused:
        pending = codecs.PendingStep(shadow, codec)
        outer_step_(outer, 4, params, state, delta, params_sq=sums, encode=pending)
        payload = pending.payload(params)
    else:
        outer_step_(outer, 4, params, state, delta, params_sq=sums)
        payload = codecs.encode_step(params, shadow, codec)
    arrays = [*params.values(), *state.momentum.values(), *shadow.values(), *payload.values()]
    return list(payload), sums, _bits(arrays)


@needs_native
@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "bf16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_update_encoded_in_the_outer_step_is_the_step_then_the_encode(
    codec, threads, chunk_threads
):
    # bf16: no fused loop (PendingStep.fused declines it): the payload encodes it after
    chunk_threads(threads)
    assert _fused_run(codec, fused=True) == _fused_run(codec, fused=False)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunk_the_fused_loop_refuses_is_finished_as_the_step_then_the_encode(
    threads, chunk_threads
):
    # chunk 1 of "w" holds a block whose update is 1e-38 (7 / 1e-38 overflows float32): C
    # stops there, the outer step of chunks 2-3 and the encode from chunk 1 on are redone
    # outside the loop (numpy for the refused chunk); on 2 threads the first range [0, 2) is
    # the one stopped
    chunk_threads(threads)
    got = _fused_run("int4", fused=True, tiny_at=kernels.CHUNK + 256)
    assert got == _fused_run("int4", fused=False, tiny_at=kernels.CHUNK + 256)


@needs_native
def test_a_non_finite_update_in_the_fused_loop_is_refused_by_name():
    from training.config.experiment import OuterConfig
    from training.merge.outer import init_state, outer_step_

    outer = OuterConfig(method="decoupled", lr=0.7, momentum=0.9)
    shapes, params, _, delta = _fused_case(3)
    shadow = {n: v.copy() for n, v in params.items()}
    shadow["w"][kernels.CHUNK + 5] = np.inf  # chunk 1: params - inf
    pending = codecs.PendingStep(shadow, "int8")
    with pytest.raises(ValueError, match="tensor 'w' has non-finite values"):
        outer_step_(outer, 4, params, init_state(outer, shapes), delta, encode=pending)
