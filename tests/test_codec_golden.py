"""Golden digests: every codec encodes, decodes and leaves residuals bit-identical to the
reference implementation (the numpy codecs of 2026-12-01, before they were vectorized).

If a digest changes, the payload format or the arithmetic changed: a merger would decode old
payloads differently. Update GOLDEN only for a deliberate format change, together with a new
payload format version that refuses the old one (docs/STORE.md); never to make a speed-up pass.
"""

import hashlib

import numpy as np
import pytest

from training.codecs import host as codecs


def _inputs() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(20261201)
    delta = {
        "a": rng.normal(0, 1e-3, (37, 300)).astype(np.float32),  # 11100: not a block multiple
        "b": (rng.standard_t(3, 4096) * np.repeat([1e-6, 1.0, 300.0, 0.0], 1024)).astype(
            np.float32
        ),
        "c": np.array(0.25, np.float32),
        "d": rng.normal(0, 1, 257).astype(np.float32),  # one element past a block
        "e": np.array([1.5, -1.5, 0.5, -0.5, 0.0, 1e-30, -1e-30, 3.0e38], np.float32),
        "f": rng.normal(0, 1e-2, 300_001).astype(np.float32),  # several kernel chunks, odd
    }
    residual = {k: rng.normal(0, 1e-4, v.shape).astype(np.float32) for k, v in delta.items()}
    residual.pop("c")
    return delta, residual


def _digest(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        v = np.ascontiguousarray(tensors[name])
        h.update(f"{name}:{v.dtype.str}:{v.shape};".encode())
        h.update(v.view(np.uint8).reshape(-1).tobytes())
    return h.hexdigest()[:24]


GOLDEN = {  # codec: digests of (payload, new residual, decoded)
    "fp32": ("ee44602c42e811e3efafd9ef", "bc826f89a3dd0b1148a86208", "ee44602c42e811e3efafd9ef"),
    "bf16": ("fd26d5ea9786663bd5caaefd", "10177601441ffa6b41020d57", "107883cdf15a331084c70116"),
    "int8": ("e6f5066fe15908dad1c1f868", "fe065f7281cbeeac9c7447cb", "4dc76290aa718072e63f48c2"),
    "int4": ("edff70b5aa74712cf267ed55", "16e6dc72604c5f3130dc86d2", "6b3540523bd6580e571c1615"),
    "int2": ("d4f1319052d89a92aebad213", "912d7cf158b2252eb3fcbff5", "fe1ab26db585b0fc4a3ecc6a"),
}


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_codec_is_bit_identical_to_the_reference(codec):
    delta, residual = _inputs()
    payload, new_residual = codecs.encode(delta, codec, residual)
    decoded = codecs.decode(payload, codec)
    got = (_digest(payload), _digest(new_residual), _digest(decoded))
    assert got == GOLDEN[codec], f"{codec}: digests changed (see the module docstring): {got}"


def test_bf16_rounds_every_bit_pattern_as_ml_dtypes():
    """The integer round-to-nearest-even equals ml_dtypes' cast on finite float32 patterns."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    bits[:65536] = (np.arange(65536, dtype=np.uint32) << 16) | 0x8000  # every tie
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    payload, _ = codecs.encode({"w": x}, "bf16")
    assert np.array_equal(
        payload["w"].view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16)
    )
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    expected = every.view(ml_dtypes.bfloat16).astype(np.float32)
    got = codecs.decode({"w": every}, "bf16")["w"]
    finite = np.isfinite(expected)
    assert np.array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))
