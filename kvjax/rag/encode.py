"""Encode token sequences with the main model and keep every layer's K/V (pre- and post-RoPE): how chunk
caches are made. A dense causal forward at positions 0..T-1; the KV state is not involved."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.attention import dense_causal_attention
from kvjax.config import ModelConfig
from kvjax.models import CausalLM
from kvjax.rope import rope_frequencies


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "long_rope"))
def encode_kv(params, tokens: jax.Array, *, cfg: ModelConfig, dtype, long_rope: bool):
    """Dense causal forward over `tokens int32[B, T]` at positions 0..T-1.

    Returns `(k_pre, k, v)`, each `[L, B, T, H, D]`: keys before and after RoPE, and values.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def attend(layer, inputs, kept):
        kept = kept + ((inputs.k_pre, inputs.k, inputs.v),)
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), kept

    _, kept = CausalLM(cfg, dtype).apply(
        {"params": params}, tokens, positions, rope_frequencies(cfg, long_rope), attend, ()
    )
    return tuple(jnp.stack(parts) for parts in zip(*kept))
