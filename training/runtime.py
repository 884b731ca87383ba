"""Process-wide caches: compiled inner loops, corpora and fragment layouts.

Islands, the merger, evaluation and the benchmarks running in one process share these, so a
model is compiled and a corpus tokenized once per process.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from training import inner, model
from training.config import ExperimentConfig
from training.data import Corpus, load_corpus
from training.fragments import assign_fragments, split_by_fragment

_cache: dict[tuple, object] = {}


def shared(key: tuple, build: Callable[[], object]):
    """The cached value for `key`, built on first use."""
    if key not in _cache:
        _cache[key] = build()
    return _cache[key]


def corpus_for(cfg: ExperimentConfig) -> Corpus:
    vocab = cfg.model.dims()["vocab_size"]
    key = ("corpus", cfg.data.source, cfg.data.eval_fraction, vocab)
    return shared(key, lambda: load_corpus(cfg.data.source, cfg.data.eval_fraction, vocab))


def loop_for(cfg: ExperimentConfig) -> inner.InnerLoop:
    key = ("loop", cfg.model, cfg.inner, len(jax.devices()))
    return shared(
        key,
        lambda: inner.InnerLoop(
            cfg.model, cfg.inner, inner.make_mesh(), shard_params=cfg.inner.shard_params
        ),
    )


def fragment_names(cfg: ExperimentConfig) -> list[list[str]]:
    """Parameter names of each fragment, in a fixed order."""

    def build() -> list[list[str]]:
        shapes = {k: v.shape for k, v in model.abstract_params(cfg.model).items()}
        assignment = assign_fragments(shapes, cfg.fragments.count, cfg.fragments.strategy)
        return [
            sorted(split_by_fragment(shapes, assignment, p)) for p in range(cfg.fragments.count)
        ]

    return shared(("fragments", cfg.model, cfg.fragments), build)
