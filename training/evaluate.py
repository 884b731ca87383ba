"""Held-out evaluation of global versions."""

from __future__ import annotations

import time

from training.config import ExperimentConfig
from training.data import eval_batches
from training.island import corpus_for, loop_for


def eval_loss(cfg: ExperimentConfig, params) -> float:
    """Mean next-token loss of `params` on the held-out split (fixed, deterministic batches)."""
    corpus = corpus_for(cfg)
    batches = eval_batches(
        corpus.eval, cfg.data.batch_size, cfg.data.seq_len, cfg.data.eval_batches
    )
    loop = loop_for(cfg)
    return loop.eval_loss(loop.put_params(params), batches)


def evaluate_version(cfg: ExperimentConfig, store, version: int | None = None) -> dict:
    """Evaluate a committed global version (default: the head) and record it in metrics/eval."""
    g = store.load_global(store.find_version(version) if version is not None else None)
    record = dict(
        version=g.version,
        loss=eval_loss(cfg, g.params),
        tokens_merged=int(g.manifest.get("tokens_merged", 0)),
        at=time.time(),
    )
    store.append_metric("eval", record)
    return record


def evaluate_current(cfg: ExperimentConfig, store) -> dict:
    """Evaluate the current global model and record it in metrics/eval.

    Returns the record: ``loss``, ``tokens_merged``, ``at`` and ``version`` (the model evaluated).
    """
    return evaluate_version(cfg, store)


def single_process_baseline(cfg: ExperimentConfig, tokens: int) -> float:
    """Held-out loss of one process training the same model on the same shards and token count
    (all islands' batches in each step), for comparison with what the islands produced."""
    from training.bench.quality import run_dp
    from training.config import with_overrides

    same = with_overrides(cfg, {"token_budget": max(tokens, 1)})
    result = run_dp(same, eval_dt=float("inf"), progress=lambda *_: None)
    return result["curve"].losses[-1]
