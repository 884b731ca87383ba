"""The data-parallel baseline: one process training the same model on the same shards and token
count as the islands (all islands' batches in each step), for comparison with what they produce.

The benchmarks name it method ``dp``; the demo compares its islands against `single_process_baseline`.
It is not a merge method (``outer.method`` has no ``dp``): it uses no store and no merger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from training import inner, model
from training.config import ExperimentConfig, with_overrides
from training.data import BatchLoader, shard_tokens
from training.evaluate import held_out_batches
from training.runtime import corpus_for, loop_for


@dataclass
class Curve:
    """A held-out loss curve: (virtual time, tokens, loss) at each evaluation."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def add(self, t: float, tokens: int, loss: float) -> None:
        self.times.append(t)
        self.tokens.append(tokens)
        self.losses.append(float(loss))

    def time_to(self, target: float) -> float | None:
        """First virtual time the eval loss reaches `target` (linear between evaluations)."""
        for i, loss in enumerate(self.losses):
            if loss <= target:
                if i == 0:
                    return self.times[0]
                t0, t1, l0 = self.times[i - 1], self.times[i], self.losses[i - 1]
                return t0 + (t1 - t0) * (l0 - target) / (l0 - loss)
        return None

    def to_dict(self) -> dict:
        return dict(times=self.times, tokens=self.tokens, losses=self.losses)


def run_data_parallel(cfg: ExperimentConfig, eval_dt: float, progress=None) -> dict:
    """Data-parallel: one AdamW step on all islands' batches, at the slowest island's pace.

    Time is virtual: a step takes 1 / (the slowest island's speed) seconds. The held-out loss is
    recorded at 0, every `eval_dt` virtual seconds (`progress(t, tokens, loss)` after each) and
    at the end. Returns {"curve": Curve, "tokens", "bytes_sent", "bytes_received" (per island,
    a ring all-reduce of fp32 gradients per step), "merges" (steps), "quarantined": 0}.
    """
    loop = loop_for(cfg)
    corpus = corpus_for(cfg)
    loaders = [
        BatchLoader(
            shard_tokens(corpus.train, cfg.shard_of(i.name), cfg.num_shards),
            cfg.data.batch_size,
            cfg.data.seq_len,
            seed=cfg.seed * 1000 + cfg.shard_of(i.name),
        )
        for i in cfg.islands
    ]
    params = loop.put_params(inner.to_host(model.init_params(cfg.model, cfg.seed)))
    opt_state = loop.init_opt_state(params)
    evals = held_out_batches(cfg)
    step_time = max(1.0 / i.speed for i in cfg.islands)
    curve, tokens, t = Curve(), 0, 0.0
    curve.add(0.0, 0, loop.eval_loss(params, evals))
    next_eval = eval_dt
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    m = len(cfg.islands)
    steps = 0
    while tokens < cfg.token_budget:
        batches = [ld.next_batch() for ld in loaders]
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1] for b in batches])
        params, opt_state, _ = loop.step(params, opt_state, x, y)
        tokens += x.size
        steps += 1
        t += step_time
        if t >= next_eval:
            curve.add(t, tokens, loop.eval_loss(params, evals))
            next_eval += eval_dt
            if progress:
                progress(t, tokens, curve.losses[-1])
    if curve.tokens[-1] != tokens:
        curve.add(t, tokens, loop.eval_loss(params, evals))
    per_island = steps * 2 * (m - 1) / m * 4 * n_params  # ring all-reduce: as much in as out
    return dict(
        curve=curve,
        tokens=tokens,
        bytes_sent=per_island,
        bytes_received=per_island,
        merges=steps,
        quarantined=0,
    )


def single_process_baseline(cfg: ExperimentConfig, tokens: int) -> float:
    """Held-out loss of `run_data_parallel` over `tokens` tokens of `cfg` (its final eval)."""
    same = with_overrides(cfg, {"token_budget": max(tokens, 1)})
    result = run_data_parallel(same, eval_dt=float("inf"), progress=lambda *_: None)
    return result["curve"].losses[-1]
