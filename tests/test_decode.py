"""Incremental decoding with a key/value cache (for sampling): the logits of a prompt fed in
chunks through `decode` equal `apply` on the whole sequence, for both preset families."""

import jax
import numpy as np
import pytest

from training.config.experiment import ConfigError, ModelConfig
from training.model import definition as model


@pytest.mark.parametrize("preset", ["tiny", "gemma-tiny"])
def test_cached_decode_equals_whole_sequence_apply(preset):
    cfg = ModelConfig(preset=preset, compute_dtype="float32")
    params = model.init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)  # byte vocabulary
    want = np.asarray(model.apply(cfg, params, tokens))  # (2, 9, vocab)
    cache = model.empty_cache(cfg, batch=2, length=16)
    step = jax.jit(lambda p, t, c, s: model.decode(cfg, p, t, c, s))
    got = []
    # a 4-token prompt chunk, then one token at a time (positions 4..8), as sampling does
    logits, cache = step(params, tokens[:, :4], cache, 0)
    got.append(np.asarray(logits))
    for i in range(4, 9):
        logits, cache = step(params, tokens[:, i : i + 1], cache, i)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=2e-5, atol=2e-5)


def test_a_factory_model_has_no_kv_cache():
    cfg = ModelConfig(preset="tiny", d_model=32, max_seq_len=32, factory="tests.byo_model:make")
    assert not model.has_kv_cache(cfg)
    with pytest.raises(ConfigError, match="no key/value cache"):
        model.decode(cfg, {}, None, [], 0)
