"""The model: a Flax NNX module split to plain parameter pytrees at the edges.

The island and merge code never touch NNX objects: `init_params` returns a flat dict of arrays
(names are NNX state paths joined with '/'), and `apply` / `loss_fn` run the model on such a
dict. Which module: the preset's family ("gpt": `Transformer` below; "gemma":
`training.model.gemma.Gemma`) or the user's `model.factory` (`definition`, the one place that
resolves it). `compute_dtype` is the one rule for the forward/backward dtype: parameters stay
float32 (master weights), `apply` casts them to the compute dtype, the loss is float32.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from training.config.experiment import ConfigError, ModelConfig
from training.model.attention import KV, cached_attention
from training.model.gemma import Gemma


@dataclass(frozen=True)
class Dims:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    n_kv_heads: int  # the gemma family's; the gpt family has n_heads


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

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)), 3, axis=-1)
        return tuple(z.reshape(b, t, h, d // h) for z in (q, k, v))

    def _rest(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        b, t, d = x.shape
        x = x + self.attn_out(attn.reshape(b, t, d))
        return x + self.mlp_down(jax.nn.gelu(self.mlp_up(self.mlp_norm(x))))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self._qkv(x)
        return self._rest(x, jax.nn.dot_product_attention(q, k, v, is_causal=True))

    def decode(self, x: jax.Array, cache: KV, start: jax.Array) -> tuple[jax.Array, KV]:
        """`__call__` for positions start.. of a sequence whose earlier keys and values are in
        `cache`; returns the output and the cache with this chunk's keys and values."""
        q, k, v = self._qkv(x)
        attn, cache = cached_attention(q, k, v, cache, start)
        return self._rest(x, attn), cache


class Transformer(nnx.Module):
    """Pre-norm GPT: learned positions, RMSNorm, GELU MLP, output head tied to the embedding."""

    def __init__(self, dims: Dims, rngs: nnx.Rngs, dtype=None):
        """`dtype`: the compute dtype (nnx.Embed fixes its own at construction; the other
        layers follow the dtype of their inputs and parameters)."""
        init = nnx.initializers.normal(0.02)
        kw = dict(embedding_init=init, dtype=dtype, rngs=rngs)
        self.embed = nnx.Embed(dims.vocab_size, dims.d_model, **kw)
        self.pos_embed = nnx.Embed(dims.max_seq_len, dims.d_model, **kw)
        self.blocks = nnx.List([Block(dims, rngs) for _ in range(dims.n_layers)])
        self.final_norm = nnx.RMSNorm(dims.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.final_norm(x))

    def decode(self, tokens: jax.Array, cache: list[KV], start: jax.Array):
        """Logits of `tokens` at positions start.. given the keys and values of the positions
        before in `cache` (one KV per block, from `empty_cache`); returns (logits, cache)."""
        x = self.embed(tokens) + self.pos_embed(start + jnp.arange(tokens.shape[1]))[None]
        out = []
        for block, kv in zip(self.blocks, cache, strict=True):
            x, kv = block.decode(x, kv, start)
            out.append(kv)
        return self.embed.attend(self.final_norm(x)), out


def dims_of(cfg: ModelConfig) -> Dims:
    return Dims(**cfg.dims())


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    """The forward/backward dtype: `cfg.compute_dtype`, where "auto" is bfloat16 on an
    accelerator (the default JAX backend is not the CPU) and float32 on the CPU."""
    name = cfg.compute_dtype
    if name == "auto":
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return jnp.dtype(name)


