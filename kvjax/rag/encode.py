"""Encode token sequences with the main model and keep every layer's K/V (pre- and post-RoPE): how chunk
caches are made. A dense causal forward at positions 0..T-1; the KV state is not involved."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.cache.attention import dense_causal_attention
from kvjax.models.config import ModelConfig
from kvjax.models import CausalLM
from kvjax.models.rope import rope_frequencies


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "long_rope"))
def encode_kv(params, tokens: jax.Array, *, cfg: ModelConfig, dtype, long_rope: bool):
    """Dense causal forward over `tokens int32[B, T]` at positions 0..T-1.

    Returns `(k_pre, k, v)`, each `[L, B, T, H, D]`: keys before and after RoPE, and values.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    # each layer writes its row of the [L, ...] buffers (the layers run in a scan: the carry is the output)
    shape = (cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim)
    kept = tuple(jnp.zeros(shape, dtype) for _ in range(3))

    windows = jnp.asarray(cfg.windows, jnp.int32)  # [L]

    def attend(layer, inputs, kept):
        kept = tuple(buf.at[layer].set(x.astype(buf.dtype)) for buf, x in zip(kept, (inputs.k_pre, inputs.k, inputs.v)))
        return dense_causal_attention(inputs.q, inputs.k, inputs.v, window=windows[layer]), kept

    _, kept = CausalLM(cfg, dtype).apply(
        {"params": params}, tokens, positions, rope_frequencies(cfg, long_rope), attend, kept
    )
    return kept
