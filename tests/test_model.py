"""Model presets: parameter counts from the config match the NNX model."""

import numpy as np
import pytest

from training import model
from training.config import ModelConfig


@pytest.mark.parametrize("preset", ["tiny", "small", "125m", "1b", "12b"])
def test_param_count_matches_model(preset):
    cfg = ModelConfig(preset=preset)
    abstract = model.abstract_params(cfg)
    assert sum(int(np.prod(v.shape)) for v in abstract.values()) == cfg.param_count()


def test_preset_sizes():
    # golden sizes: update only when a preset is deliberately changed
    sizes = {p: ModelConfig(preset=p).param_count() for p in ["tiny", "small", "125m", "1b", "12b"]}
    assert sizes["tiny"] < 1_000_000
    assert 10_000_000 <= sizes["small"] <= 20_000_000
    assert sizes == {
        "tiny": 434_816,
        "small": 14_358_912,
        "125m": 124_373_760,
        "1b": 1_013_262_336,
        "12b": 12_232_688_640,
    }


def test_init_is_deterministic_and_named():
    cfg = ModelConfig()
    a, b = model.init_params(cfg, 3), model.init_params(cfg, 3)
    assert "embed/embedding" in a and "blocks/1/mlp_up/kernel" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_logits_shape_and_causality():
    cfg = ModelConfig()
    params = model.init_params(cfg, 0)
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    y = x.copy()
    y[:, -1] = 99
    la, lb = model.apply(cfg, params, x), model.apply(cfg, params, y)
    assert la.shape == (2, 8, 256)
    # changing the last token must not change earlier positions' logits
    np.testing.assert_allclose(la[:, :-1], lb[:, :-1], atol=1e-5)
