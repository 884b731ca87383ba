"""What one `diloco bench wan` run is (training/bench/wan/bench.py drives it,
training/bench/wan/runner.py runs its processes): its parameters (`BenchParams`), the tuned
settings each method trains with, and the link rate rule (`link_mbit`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from training.bench.wan import model12b

# the quality benchmark's tuned settings (docs/bench-history/quality.md): DiLoCo inner lr 2e-3, outer 0.5 /
# 0.8; data-parallel its best inner lr, 3e-3
DILOCO_SETTINGS = {"inner.lr": 0.002, "outer.lr": 0.5, "outer.momentum": 0.8}
DP_SETTINGS = {"inner.lr": 0.003}


@dataclass(frozen=True)
class BenchParams:
    regions: int = 2
    steps: int = 200  # per region: the token budget is regions x steps x batch x seq_len
    batch_size: int = 8
    H: int = 24
    fragments: int = 1  # P of data-parallel and synchronous DiLoCo; Decoupled: the config's
    codec: str = "int4"
    gbps: tuple[float, ...] = model12b.GBPS
    dp_probe_steps: int = 3
    cycles_per_phase: int = 2  # DiLoCo: publish cycles of every island measured at each g
    target: float | None = None  # default: data-parallel's loss at target_fraction of the budget
    target_fraction: float = 0.5
    regional_checkpoints: bool = True
    # methods whose time to target is measured by a fresh run per g on shaped links (their
    # quality per token depends on the links), not composed from an unshaped run
    direct: tuple[str, ...] = ("decoupled",)
    run_timeout_s: float = 300.0
    # config overrides of Decoupled DiLoCo's runs only (`--decoupled-set KEY=VALUE`), as
    # (dotted key, value) pairs; the table's "differs" note names them
    decoupled_set: tuple[tuple[str, Any], ...] = ()
    # seconds every process (data-parallel's and every island's) idles after each step, as a
    # slower chip would compute: it lengthens a step and, through the link rates derived from
    # data-parallel's step time, slows the links by the same factor, so the communication to
    # computation ratio stays the 12B one while the syncer's fixed latency (poll, merge, object
    # round trips) shrinks against a round, towards its 12B share (docs/WAN.md "Latency")
    step_pad_s: float = 0.0
    assume: model12b.Assumptions = field(default_factory=model12b.Assumptions)


def link_mbit(dp_bytes_per_step: float, step_s: float, ratio: float) -> float:
    """Link rate (Mbit/s) at which a step's DP traffic takes `ratio` x the compute time."""
    return dp_bytes_per_step * 8 / (ratio * step_s) / 1e6
