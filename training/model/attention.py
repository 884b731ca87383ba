"""Causal attention over a key/value cache: the incremental decoding step both model families
(the gpt family's `Block` in training/model/definition.py, training/model/gemma.py) run."""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV = tuple[jax.Array, jax.Array]  # a block's cached keys and values, each (batch, S, kv_heads, hd)


def cached_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: KV, start: jax.Array
) -> tuple[jax.Array, KV]:
    """Causal attention of the queries q (batch, t, heads, hd) at positions start..start+t-1
    over the cache's keys and values with k and v (batch, t, kv_heads, hd) written at those
    positions: each query sees the positions up to its own (the same result as
    `dot_product_attention(..., is_causal=True)` over the whole prefix). Returns (attention,
    cache)."""
    ck, cv = cache
    at = (0, start, 0, 0)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), at)
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), at)
    positions = start + jnp.arange(q.shape[1])
    mask = jnp.arange(ck.shape[1])[None, :] <= positions[:, None]  # (t, S)
    return jax.nn.dot_product_attention(q, ck, cv, mask=mask[None, None]), (ck, cv)
