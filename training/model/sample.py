"""Sampling a continuation from the preset families with the key/value cache
(`definition.decode`): the prompt is prefilled in one call, then one jitted step per token
(temperature, top-k, a seeded PRNG key). Token ids in, token ids out: decoding the text
with the experiment's tokenizer is the caller's (the `diloco sample` command, not yet built)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from training.config.experiment import ConfigError, ModelConfig
from training.model import definition as model


def _pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """The next token from the last position's logits (batch, vocab): argmax when temperature
    is 0, else a draw from softmax(logits / temperature) over the top_k largest (0: all)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def sample(
    cfg: ModelConfig,
    params: dict[str, jax.Array],
    prompt: list[int],
    max_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """`max_tokens` new token ids after `prompt` (prompt + new within `cfg.max_seq_len`)."""
    if not prompt:
        raise ConfigError("sample: the prompt has no tokens")
    if temperature < 0 or top_k < 0 or max_tokens < 0:
        raise ConfigError("sample: temperature, top-k and max-tokens must be >= 0")
    total, limit = len(prompt) + max_tokens, cfg.dims()["max_seq_len"]
    if total > limit:
        raise ConfigError(f"sample: prompt + max-tokens = {total} > max_seq_len {limit}")
    cache = model.empty_cache(cfg, batch=1, length=limit)
    step = _step(cfg, float(temperature), int(top_k))
    key = jax.random.key(seed)
    tokens = jnp.asarray([prompt], jnp.int32)
    out: list[int] = []
    start = 0
    for _ in range(max_tokens):
        key, sub = jax.random.split(key)
        nxt, cache = step(params, tokens, cache, jnp.int32(start), sub)
        start += tokens.shape[1]
        out.append(int(np.asarray(nxt)[0]))
        tokens = nxt[:, None].astype(jnp.int32)
    return out


@functools.lru_cache(maxsize=16)
def _step(cfg: ModelConfig, temperature: float, top_k: int):
    """The jitted decode-and-pick step (compiled once for the prompt's length, once for 1)."""

    def step(params, tokens, cache, start, key):
        logits, cache = model.decode(cfg, params, tokens, cache, start)
        return _pick(logits[:, -1], key, temperature, top_k), cache

    return jax.jit(step)
