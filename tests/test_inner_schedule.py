"""The inner cosine schedule: its values, and the step count every island decays over."""

import pytest

from training.config.experiment import InnerConfig, parse_config
from training.model.inner import inner_schedule


def _cfg(**over):
    raw = {
        "name": "sched",
        "store_url": "memory://sched",
        "token_budget": 64_000,
        "data": {"batch_size": 4, "seq_len": 50},
        "inner": {"schedule": "cosine", "warmup_steps": 10, "lr": 1e-3},
        "islands": [
            {"name": "fast", "speed": 3.0},
            {"name": "slow", "speed": 1.0},
            {"name": "big", "speed": 4.0, "batch_size": 8},
        ],
    }
    raw.update(over)
    return parse_config(raw)


def test_constant_schedule_has_no_decay_length():
    assert _cfg(inner={"schedule": "constant"}).inner_decay_steps("fast") is None


def test_each_island_decays_over_its_share_of_the_budget():
    cfg = _cfg()
    # shares of the 64,000 tokens by speed 3 : 1 : 4 of 8 -> 24,000 / 8,000 / 32,000 tokens;
    # steps of 4 x 50 = 200 tokens (big: 8 x 50 = 400) -> 120, 40, 80
    assert [cfg.inner_decay_steps(n) for n in ("fast", "slow", "big")] == [120, 40, 80]


def test_data_parallel_decays_over_the_budget_in_steps_of_every_batch():
    # one step on 3 islands x 4 sequences x 50 tokens = 600 tokens: ceil(64,000 / 600) = 107
    assert _cfg().inner_decay_steps(None) == 107


def test_cosine_warms_up_then_ends_at_the_final_fraction():
    sched = inner_schedule(InnerConfig(schedule="cosine", lr=1e-3, warmup_steps=10), 100)
    assert float(sched(10)) == pytest.approx(1e-3)
    # halfway through the decay (step 10 + 90 / 2 = 55): (1 + 0.1) / 2 x lr
    assert float(sched(55)) == pytest.approx(0.55e-3, rel=1e-5)
    assert float(sched(100)) == pytest.approx(1e-4, rel=1e-5)
    assert float(sched(500)) == pytest.approx(1e-4, rel=1e-5)


def test_constant_schedule_is_unchanged_by_a_decay_length():
    sched = inner_schedule(InnerConfig(lr=1e-3, warmup_steps=10), 100)
    assert float(sched(500)) == pytest.approx(1e-3)
