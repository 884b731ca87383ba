"""The budget estimate behind init's warning (issue 24 item 2): training/config/estimate.py."""

from __future__ import annotations

from training.config.estimate import (
    ASSUMED_MFU,
    CPU_TINY_TOKENS_PER_S,
    TPU_PEAK_FLOPS,
    budget_hours,
    budget_warning,
    island_tokens_per_s,
)
from training.config.experiment import parse_config


def _cfg(budget: int, islands: list[dict]) -> object:
    return parse_config({"name": "e", "token_budget": budget, "islands": islands})


CPU3 = [{"name": f"i{n}"} for n in range(3)]


def test_three_tiny_cpu_islands_take_the_measured_rate():
    # 3 islands x 3,000 tokens/s = 9,000 tokens/s; 32,400,000 tokens / 9,000 = 3,600 s = 1 h
    assert abs(budget_hours(_cfg(32_400_000, CPU3)) - 1.0) < 1e-9


def test_a_tpu_island_uses_its_chips_peak_and_the_assumed_mfu():
    cfg = _cfg(10**9, [{"name": "t", "hardware": {"accelerator_type": "v5p-8"}}])
    # v5p-8: 8 TensorCores = 4 chips; 4 x 459e12 x 0.4 / (6 N)
    n = cfg.model.param_count()
    want = 4 * TPU_PEAK_FLOPS["v5p"] * ASSUMED_MFU / (6 * n)
    assert island_tokens_per_s(cfg, cfg.islands[0].hardware) == want


def test_a_budget_of_1e15_warns_and_2m_does_not():
    assert CPU_TINY_TOKENS_PER_S == 3_000.0
    line = budget_warning(_cfg(10**15, CPU3), horizon_h=24)
    # 1e15 / 9,000 tokens/s = 1.11e11 s = 1,286,008 days
    assert line is not None and "1,286,008.2 days" in line and "\n" not in line
    assert budget_warning(_cfg(2_000_000, CPU3), horizon_h=24) is None
