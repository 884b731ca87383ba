import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save

from training.codecs import host as codecs

N = 1000  # not a multiple of the block
LEVELS = {"int8": 127, "int4": 7}


def _delta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "blocks/0/attn/qkv/kernel": rng.normal(size=(8, 125)).astype(np.float32),
        "embed/embedding": (rng.normal(size=(N,)) * 1e-3).astype(np.float32),
        "final_norm/scale": rng.normal(size=(7,)).astype(np.float32),
        "scalar": np.array(0.5, dtype=np.float32),
    }


def _block_absmax(x: np.ndarray, block: int = 256) -> np.ndarray:
    flat = x.reshape(-1)
    return np.array([np.abs(flat[i : i + block]).max() for i in range(0, flat.size, block)])


def _per_element(values: np.ndarray, n: int, block: int = 256) -> np.ndarray:
    return np.repeat(values, block)[:n]


@pytest.mark.parametrize(
    ("codec", "expected"),
    [
        ("fp32", 4 * N),
        ("bf16", 2 * N),
        ("int8", N + 4 * math.ceil(N / 256)),
        ("int4", math.ceil(N / 2) + 4 * math.ceil(N / 256) + 4),  # + int32 shape of ndim 1
    ],
)
def test_payload_sizes(codec, expected):
    payload, _ = codecs.encode({"w": np.ones(N, np.float32)}, codec)
    assert codecs.payload_nbytes(payload) == expected
    odd = {"w": np.ones(N + 1, np.float32)}
    if codec == "int4":
        assert codecs.payload_nbytes(codecs.encode(odd, codec)[0]) == expected + 1


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_decode_shapes_dtypes_and_safetensors(codec):
    delta = _delta()
    payload, residual = codecs.encode(delta, codec)
    save(payload)  # every payload tensor is savable
    allowed = {np.float32, np.int8, np.uint8, np.int32, ml_dtypes.bfloat16}
    assert all(t.dtype.type in allowed for t in payload.values())
    out = codecs.decode(payload, codec)
    assert set(out) == set(delta) == set(residual)
    for name, x in delta.items():
        assert out[name].shape == x.shape and out[name].dtype == np.float32
        assert residual[name].shape == x.shape
        assert np.allclose(out[name] + residual[name], x, atol=1e-6)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_quantization_error_bound(codec):
    rng = np.random.default_rng(1)
    x = (rng.standard_t(df=3, size=N) * np.repeat([1e-4, 1.0, 30.0, 1e-2], 250)).astype(np.float32)
    out = codecs.decode(codecs.encode({"w": x}, codec)[0], codec)["w"]
    bound = _per_element(_block_absmax(x) / (2 * LEVELS[codec]), N)
    assert np.all(np.abs(out - x) <= bound * (1 + 1e-5) + 1e-12)
    assert np.abs(out).max() <= np.abs(x).max() * (1 + 1e-6)


def test_fp32_exact_and_bf16_relative_error():
    x = _delta()["blocks/0/attn/qkv/kernel"]
    assert np.array_equal(codecs.decode(codecs.encode({"w": x}, "fp32")[0], "fp32")["w"], x)
    out = codecs.decode(codecs.encode({"w": x}, "bf16")[0], "bf16")["w"]
    assert np.all(np.abs(out - x) <= np.abs(x) * 2.0**-8)


