"""The "gemma" model family: a decoder-only transformer in the style of Gemma 3, in Flax NNX.

Against the "gpt" family (training/model/definition.py): rotary positions (no position embedding), a gated
GeGLU MLP (gate, up, down), grouped-query attention (`n_kv_heads` key/value heads shared by
`n_heads // n_kv_heads` query heads each), RMSNorm on queries and keys (QK-norm), zero-centred
RMSNorm scales (`x * (1 + scale)`, so weight decay pulls a norm towards the identity) and the
token embedding scaled by sqrt(d_model) on the way in; the output head is tied to it.

Parameter paths (`embed/embedding`, `blocks/{i}/...`, `final_norm/scale`) follow the gpt
family's, so fragments group a block's tensors (training/protocol/fragments.py) and the embedding is
merged by weighted mean (`fragments.is_embedding`). The model holds no state but its
`nnx.Param`s: the rotary angles are computed from the positions in each call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from training.model.attention import KV, cached_attention

ROPE_BASE = 10_000.0
NORM_EPS = 1e-6


class ZeroCenteredRMSNorm(nnx.Module):
    """RMSNorm with a zero-initialized scale applied as (1 + scale); statistics in float32,
    the result in the input's dtype."""

    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + NORM_EPS)
        scale = 1.0 + self.scale[...].astype(jnp.float32)
        return (y * scale.reshape((1,) * (x.ndim - 1) + (-1,))).astype(x.dtype)


def rope(x: jax.Array, base: float = ROPE_BASE, offset: jax.Array | int = 0) -> jax.Array:
    """Rotary position embedding of x (batch, seq, heads, head_dim) at positions
    offset..offset+seq-1, rotating the first half of head_dim against the second (Gemma's
    layout); angles in float32, the result in x's dtype."""
    t, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / hd)
    positions = jnp.arange(t, dtype=jnp.float32) + jnp.asarray(offset, jnp.float32)
    angle = positions[:, None] * freq[None, :]  # (seq, half)
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class GemmaBlock(nnx.Module):
    def __init__(self, dims, rngs: nnx.Rngs):
        d, f = dims.d_model, dims.d_ff
        self.n_heads, self.n_kv_heads = dims.n_heads, dims.n_kv_heads
        self.head_dim = hd = d // dims.n_heads
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / (2 * dims.n_layers) ** 0.5)
        self.attn_norm = ZeroCenteredRMSNorm(d)
        self.q = nnx.Linear(d, self.n_heads * hd, use_bias=False, kernel_init=init, rngs=rngs)
        self.kv = nnx.Linear(
            d, 2 * self.n_kv_heads * hd, use_bias=False, kernel_init=init, rngs=rngs
        )
        self.q_norm = ZeroCenteredRMSNorm(hd)
        self.k_norm = ZeroCenteredRMSNorm(hd)
        self.attn_out = nnx.Linear(
            self.n_heads * hd, d, use_bias=False, kernel_init=out_init, rngs=rngs
        )
        self.mlp_norm = ZeroCenteredRMSNorm(d)
        self.mlp_gate = nnx.Linear(d, f, use_bias=False, kernel_init=init, rngs=rngs)
        self.mlp_up = nnx.Linear(d, f, use_bias=False, kernel_init=init, rngs=rngs)
        self.mlp_down = nnx.Linear(f, d, use_bias=False, kernel_init=out_init, rngs=rngs)

    def _qkv(self, x: jax.Array, offset: jax.Array | int = 0):
        b, t, _ = x.shape
        hd = self.head_dim
        h = self.attn_norm(x)
        q = self.q(h).reshape(b, t, self.n_heads, hd)
        k, v = jnp.split(self.kv(h).reshape(b, t, 2 * self.n_kv_heads, hd), 2, axis=2)
        return rope(self.q_norm(q), offset=offset), rope(self.k_norm(k), offset=offset), v

    def _rest(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        x = x + self.attn_out(attn.reshape(b, t, self.n_heads * self.head_dim))
        h = self.mlp_norm(x)
        return x + self.mlp_down(jax.nn.gelu(self.mlp_gate(h)) * self.mlp_up(h))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self._qkv(x)
        return self._rest(x, jax.nn.dot_product_attention(q, k, v, is_causal=True))  # GQA

    def decode(self, x: jax.Array, cache: KV, start: jax.Array) -> tuple[jax.Array, KV]:
        """`__call__` at positions start.. with the earlier keys and values in `cache`."""
        q, k, v = self._qkv(x, start)
        attn, cache = cached_attention(q, k, v, cache, start)
        return self._rest(x, attn), cache


class Gemma(nnx.Module):
    """Pre-norm decoder: scaled tied embedding, GemmaBlocks, final zero-centred RMSNorm."""

    def __init__(self, dims, rngs: nnx.Rngs, dtype=None):
        """`dtype`: the compute dtype (nnx.Embed fixes its own at construction; the other
        layers follow the dtype of their inputs and parameters)."""
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            dims.vocab_size, dims.d_model, embedding_init=init, dtype=dtype, rngs=rngs
        )
        self.blocks = nnx.List([GemmaBlock(dims, rngs) for _ in range(dims.n_layers)])
        self.final_norm = ZeroCenteredRMSNorm(dims.d_model)
        self.embed_scale = float(dims.d_model) ** 0.5

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        x = x * jnp.asarray(self.embed_scale, x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.final_norm(x))

    def decode(self, tokens: jax.Array, cache: list[KV], start: jax.Array):
        """Logits of `tokens` at positions start.. given the earlier positions' keys and
        values in `cache` (one KV per block); returns (logits, cache)."""
        x = self.embed(tokens)
        x = x * jnp.asarray(self.embed_scale, x.dtype)
        out = []
        for block, kv in zip(self.blocks, cache, strict=True):
            x, kv = block.decode(x, kv, start)
            out.append(kv)
        return self.embed.attend(self.final_norm(x)), out
