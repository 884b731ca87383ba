"""Decoder-only transformer LM in Flax NNX, split to plain parameter pytrees at the edges.

The island and merge code never touch NNX objects: `init_params` returns a flat dict of arrays
(names are NNX state paths joined with '/'), and `apply` runs the model on such a dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import jax
import jax.numpy as jnp
from flax import nnx

from training.config import ModelConfig


@dataclass(frozen=True)
class Dims:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab_size: int
    max_seq_len: int


class Block(nnx.Module):
    def __init__(self, dims: Dims, rngs: nnx.Rngs):
        d, f = dims.d_model, dims.d_ff
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / (2 * dims.n_layers) ** 0.5)
        self.n_heads = dims.n_heads
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, kernel_init=init, rngs=rngs)
        self.attn_out = nnx.Linear(d, d, use_bias=False, kernel_init=out_init, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp_up = nnx.Linear(d, f, use_bias=False, kernel_init=init, rngs=rngs)
        self.mlp_down = nnx.Linear(f, d, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)), 3, axis=-1)
        q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.reshape(b, t, d))
        return x + self.mlp_down(jax.nn.gelu(self.mlp_up(self.mlp_norm(x))))


class Transformer(nnx.Module):
    """Pre-norm GPT: learned positions, RMSNorm, GELU MLP, output head tied to the embedding."""

    def __init__(self, dims: Dims, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(dims.vocab_size, dims.d_model, embedding_init=init, rngs=rngs)
        self.pos_embed = nnx.Embed(dims.max_seq_len, dims.d_model, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(dims, rngs) for _ in range(dims.n_layers)])
        self.final_norm = nnx.RMSNorm(dims.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.final_norm(x))


def dims_of(cfg: ModelConfig) -> Dims:
    return Dims(**cfg.dims())


def _path_name(path) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


@lru_cache(maxsize=8)
def _graphdef_and_names(dims: Dims):
    abstract = nnx.eval_shape(lambda: Transformer(dims, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    return graphdef, tuple(_path_name(p) for p, _ in leaves)


def abstract_params(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of every parameter without allocating them (for 1b / 12b configs)."""
    abstract = nnx.eval_shape(lambda: Transformer(dims_of(cfg), nnx.Rngs(0)))
    _, state = nnx.split(abstract, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    return {_path_name(p): jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in leaves}


def init_params(cfg: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """Fresh parameters as a flat {name: array} dict."""
    model = Transformer(dims_of(cfg), nnx.Rngs(seed))
    _, state = nnx.split(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    return {_path_name(p): x for p, x in leaves}


def _unflatten(flat: dict[str, jax.Array], names: tuple[str, ...]) -> dict:
    tree: dict = {}
    for name in names:
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(int(key) if key.isdigit() else key, {})
        node[leaf] = flat[name]
    return tree


def apply(cfg: ModelConfig, params: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    """Logits for `tokens` (batch, seq) under the flat parameter dict (traceable under jit)."""
    graphdef, names = _graphdef_and_names(dims_of(cfg))
    state = nnx.State(_unflatten(params, names))
    model = nnx.merge(graphdef, state)
    return model(tokens)


def loss_fn(cfg: ModelConfig, params: dict[str, jax.Array], inputs, targets) -> jax.Array:
    """Mean next-token cross entropy (nats per token)."""
    logits = apply(cfg, params, inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
