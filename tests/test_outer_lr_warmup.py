"""Outer learning-rate warm-up: the ramp, and the step it scales."""

import numpy as np
import pytest

from training.config.experiment import OuterConfig
from training.merge.outer import init_state, outer_lr, outer_step_


def test_ramp_reaches_lr_at_the_warmup_step_and_stays():
    outer = OuterConfig(lr=0.8, lr_warmup=4)
    # steps 0..3 -> lr x 1/4, 2/4, 3/4, 4/4; then lr
    assert [outer_lr(outer, s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])


def test_no_warmup_is_the_plain_lr():
    assert outer_lr(OuterConfig(lr=0.8), 0) == 0.8


def test_first_plain_sgd_step_moves_by_lr_over_w():
    outer = OuterConfig(lr=0.8, lr_warmup=4, momentum=0.0)
    params = {"w": np.ones(3, np.float32)}
    state = init_state(outer, {"w": (3,)})
    state = outer_step_(outer, 1, params, state, {"w": np.full(3, 1.0, np.float32)})
    # theta = 1 - (0.8 / 4) x 1 = 0.8; the next step (steps = 1) uses 0.4: 0.8 - 0.4 = 0.4
    np.testing.assert_allclose(params["w"], 0.8)
    outer_step_(outer, 1, params, state, {"w": np.full(3, 1.0, np.float32)})
    np.testing.assert_allclose(params["w"], 0.4, rtol=1e-6)
