"""Baselines in the same harness: full prefill, direct reuse, APE-style parallel encoding, CacheBlend.

- full: `kvjax.prefill` over the whole prompt (the library's chunked paged prefill).
- reuse: the assembled chunk K/V as they are; only the query is computed.
- ape: chunks keep their encoding positions (all start right after the shared prefix) and the query follows
  the longest one, as APE's parallel encoding; APE's attention temperature and scale are not applied
  (decode reads the cache through kvjax's unmodified attention).
- cacheblend: layers before `check_layer` (1) run over every token; at `check_layer` every token's K/V is
  projected, and the tokens whose fresh K/V deviate most from the reused ones (squared L2 over heads, K plus
  V; CacheBlend's HKVD tokens) are recomputed from there on, with the query.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig
from kvjax.engine.api import prefill
from kvjax.models.loading import Model
from kvjax.models import layer_params
from kvjax.models.transformer import Attention, RMSNorm
from kvjax.rag.assemble import AssembledContext
from kvjax.rag.prefill import RagPrefill, recompute, store_result
from kvjax.rag.recompute import budget_for
from kvjax.rag.selective import embed, final_logits, layer_step
from kvjax.models.rope import rope_frequencies


def full_prefill(model: Model, tokens, *, max_new_tokens: int = 16, page_size: int = 16,
                 chunk_size: int = 512) -> RagPrefill:
    """`kvjax.prefill` of the whole prompt `tokens int[T]` (no reuse)."""
    state, logits = prefill(model, np.asarray(tokens, np.int32)[None], max_new_tokens=max_new_tokens,
                            page_size=page_size, chunk_size=chunk_size)
    return RagPrefill(state, logits, None)


def direct_reuse(model: Model, ctx: AssembledContext, **kwargs) -> RagPrefill:
    """Only the query is computed over the assembled K/V (consumed). Use an `assemble(..., parallel_positions=True)`
    context for APE-style parallel encoding."""
    return recompute(model, ctx, np.zeros((0,), np.int32), **kwargs)


def project_kv(params, cfg: ModelConfig, dtype, rope, layer: int, x, positions):
    """Layer `layer`'s K and V `[B, n, H, D]` (post-RoPE) for hidden states `x [B, n, E]` at `positions`."""
    p = layer_params(params, layer)
    h = RMSNorm(cfg.rms_norm_eps, dtype).apply({"params": p["input_layernorm"]}, x)

    def attend(_, inputs, carry):
        return jnp.zeros_like(inputs.q), (inputs.k, inputs.v)  # the output projection is dead code

    _, kv = Attention(cfg, dtype).apply({"params": p["self_attn"]}, h, layer, positions, rope, attend, None)
    return kv


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "long_rope", "budget", "check_layer"),
                   donate_argnames=("k_layers", "v_layers"))
def _cacheblend_forward(params, k_layers, v_layers, tokens, positions, candidates, query_slots, *, cfg: ModelConfig,
                        dtype, long_rope: bool, budget: int, check_layer: int):
    """CacheBlend over an assembled context (B = 1 rows of `[B, S]`). candidates `int32[B, C]`: chunk slots;
    query_slots `int32[B, Q]`. Returns logits, K/V per layer and the selected slots `int32[B, budget]`."""
    rope = rope_frequencies(cfg, long_rope)
    k_layers, v_layers = list(k_layers), list(v_layers)
    B, S = tokens.shape
    valid = jnp.ones((B, S), bool)
    every = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    x = embed(params, cfg, dtype, tokens)
    for layer in range(check_layer):
        x, k_layers[layer], v_layers[layer], _ = layer_step(
            params, cfg, dtype, rope, layer, x, every, positions, k_layers[layer], v_layers[layer], valid)
    k_new, v_new = project_kv(params, cfg, dtype, rope, check_layer, x, positions)
    deviation = (jnp.sum(jnp.square(k_new - k_layers[check_layer]).astype(jnp.float32), axis=(2, 3))
                 + jnp.sum(jnp.square(v_new - v_layers[check_layer]).astype(jnp.float32), axis=(2, 3)))  # [B, S]
    _, top = jax.lax.top_k(jnp.take_along_axis(deviation, candidates, axis=1), budget)
    selected = jnp.sort(jnp.take_along_axis(candidates, top, axis=1), axis=1)
    active = jnp.concatenate([selected, query_slots], axis=1)
    x = jnp.take_along_axis(x, active[:, :, None], axis=1)
    for layer in range(check_layer, cfg.num_layers):
        x, k_layers[layer], v_layers[layer], _ = layer_step(
            params, cfg, dtype, rope, layer, x, active, positions, k_layers[layer], v_layers[layer], valid)
    return final_logits(params, cfg, dtype, x[:, -1]), tuple(k_layers), tuple(v_layers), selected


def cacheblend_prefill(model: Model, ctx: AssembledContext, ratio: float = 0.15, *, check_layer: int = 1,
                       max_new_tokens: int = 16, capacity: int | None = None, page_size: int = 16) -> RagPrefill:
    """CacheBlend at `ratio` of the chunk tokens (the paper uses 15-18%), over the assembled K/V (consumed)."""
    if not 0 <= check_layer < model.cfg.num_layers:
        raise ValueError(f"check_layer must be in 0..{model.cfg.num_layers - 1}, got {check_layer}")
    budget = budget_for(ratio, len(ctx.chunk_slots))
    tokens, positions, _ = ctx.batch_arrays()
    logits, k, v, selected = _cacheblend_forward(
        model.params, ctx.k, ctx.v, tokens, positions, jnp.asarray(ctx.chunk_slots[None]),
        jnp.asarray(ctx.query_slots[None]), cfg=model.cfg, dtype=model.dtype, long_rope=ctx.long_rope,
        budget=budget, check_layer=check_layer,
    )
    ctx.k = ctx.v = None  # donated
    result = store_result(model, ctx, k, v, logits, None, max_new_tokens=max_new_tokens, capacity=capacity,
                          page_size=page_size)
    result.recomputed = np.asarray(selected[0])
    return result
