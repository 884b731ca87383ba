"""A model brought by a user, as `model.factory` names it (tests/test_byo_model.py).

`make` follows the contract of docs/MODELS.md ("Bring your own model"): it receives the
ModelConfig and an `nnx.Rngs`, and returns an nnx.Module mapping int32 tokens (batch, seq) to
logits (batch, seq, vocab_size). `make_with_loss` returns a (module, loss_fn) pair. The rest
break the contract in one way each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from training.config.experiment import ModelConfig
from training.model.definition import compute_dtype, cross_entropy


class Mixer(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class PrefixMeanLM(nnx.Module):
    """Causal without attention: each position sees the running mean of the embeddings so far."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dims = cfg.dims()
        d, vocab = dims["d_model"], dims["vocab_size"]
        # nnx.Embed fixes its compute dtype at construction: hand it the config's
        self.embed = nnx.Embed(vocab, d, dtype=compute_dtype(cfg), rngs=rngs)
        self.blocks = nnx.List([Mixer(d, rngs) for _ in range(dims["n_layers"])])
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        counts = jnp.arange(1, tokens.shape[1] + 1, dtype=x.dtype)[None, :, None]
        x = jnp.cumsum(x, axis=1) / counts
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return PrefixMeanLM(cfg, rngs)


SMOOTHING = 0.1


def smoothed_loss(module: nnx.Module, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Cross entropy with label smoothing, in float32."""
    logits = module(inputs).astype(jnp.float32)
    uniform = -jax.nn.log_softmax(logits, axis=-1).mean()
    return (1 - SMOOTHING) * cross_entropy(logits, targets) + SMOOTHING * uniform


def make_with_loss(cfg: ModelConfig, rngs: nnx.Rngs):
    return PrefixMeanLM(cfg, rngs), smoothed_loss


def raises(cfg: ModelConfig, rngs: nnx.Rngs):
    raise RuntimeError("no weights for you\nsecond line")


def returns_a_number(cfg: ModelConfig, rngs: nnx.Rngs):
    return 3


class WithBatchNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.inner = PrefixMeanLM(cfg, rngs)
        self.bn = nnx.BatchNorm(cfg.dims()["vocab_size"], rngs=rngs)

    def __call__(self, tokens):
        return self.bn(self.inner(tokens))


def with_batch_stats(cfg: ModelConfig, rngs: nnx.Rngs):
    return WithBatchNorm(cfg, rngs)


def vector_loss(cfg: ModelConfig, rngs: nnx.Rngs):
    return PrefixMeanLM(cfg, rngs), lambda module, x, y: module(x).mean(axis=-1)