LossFn = Callable[[nnx.Module, jax.Array, jax.Array], jax.Array]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats per token), computed in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def default_loss(module: nnx.Module, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """The loss of a module that maps tokens to logits: `cross_entropy(module(inputs), ...)`."""
    return cross_entropy(module(inputs), targets)


def _gpt(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return Transformer(dims_of(cfg), rngs, dtype=compute_dtype(cfg))


def _gemma(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return Gemma(dims_of(cfg), rngs, dtype=compute_dtype(cfg))


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The function named by `model.factory` ("package.module:function"); ConfigError (one
    line) when it cannot be imported or is not callable."""
    module_name, _, attr = spec.partition(":")
    where = f"model.factory {spec!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or anything the module raises on import
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(
            f"{where}: cannot import {module_name!r}: {type(err).__name__}: {first}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: module {module_name!r} has no function {attr!r}")
    return fn


@dataclass(frozen=True)
class Definition:
    """A model resolved once per config: how to build it, its parameter split and its loss."""

    build: Callable[[nnx.Rngs], nnx.Module]  # a fresh module with initialized parameters
    graphdef: Any  # nnx.GraphDef of the module (parameters split off)
    names: tuple[str, ...]  # parameter names, in NNX state order
    shapes: dict[str, jax.ShapeDtypeStruct]
    loss: LossFn


def _module_and_loss(cfg: ModelConfig, made: Any) -> tuple[nnx.Module, LossFn]:
    where = f"model.factory {cfg.factory!r}"
    module, loss = made if isinstance(made, tuple) and len(made) == 2 else (made, default_loss)
    if not isinstance(module, nnx.Module):
        raise ConfigError(
            f"{where}: returned {type(made).__name__}, expected an nnx.Module or a "
            "(module, loss_fn) pair"
        )
    if not callable(loss):
        raise ConfigError(f"{where}: its loss_fn is {type(loss).__name__}, not callable")
    return module, loss


@lru_cache(maxsize=16)
def definition(cfg: ModelConfig) -> Definition:
    """Resolve `cfg`'s model (the preset's family, or `cfg.factory`) and check it without
    allocating parameters: every state leaf is a float32 `nnx.Param`, and the loss of a
    (1, seq) batch is a scalar. Raises ConfigError (one line) for a factory that cannot be
    imported, raises, returns something else, or fails these checks."""
    if cfg.factory is None:
        make = _gemma if cfg.family == "gemma" else _gpt
    else:
        make = resolve_factory(cfg.factory)
    where = f"model.factory {cfg.factory!r}"
    losses: list[LossFn] = []

    def build(rngs: nnx.Rngs) -> nnx.Module:
        if cfg.factory is None:
            return make(cfg, rngs)
        try:
            made = make(cfg, rngs)
        except ConfigError:
            raise
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(f"{where}: raised {type(err).__name__}: {first}") from None
        module, loss = _module_and_loss(cfg, made)
        losses.append(loss)
        return module

    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        raise ConfigError(
            f"{where}: the module holds state other than nnx.Param (batch statistics, rngs, "
            "caches); only parameters are supported"
        )
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    shapes = {_path_name(p): jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in leaves}
    wrong = [n for n, s in shapes.items() if s.dtype != jnp.float32]
    if wrong:
        raise ConfigError(f"{where}: parameters must be float32, {wrong[0]!r} is not")
    if not shapes:
        raise ConfigError(f"{where}: the module has no nnx.Param")
    out = Definition(
        build=build,
        graphdef=graphdef,
        names=tuple(shapes),
        shapes=shapes,
        loss=losses[0] if losses else default_loss,
    )
    if cfg.factory is not None:
        _check_loss(cfg, out, where)
    return out


def _check_loss(cfg: ModelConfig, spec: Definition, where: str) -> None:
    t = min(8, cfg.dims()["max_seq_len"])
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
    try:
        got = jax.eval_shape(lambda p, x: _loss(cfg, spec, p, x, x), dict(spec.shapes), tokens)
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(
            f"{where}: the loss of a (1, {t}) token batch fails: {type(err).__name__}: {first}"
        ) from None
    if got.shape != ():
        raise ConfigError(f"{where}: the loss must be a scalar, got shape {got.shape}")


def _path_name(path) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def abstract_params(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of every parameter without allocating them (for 1b / 12b configs)."""
    return dict(definition(cfg).shapes)


def init_params(cfg: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """Fresh parameters as a flat {name: array} dict (float32)."""
    model = definition(cfg).build(nnx.Rngs(seed))
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


def _module(cfg: ModelConfig, spec: Definition, params: dict[str, jax.Array]) -> nnx.Module:
    dtype = compute_dtype(cfg)
    cast = {k: v.astype(dtype) if v.dtype != dtype else v for k, v in params.items()}
    return nnx.merge(spec.graphdef, nnx.State(_unflatten(cast, spec.names)))


def _loss(cfg: ModelConfig, spec: Definition, params, inputs, targets) -> jax.Array:
    return spec.loss(_module(cfg, spec, params), inputs, targets).astype(jnp.float32)


def apply(cfg: ModelConfig, params: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    """Logits for `tokens` (batch, seq) under the flat parameter dict (traceable under jit),
    computed in `compute_dtype(cfg)` (the parameters are cast; the dict is not changed)."""
    return _module(cfg, definition(cfg), params)(tokens)


def loss_fn(cfg: ModelConfig, params: dict[str, jax.Array], inputs, targets) -> jax.Array:
    """The model's float32 loss (default: mean next-token cross entropy, nats per token). Its
    gradient with respect to float32 `params` is float32 whatever the compute dtype."""
    return _loss(cfg, definition(cfg), params, inputs, targets)


# ---------------------------------------------------------------------------------------------
# Incremental decoding (sampling, training/model/sample.py)


def has_kv_cache(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s model decodes with a key/value cache: the preset families do
    (`Transformer.decode`, `Gemma.decode`); a `model.factory` module is only a function of
    whole token sequences, so sampling from it recomputes a fixed-size window per token."""
    return cfg.factory is None


def empty_cache(cfg: ModelConfig, batch: int, length: int) -> list[KV]:
    """A zero key/value cache of `length` positions per block, in the compute dtype."""
    dims = dims_of(cfg)
    hd = dims.d_model // dims.n_heads
    kv_heads = dims.n_kv_heads if cfg.family == "gemma" else dims.n_heads
    shape = (batch, length, kv_heads, hd)
    dtype = compute_dtype(cfg)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(dims.n_layers)]


def decode(
    cfg: ModelConfig, params: dict[str, jax.Array], tokens: jax.Array, cache: list[KV], start
) -> tuple[jax.Array, list[KV]]:
    """Logits of `tokens` (batch, t) at positions start..start+t-1 and the cache holding
    their keys and values too (the preset families only: `has_kv_cache`). Traceable under jit,
    `start` may be traced. Equal to `apply` on the whole prefix at those positions."""
    if not has_kv_cache(cfg):
        raise ConfigError(f"model.factory {cfg.factory!r}: no key/value cache (has_kv_cache)")
    return _module(cfg, definition(cfg), params).decode(tokens, cache, start)