def test_bf16_round_to_nearest_even():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-12], np.float32)
    out = codecs.decode(codecs.encode({"w": x}, "bf16")[0], "bf16")["w"]
    assert out.tolist() == [1.0, 1 + 2**-6, 1 + 2**-7]
    bits = codecs.encode({"w": x}, "bf16")[0]["w"].view(np.uint16)
    assert np.array_equal(codecs.decode({"w": bits}, "bf16")["w"], out)  # raw bits accepted


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_error_feedback_removes_bias(codec):
    delta = {"w": (np.random.default_rng(2).normal(size=N) * 0.1).astype(np.float32)}
    rounds = 50
    total_fb = np.zeros(N, np.float32)
    total_plain = np.zeros(N, np.float32)
    residual = None
    for _ in range(rounds):
        payload, residual = codecs.encode(delta, codec, residual)
        total_fb += codecs.decode(payload, codec)["w"]
        plain, _ = codecs.encode(delta, codec)
        total_plain += codecs.decode(plain, codec)["w"]
    target = rounds * delta["w"]
    if codec == "bf16":
        step = np.abs(delta["w"]) * 2.0**-7
    else:
        step = _per_element(payload["w.__scale"], N)  # one quantization step of the last round
    assert np.all(np.abs(residual["w"]) <= step + 1e-6)
    assert np.allclose(total_fb + residual["w"], target, atol=1e-4)
    err_fb = np.abs(total_fb - target).mean() / rounds
    err_plain = np.abs(total_plain - target).mean() / rounds
    assert err_plain > 5 * err_fb  # the bias without feedback does not shrink with rounds


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_zeros_and_constant_blocks(codec):
    delta = {
        "zeros": np.zeros(600, np.float32),
        "const": np.full(600, -3.25, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    payload, residual = codecs.encode(delta, codec)
    out = codecs.decode(payload, codec)
    for name, x in delta.items():
        assert np.all(np.isfinite(out[name])) and np.all(np.isfinite(residual[name]))
        assert np.allclose(out[name], x) and out[name].shape == x.shape


def test_residual_is_added_and_missing_names_start_at_zero():
    delta = {"a": np.full(4, 1.0, np.float32), "b": np.full(4, 2.0, np.float32)}
    payload, new = codecs.encode(delta, "fp32", residual={"a": np.full(4, 0.5, np.float32)})
    out = codecs.decode(payload, "fp32")
    assert np.allclose(out["a"], 1.5) and np.allclose(out["b"], 2.0)
    assert set(new) == {"a", "b"} and all(np.all(v == 0) for v in new.values())
    with pytest.raises(ValueError, match="'a'.*shape"):
        codecs.encode(delta, "int8", residual={"a": np.zeros(3, np.float32)})


def test_invalid_inputs():
    with pytest.raises(ValueError, match="unknown codec"):
        codecs.encode({"w": np.ones(3, np.float32)}, "fp8")
    with pytest.raises(ValueError, match="non-finite"):
        codecs.encode({"w": np.array([1.0, np.nan], np.float32)}, "int8")
    with pytest.raises(ValueError, match="reserved"):
        codecs.encode({"w.__scale": np.ones(3, np.float32)}, "fp32")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_decode_validates_payload(codec):
    payload, _ = codecs.encode({"layer/w": np.ones(N, np.float32)}, codec)
    missing = {k: v for k, v in payload.items() if not k.endswith(".__scale")}
    with pytest.raises(ValueError, match=r"layer/w.*__scale"):
        codecs.decode(missing, codec)
    short = dict(payload, **{"layer/w.__scale": payload["layer/w.__scale"][:-1]})
    with pytest.raises(ValueError, match=r"layer/w\.__scale.*scales"):
        codecs.decode(short, codec)
    with pytest.raises(ValueError, match="scales"):
        codecs.decode(payload, codec, block=128)
    truncated = dict(payload, **{"layer/w": payload["layer/w"][:300]})
    with pytest.raises(ValueError, match="layer/w"):
        codecs.decode(truncated, codec)
    with pytest.raises(ValueError, match="unexpected"):
        codecs.decode(dict(payload, **{"other.__scale": np.ones(1, np.float32)}), codec)
    with pytest.raises(ValueError, match="dtype"):
        codecs.decode(dict(payload, **{"layer/w": payload["layer/w"].astype(np.int32)}), codec)


def test_decode_validates_dense_payload():
    with pytest.raises(ValueError, match="'w'.*dtype"):
        codecs.decode({"w": np.ones(3, np.float64)}, "fp32")
    with pytest.raises(ValueError, match="unexpected"):
        codecs.decode({"w": np.ones(3, np.float32), "w.__scale": np.ones(1, np.float32)}, "fp32")


def test_int4_packing_layout():
    x = np.array([-1.0, 1.0, 0.0, -1.0, 0.5], np.float32)
    payload, _ = codecs.encode({"w": x}, "int4")
    assert payload["w"].dtype == np.uint8 and payload["w"].size == 3
    assert payload["w"][0] == (1 | (15 << 4))  # q=-7 -> code 1 (low), q=7 -> code 15 (high)
    assert payload["w.__shape"].tolist() == [5]
    bad = dict(payload, w=np.zeros(3, np.uint8))  # code 0 is not a valid level
    with pytest.raises(ValueError, match="outside"):
        codecs.decode(bad, "int4")


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_payload_keys_are_what_encode_writes(codec):
    delta = _delta()
    payload, _ = codecs.encode(delta, codec)
    assert codecs.payload_keys(delta, codec) == set(payload)


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_checked_codes_of_a_payload_decode_to_what_decode_returns(codec):
    delta = _delta()
    payload, _ = codecs.encode(delta, codec)
    codes = codecs.checked_codes(payload, codec, {n: x.shape for n, x in delta.items()})
    assert set(codes) == set(delta)
    for name, c in codes.items():
        out = np.empty(math.prod(c.shape), np.float32)
        got = codecs.decode_chunk(c, 0, out.size, out)
        np.testing.assert_array_equal(got.reshape(c.shape), codecs.decode(payload, codec)[name])


def test_checked_codes_refuse_a_wrong_tree_a_foreign_key_and_a_wrong_shape():
    payload, _ = codecs.encode({"w": np.ones(N, np.float32)}, "int8")
    with pytest.raises(ValueError, match=r"wrong tree for fragment 3: extra \['w'\], missing"):
        codecs.checked_codes(payload, "int8", {"v": (N,)}, fragment=3)
    with pytest.raises(ValueError, match="unreadable payload: unexpected"):
        codecs.checked_codes(
            dict(payload, **{"w.__shape": np.ones(1, np.int32)}), "int8", {"w": (N,)}
        )
    with pytest.raises(ValueError, match=r"wrong shape for w: \(1000,\), expected \(10, 100\)"):
        codecs.checked_codes(payload, "int8", {"w": (10, 100)})
