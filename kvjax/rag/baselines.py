"""RAG baselines in CacheClip's harness: full prefill, direct reuse, APE-style parallel encoding, CacheBlend.

Notes: docs/modules.md (`kvjax/rag/baselines.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.state import KVState, gather_layer
from kvjax.models.config import ModelConfig
from kvjax.engine.api import prefill
from kvjax.models.loading import Model
from kvjax.models import layer_params
from kvjax.models.transformer import Attention, RMSNorm
from kvjax.rag.assemble import AssembledContext
from kvjax.rag.prefill import RagPrefill, recompute, take_state
from kvjax.rag.recompute import budget_for
from kvjax.rag.selective import embed, final_logits, layer_step
from kvjax.models.rope import rope_frequencies


def full_prefill(model: Model, tokens, *, max_new_tokens: int = 16, page_size: int = 16,
                 chunk_size: int = 512) -> RagPrefill:
    """`kvjax.prefill` of the whole prompt `tokens int[T]` (no reuse)."""
    state, logits = prefill(model, np.asarray(tokens, np.int32)[None], max_new_tokens=max_new_tokens,
                            page_size=page_size, chunk_size=chunk_size)
    return RagPrefill(state, logits, None)


def direct_reuse(model: Model, ctx: AssembledContext) -> RagPrefill:
    """Only the query is computed over the assembled context (consumed). Use an `assemble(...,
    parallel_positions=True)` context for APE-style parallel encoding."""
    return recompute(model, ctx, np.zeros((0,), np.int32))


def project_kv(params, cfg: ModelConfig, dtype, rope, layer: int, x, positions):
    """Layer `layer`'s K and V `[B, n, H, D]` (post-RoPE) for hidden states `x [B, n, E]` at `positions`."""
    p = layer_params(params, layer)
    h = RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_offset).apply({"params": p["input_layernorm"]}, x)

    def attend(_, inputs, carry):
        return jnp.zeros_like(inputs.q), (inputs.k, inputs.v)  # the output projection is dead code

    _, kv = Attention(cfg, dtype).apply({"params": p["self_attn"]}, h, layer, positions, rope, attend, None)
    return kv


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "budget", "check_layer"), donate_argnames=("state",))
def _cacheblend_forward(params, state: KVState, tokens, positions, candidates, query_slots, *, cfg: ModelConfig,
                        dtype, budget: int, check_layer: int):
    """CacheBlend over an assembled context's state (B = 1 rows of `[B, S]`). candidates `int32[B, C]`: chunk
    slots; query_slots `int32[B, Q]`. Returns logits, the state and the selected slots `int32[B, budget]`."""
    rope = rope_frequencies(cfg, state.long_rope)
    B, S = tokens.shape
    every = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    x = embed(params, cfg, dtype, tokens)
    for layer in range(check_layer):
        x, state, _ = layer_step(params, cfg, dtype, rope, layer, x, every, positions, state)
    k_new, v_new = project_kv(params, cfg, dtype, rope, check_layer, x, positions)
    k_old, v_old, _, _ = gather_layer(state, check_layer)  # [B, H, S', D]
    k_old, v_old = (jnp.swapaxes(a, 1, 2)[:, :S] for a in (k_old, v_old))
    deviation = (jnp.sum(jnp.square(k_new - k_old).astype(jnp.float32), axis=(2, 3))
                 + jnp.sum(jnp.square(v_new - v_old).astype(jnp.float32), axis=(2, 3)))  # [B, S]
    _, top = jax.lax.top_k(jnp.take_along_axis(deviation, candidates, axis=1), budget)
    selected = jnp.sort(jnp.take_along_axis(candidates, top, axis=1), axis=1)
    active = jnp.concatenate([selected, query_slots], axis=1)
    x = jnp.take_along_axis(x, active[:, :, None], axis=1)
    for layer in range(check_layer, cfg.num_layers):
        x, state, _ = layer_step(params, cfg, dtype, rope, layer, x, active, positions, state)
    return final_logits(params, cfg, dtype, x[:, -1]), state, selected


def cacheblend_prefill(model: Model, ctx: AssembledContext, ratio: float = 0.15, *, check_layer: int = 1) -> RagPrefill:
    """CacheBlend at `ratio` of the chunk tokens (the paper uses 15-18%), over the assembled context (consumed)."""
    if not 0 <= check_layer < model.cfg.num_layers:
        raise ValueError(f"check_layer must be in 0..{model.cfg.num_layers - 1}, got {check_layer}")
    budget = budget_for(ratio, len(ctx.chunk_slots))
    tokens, positions = ctx.batch_arrays()
    logits, state, selected = _cacheblend_forward(
        model.params, take_state(ctx), tokens, positions, jnp.asarray(ctx.chunk_slots[None]),
        jnp.asarray(ctx.query_slots[None]), cfg=model.cfg, dtype=model.dtype, budget=budget, check_layer=check_layer,
    )
    return RagPrefill(state, logits, np.asarray(selected[0]), len(ctx.chunk_slots))
