"""Selective prefill: the main model over only some tokens of an assembled RAG context, a paged `KVState`.

Notes: docs/modules.md (`kvjax/rag/selective.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.attention import paged_attention
from kvjax.cache.state import KVState, write_slots
from kvjax.models.config import ModelConfig
from kvjax.models import layer_params
from kvjax.models.transformer import DecoderLayer, embed, final_logits
from kvjax.models.rope import rope_frequencies


def layer_step(params, cfg: ModelConfig, dtype, rope, layer: int, x, slots, positions, state: KVState,
               return_probs: bool = False):
    """One decoder layer for the active tokens.

    x `[B, n, E]` hidden states of the tokens at logical `slots int32[B, n]`; `positions int32[B, S]` of every
    slot of the context; `state` holds the context (this layer's slots at `slots` are overwritten). Returns
    `(x, state, probs f32[B, n, S'] or None)`: head-averaged attention over the layer's slots (S' >= S, in
    `gather_layer`'s order) when `return_probs`.
    """
    x_positions = jnp.take_along_axis(positions, slots, axis=1)

    def attend(_, inputs, state):
        state = write_slots(state, layer, slots, inputs.k, inputs.v)
        result = paged_attention(inputs.q, x_positions, state, layer, return_probs=return_probs, q_slots=slots)
        if not return_probs:
            return result, (state, None)
        out, probs = result
        return out, (state, probs.mean(axis=(1, 2)))

    module = DecoderLayer(cfg, dtype)
    x, (state, probs) = module.apply(
        {"params": layer_params(params, layer)}, x, layer, x_positions, rope, attend, state
    )
    return x, state, probs


def subset_rows(x, slots, new_slots):
    """Rows of `x [B, n, E]` (hidden states of `slots int32[B, n]`, sorted) for `new_slots int32[B, m]`,
    each of which must be in `slots`."""
    index = jax.vmap(jnp.searchsorted)(slots, new_slots)
    return jnp.take_along_axis(x, index[:, :, None], axis=1)


def _selective_forward(params, state: KVState, tokens, positions, active, *, cfg: ModelConfig, dtype,
                       probs_layer: int | None = None):
    """Recompute the `active` tokens over the context held in `state`.

    tokens, positions `int32[B, S]` of the context's slots. active: a tuple with one sorted `int32[B, n_l]`
    per layer to run (len(active) <= the state's layers; each set inside the previous one).
    `selective_forward` donates the state; `selective_forward_keep` leaves it intact.
    Returns `(logits f32[B, V] at the last active slot of the last layer run, state, probs)`; probs is
    `f32[B, n, S']` (head-averaged attention of that layer's active tokens, `layer_step`) at `probs_layer`,
    else None.
    """
    rope = rope_frequencies(cfg, state.long_rope)
    x = embed(params, cfg, dtype, jnp.take_along_axis(tokens, active[0], axis=1))
    probs = None
    for layer, slots in enumerate(active):
        if layer:
            x = subset_rows(x, active[layer - 1], slots)
        x, state, p = layer_step(params, cfg, dtype, rope, layer, x, slots, positions, state,
                                 return_probs=layer == probs_layer)
        probs = p if p is not None else probs
    logits = final_logits(params, cfg, dtype, x[:, -1])
    return logits, state, probs


_STATIC = ("cfg", "dtype", "probs_layer")
selective_forward = jax.jit(_selective_forward, static_argnames=_STATIC, donate_argnames=("state",))
# For callers that read the context again afterwards (the auxiliary scorer reads the main model's).
selective_forward_keep = jax.jit(_selective_forward, static_argnames=_STATIC)
