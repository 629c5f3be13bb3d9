"""Encode token sequences with the main model and keep every layer's K/V (pre- and post-RoPE): how chunk
caches are made, by the one dense forward (`kvjax.engine.api.dense_forward`) with a recording hook."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.engine.api import dense_forward
from kvjax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "long_rope"))
def encode_kv(params, tokens: jax.Array, *, cfg: ModelConfig, dtype, long_rope: bool):
    """Dense causal forward over `tokens int32[B, T]` at positions 0..T-1.

    Returns `(k_pre, k, v)`, each `[L, B, T, H, D]`: keys before and after RoPE, and values.
    """
    B, T = tokens.shape
    # each layer writes its row of the [L, ...] buffers (the layers run in a scan: the carry is the output)
    shape = (cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim)
    kept = tuple(jnp.zeros(shape, dtype) for _ in range(3))

    def record(layer, inputs, kept):
        return tuple(buf.at[layer].set(x.astype(buf.dtype)) for buf, x in zip(kept, (inputs.k_pre, inputs.k, inputs.v)))

    _, kept = dense_forward(params, tokens, cfg, dtype, long_rope, observe=record, observed=kept)
    return kept
