"""Process-wide caches: compiled inner loops, corpora and fragment layouts.

Islands, the merger, evaluation and the benchmarks running in one process share these, so a
model is compiled and a corpus tokenized once per process.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from training.config.experiment import ExperimentConfig
from training.data.batches import Corpus
from training.data.corpus import load_corpus
from training.data.tokenizer import tokenizer_for
from training.model import definition as model
from training.model import inner
from training.protocol.fragments import assign_fragments, split_by_fragment

_cache: dict[tuple, object] = {}


def shared(key: tuple, build: Callable[[], object]):
    """The cached value for `key`, built on first use."""
    if key not in _cache:
        _cache[key] = build()
    return _cache[key]


def corpus_for(cfg: ExperimentConfig) -> Corpus:
    """The experiment's corpus, tokenized with its tokenizer (`tokenizer_for`: checked against
    the sha256 config.json records)."""
    vocab = cfg.model.dims()["vocab_size"]
    tok = tokenizer_for(cfg)
    key = ("corpus", cfg.data.source, cfg.data.eval_fraction, vocab, tok.sha256)
    return shared(
        key,
        lambda: load_corpus(cfg.data.source, cfg.data.eval_fraction, vocab, tokenizer=tok),
    )


def island_mesh_devices(cfg: ExperimentConfig, island: str | None) -> list:
    """The devices of an island's data-parallel mesh: every device its processes see (all
    hosts of a multi-host island, process-major), or the first `islands[].devices` of them in
    a single process. Raises RuntimeError (one line) when they are too few, or when a
    multi-process island asks for fewer than it has (every host must hold part of the mesh)."""
    devices = list(jax.devices())
    want = cfg.island(island).devices if island is not None else None
    if want is None or want == len(devices):
        return devices
    if want > len(devices) or jax.process_count() > 1:
        raise RuntimeError(
            f"island {island!r} asks for {want} devices (islands[].devices) and its "
            f"{jax.process_count()} process(es) see {len(devices)}"
        )
    return devices[:want]


def loop_for(cfg: ExperimentConfig, island: str | None = None) -> inner.InnerLoop:
    """The compiled inner loop over `island`'s mesh (`island_mesh_devices`; None: every
    device), shared by everything in the process with the same model, settings and devices."""
    devices = island_mesh_devices(cfg, island)
    decay = cfg.inner_decay_steps(island)
    key = ("loop", cfg.model, cfg.inner, decay, tuple(d.id for d in devices))
    return shared(
        key,
        lambda: inner.InnerLoop(
            cfg.model,
            cfg.inner,
            inner.make_mesh(devices),
            shard_params=cfg.inner.shard_params,
            decay_steps=decay,
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


def fragment_shapes(cfg: ExperimentConfig) -> list[dict[str, tuple[int, ...]]]:
    """Each fragment's {parameter name: shape}, in `fragment_names` order."""
    shapes = {k: tuple(v.shape) for k, v in model.abstract_params(cfg.model).items()}
    return [{n: shapes[n] for n in names} for names in fragment_names(cfg)]
