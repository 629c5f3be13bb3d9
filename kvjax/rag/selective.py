"""Selective prefill: run the main model over only some tokens of an assembled context whose K/V are reused.

At each layer the active tokens (a sorted slot subset; each layer's set is contained in the previous one's)
compute q, k, v; their k, v overwrite the reused ones of that layer, and their queries attend over every
slot at or before their own (slot order is causal order). Tokens that are not active keep the reused K/V.
With every token active at every layer this is a full causal prefill; with only the query tokens active it
is direct reuse. The layers run one at a time (the same Linen `DecoderLayer` the model uses, unrolled:
each layer's active set has its own size), so hidden states are carried only for the active tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.attention import masked_attention as reference_attention
from kvjax.models.config import ModelConfig
from kvjax.models import CausalLM, layer_params
from kvjax.models.transformer import DecoderLayer
from kvjax.models.rope import rope_frequencies

def masked_attention(q, q_slots, k, v, valid, return_probs: bool = False):
    """Queries `q [B, n, Hq, D]` at slots `q_slots int32[B, n]` over keys `k, v [B, S, H, D]`: a query
    sees slot j when j <= its slot and `valid bool[B, S]` (`kvjax.cache.attention.masked_attention` with that
    mask). Returns `[B, n, Hq, D]`, and with `return_probs` also the head-averaged probabilities `f32[B, n, S]`."""
    visible = (jnp.arange(k.shape[1])[None, None, :] <= q_slots[:, :, None]) & valid[:, None, :]  # [B, n, S]
    k, v, visible = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), visible[:, None, None]
    if not return_probs:
        return reference_attention(q, k, v, visible), None
    out, probs = reference_attention(q, k, v, visible, return_probs=True)
    return out, probs.mean(axis=(1, 2))


def embed(params, cfg: ModelConfig, dtype, tokens):
    """Token embeddings `[B, n, E]` of `tokens int32[B, n]`."""
    return CausalLM(cfg, dtype).apply({"params": params}, tokens, method=lambda m, t: m.embed_tokens(t))


def final_logits(params, cfg: ModelConfig, dtype, hidden):
    """Final norm and vocabulary logits `f32[..., V]` of hidden states `[..., E]`."""
    return CausalLM(cfg, dtype).apply({"params": params}, hidden, method=lambda m, h: m.logits(m.norm(h)))


def layer_step(params, cfg: ModelConfig, dtype, rope, layer: int, x, slots, positions, k_layer, v_layer, valid,
               return_probs: bool = False):
    """One decoder layer for the active tokens.

    x `[B, n, E]` hidden states of the tokens at `slots int32[B, n]`; `positions int32[B, S]` of every slot;
    `k_layer, v_layer [B, S, H, D]` this layer's K/V (post-RoPE), overwritten at `slots`. Returns
    `(x, k_layer, v_layer, probs f32[B, n, S] or None)`.
    """
    rows = jnp.arange(slots.shape[0])[:, None]
    x_positions = jnp.take_along_axis(positions, slots, axis=1)

    def attend(_, inputs, carry):
        k = carry[0].at[rows, slots].set(inputs.k.astype(carry[0].dtype))
        v = carry[1].at[rows, slots].set(inputs.v.astype(carry[1].dtype))
        out, probs = masked_attention(inputs.q, slots, k, v, valid, return_probs)
        return out, (k, v, probs)

    module = DecoderLayer(cfg, dtype)
    x, (k_layer, v_layer, probs) = module.apply(
        {"params": layer_params(params, layer)}, x, layer, x_positions, rope, attend, (k_layer, v_layer, None)
    )
    return x, k_layer, v_layer, probs


def subset_rows(x, slots, new_slots):
    """Rows of `x [B, n, E]` (hidden states of `slots int32[B, n]`, sorted) for `new_slots int32[B, m]`,
    each of which must be in `slots`."""
    index = jax.vmap(jnp.searchsorted)(slots, new_slots)
    return jnp.take_along_axis(x, index[:, :, None], axis=1)


def _selective_forward(params, k_layers, v_layers, tokens, positions, valid, active, *, cfg: ModelConfig, dtype,
                      long_rope: bool, probs_layer: int | None = None):
    """Recompute the `active` tokens over reused K/V.

    k_layers, v_layers: tuples of `[B, S, H, D]` per layer (post-RoPE at `positions int32[B, S]`), donated.
    tokens `int32[B, S]`; valid `bool[B, S]` (slots that exist). active: a tuple with one sorted
    `int32[B, n_l]` per layer to run (len(active) <= L layers run; each set inside the previous one).
    `selective_forward` donates k_layers and v_layers; `selective_forward_keep` leaves them intact.
    Returns `(logits f32[B, V] at the last active slot of the last layer run, k_layers, v_layers, probs)`;
    probs is `f32[B, n, S]` (head-averaged attention of that layer's active tokens) at `probs_layer`, else None.
    """
    rope = rope_frequencies(cfg, long_rope)
    k_layers, v_layers = list(k_layers), list(v_layers)
    x = embed(params, cfg, dtype, jnp.take_along_axis(tokens, active[0], axis=1))
    probs = None
    for layer, slots in enumerate(active):
        if layer:
            x = subset_rows(x, active[layer - 1], slots)
        x, k_layers[layer], v_layers[layer], p = layer_step(
            params, cfg, dtype, rope, layer, x, slots, positions, k_layers[layer], v_layers[layer], valid,
            return_probs=layer == probs_layer,
        )
        probs = p if p is not None else probs
    logits = final_logits(params, cfg, dtype, x[:, -1])
    return logits, tuple(k_layers), tuple(v_layers), probs


_STATIC = ("cfg", "dtype", "long_rope", "probs_layer")
selective_forward = jax.jit(_selective_forward, static_argnames=_STATIC, donate_argnames=("k_layers", "v_layers"))
# For callers that read the reused K/V again afterwards (the auxiliary scorer reads the main model's).
selective_forward_keep = jax.jit(_selective_forward, static_argnames=_STATIC)
