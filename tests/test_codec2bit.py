"""The 2-bit codec (training/codecs/int2.py) through training/codecs/host.py."""

import math

import numpy as np
import pytest

from training.codecs import host as codecs
from training.codecs import int2 as codec2bit


def test_levels_and_packing_by_hand():
    # absmax 1.5 -> scale 1: 1.5 -> code 3, 0.6 -> 2 (level 0.5), -0.2 -> 1 (-0.5), -1.5 -> 0
    payload, residual = codecs.encode({"w": np.array([1.5, 0.6, -0.2, -1.5], np.float32)}, "int2")
    assert payload["w"].tolist() == [3 | 2 << 2 | 1 << 4 | 0 << 6]
    assert codecs.decode(payload, "int2")["w"].tolist() == [1.5, 0.5, -0.5, -1.5]
    assert np.allclose(residual["w"], [0.0, 0.1, 0.3, 0.0])


def test_payload_size_is_a_quarter_byte_per_element():
    n = 1001
    payload, _ = codecs.encode({"w": np.ones(n, np.float32)}, "int2")
    assert codecs.payload_nbytes(payload) == math.ceil(n / 4) + 4 * math.ceil(n / 256) + 4


def test_error_is_at_most_half_a_level():
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    payload, _ = codecs.encode({"w": x}, "int2")
    out = codecs.decode(payload, "int2")["w"]
    scale = np.repeat(payload["w.__scale"], 256)[: x.size]
    assert np.all(np.abs(out - x) <= scale / 2 * (1 + 1e-5))


def test_truncated_payload_is_refused():
    payload, _ = codecs.encode({"w": np.ones(100, np.float32)}, "int2")
    with pytest.raises(ValueError, match="int2"):
        codecs.decode(dict(payload, w=payload["w"][:-1]), "int2")


def test_unpack_inverts_pack():
    codes = np.random.default_rng(1).integers(0, 4, size=37).astype(np.uint8)
    assert np.array_equal(codec2bit.unpack(codec2bit.pack(codes), 37), codes)


def test_kernel_packing_is_the_documented_layout():
    x = np.random.default_rng(3).normal(size=300_003).astype(np.float32)  # several chunks
    payload, _ = codecs.encode({"w": x}, "int2")
    levels = codecs.decode(payload, "int2")["w"] / np.repeat(payload["w.__scale"], 256)[: x.size]
    codes = (levels + codec2bit.HALF_RANGE).round().astype(np.uint8)
    assert np.array_equal(codec2bit.pack(codes), payload["w"])


def test_error_feedback_carries_what_two_bits_lose():
    x = {"w": (np.random.default_rng(2).normal(size=512) * 0.1).astype(np.float32)}
    total, residual = np.zeros(512, np.float32), None
    for _ in range(40):
        payload, residual = codecs.encode(x, "int2", residual)
        total += codecs.decode(payload, "int2")["w"]
    assert np.allclose(total + residual["w"], 40 * x["w"], atol=1e-4)
