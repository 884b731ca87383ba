"""The jitted device encoder gives the numpy codec's payloads, bit for bit, with error feedback."""

import jax
import numpy as np
import pytest

from training.codecs import host as codecs
from training.island.encode import DeviceEncoder
from training.store.tensors import encode_tensors

SHAPES = {"w": (33, 20), "b": (7,), "e": (600,), "s": ()}


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_device_payloads_and_residuals_are_the_numpy_codecs_bit_for_bit(codec):
    rng = np.random.default_rng(0)
    enc = DeviceEncoder(codec)
    anchor = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    anchor["b"][:3] = 0.0  # an all-zero block, and signed zeros, on the way
    dev_anchor = {k: jax.device_put(v) for k, v in anchor.items()}
    host_resid, dev_resid = None, None
    for round_ in range(4):
        local = {
            k: v - rng.normal(size=v.shape).astype(np.float32) * 1e-2 for k, v in anchor.items()
        }
        local["b"][:3] = -0.0
        expected, new_resid = codecs.encode(
            {k: anchor[k] - local[k] for k in local}, codec, host_resid
        )
        payload, resid, new_anchor, finite = enc.encode(
            dev_anchor, {k: jax.device_put(v) for k, v in local.items()}, dev_resid
        )
        got = enc.host_payload(payload, finite, SHAPES)
        assert list(got) == list(expected)
        for k in got:
            assert got[k].tobytes() == expected[k].tobytes(), (k, round_, got[k], expected[k])
        assert encode_tensors(got) == encode_tensors(expected), f"round {round_}"
        for k in new_resid:
            np.testing.assert_array_equal(np.asarray(resid[k]), new_resid[k])
            assert np.asarray(resid[k]).tobytes() == new_resid[k].tobytes()
        host_resid, dev_resid = new_resid, resid
        anchor, dev_anchor = local, new_anchor


def test_the_new_anchor_is_a_copy_and_non_finite_deltas_are_refused():
    enc = DeviceEncoder("int8")
    local = {"w": jax.device_put(np.ones(4, np.float32))}
    anchor = {"w": jax.device_put(np.array([1, 2, np.inf, 0], np.float32))}
    payload, _, new_anchor, finite = enc.encode(anchor, local, None)
    assert new_anchor["w"].unsafe_buffer_pointer() != local["w"].unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="non-finite"):
        enc.host_payload(payload, finite, {"w": (4,)})
