"""How long a token budget takes on the chosen islands: an estimate, for a warning.

Not a promise: the first measured figure is this machine's, the rest is arithmetic.

- A CPU island (no TPU named in its ``hardware``) of the ``tiny`` preset trains about
  `CPU_TINY_TOKENS_PER_S` tokens/s: `make demo` (docs/bench-history/demo.md, 2026-12-02) merges 2M tokens
  on three such islands in 205-219 s from trigger to success on a 2-core machine, about 3,000
  tokens/s per island. Other presets on a CPU scale by the 6 N FLOPs a token costs
  (N = `ModelConfig.param_count`).
- A TPU island (``accelerator_type``, or a GKE ``accelerator``) trains chips x the family's peak
  bf16 FLOP/s (`TPU_PEAK_FLOPS`, the vendor's figures) x `ASSUMED_MFU` / (6 N) tokens/s.

Pure functions, standard library and the config only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.config.hardware import chips_of_hardware

if TYPE_CHECKING:
    from training.config.experiment import ExperimentConfig

CPU_TINY_TOKENS_PER_S = 3_000.0
"""Tokens/s of one CPU island of the ``tiny`` preset (measured: `make demo`, see above)."""

TPU_PEAK_FLOPS = {"v4": 275e12, "v5litepod": 197e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
"""Peak bf16 FLOP/s of one chip, by TPU family (Cloud TPU documentation)."""

ASSUMED_MFU = 0.4
"""The share of peak FLOP/s a TPU island is assumed to reach (an assumption, not measured)."""


def _tpu_family(hardware: dict) -> str | None:
    text = str(hardware.get("accelerator_type") or hardware.get("accelerator") or "")
    for family in sorted(TPU_PEAK_FLOPS, key=len, reverse=True):
        if family in text or (family == "v5litepod" and "v5-lite" in text):
            return family
    return None


def island_tokens_per_s(cfg: ExperimentConfig, hardware: dict) -> float:
    """Estimated tokens/s of one island of `cfg` on `hardware` (see the module docstring)."""
    from training.config.sections import ModelConfig

    flops_per_token = 6 * cfg.model.param_count()
    family = _tpu_family(hardware or {})
    if family is not None:
        return chips_of_hardware(hardware) * TPU_PEAK_FLOPS[family] * ASSUMED_MFU / flops_per_token
    tiny = 6 * ModelConfig(preset="tiny").param_count()
    return CPU_TINY_TOKENS_PER_S * tiny / flops_per_token


def budget_hours(cfg: ExperimentConfig) -> float:
    """Estimated hours to merge `cfg.token_budget` tokens on all of `cfg.islands` together."""
    rate = sum(island_tokens_per_s(cfg, i.hardware) for i in cfg.islands)
    return cfg.token_budget / rate / 3600


def budget_warning(cfg: ExperimentConfig, horizon_h: float) -> str | None:
    """One line when the budget would take longer than `horizon_h` hours, else None."""
    hours = budget_hours(cfg)
    if hours <= horizon_h:
        return None
    took = f"{hours / 24:,.1f} days" if hours >= 48 else f"{hours:,.1f} h"
    return (
        f"token_budget {cfg.token_budget:,} would take about {took} on these "
        f"{len(cfg.islands)} islands (estimated {cfg.token_budget / hours / 3600:,.0f} tokens/s "
        f"together; over the {horizon_h:g} h horizon): is the budget what you meant?"
    )
