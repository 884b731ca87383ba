"""The data-parallel baseline: one process training the same model on the same shards and token
count as the islands (all islands' batches in each step), for comparison with what they produce.

The benchmarks name it method ``dp``; the demo compares its islands against `single_process_baseline`.
It is not a merge method (``outer.method`` has no ``dp``): it uses no store and no merger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from training.config.experiment import ExperimentConfig, with_overrides
from training.data.batches import BatchLoader, shard_tokens
from training.model import definition as model
from training.model import inner
from training.model.evaluate import held_out_batches
from training.model.runtime import corpus_for, loop_for


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


def run_data_parallel(
    cfg: ExperimentConfig, eval_dt: float, progress=None, also_at: Sequence[int] = ()
) -> dict:
    """Data-parallel: one AdamW step on all islands' batches, at the slowest island's pace.

    Time is virtual: a step takes 1 / (the slowest island's speed) seconds. The held-out loss is
    recorded at 0, every `eval_dt` virtual seconds (`progress(t, tokens, loss)` after each) and
    at the budget. Returns {"curve": Curve (up to the budget), "tokens", "bytes_sent",
    "bytes_received" (per island, a ring all-reduce of fp32 gradients per step, to the budget),
    "merges" (steps to the budget), "quarantined": 0, "at_tokens"}.

    `also_at`: token counts at which to evaluate as well, before or past the budget (a DiLoCo
    run's tokens at its end, which overshoots the budget by part of a round): training goes on
    past the budget to the largest, on the same trajectory (the default inner schedule is
    constant: the steps to the budget do not depend on where the run stops). "at_tokens" is
    [[target, tokens, loss], ...], sorted, the loss after the first step with tokens >= target.
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
    pending = sorted({int(x) for x in also_at})
    at_tokens: list[list] = [[x, 0, curve.losses[0]] for x in pending if x <= 0]
    pending = [x for x in pending if x > 0]
    steps = budget_steps = 0
    while tokens < cfg.token_budget or pending:
        batches = [ld.next_batch() for ld in loaders]
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1] for b in batches])
        params, opt_state, _ = loop.step(params, opt_state, x, y)
        before, tokens = tokens, tokens + x.size
        steps += 1
        t += step_time
        loss = None
        if before < cfg.token_budget:
            budget_steps = steps
            if t >= next_eval or tokens >= cfg.token_budget:
                loss = loop.eval_loss(params, evals)
                curve.add(t, tokens, loss)
                if t >= next_eval:
                    next_eval += eval_dt
                if progress:
                    progress(t, tokens, loss)
        while pending and tokens >= pending[0]:
            if loss is None:
                loss = loop.eval_loss(params, evals)
            at_tokens.append([pending.pop(0), tokens, loss])
    per_island = budget_steps * 2 * (m - 1) / m * 4 * n_params  # ring all-reduce: in and out
    return dict(
        curve=curve,
        tokens=curve.tokens[-1],
        bytes_sent=per_island,
        bytes_received=per_island,
        merges=budget_steps,
        quarantined=0,
        at_tokens=at_tokens,
    )


def single_process_baseline(cfg: ExperimentConfig, tokens: int) -> float:
    """Held-out loss of `run_data_parallel` over `tokens` tokens of `cfg` (its final eval)."""
    same = with_overrides(cfg, {"token_budget": max(tokens, 1)})
    result = run_data_parallel(same, eval_dt=float("inf"), progress=lambda *_: None)
    return result["curve"].losses[-1]
