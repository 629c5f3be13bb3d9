"""Attention formulations in plain jnp: dense causal (no cache) and paged (a chunk of queries over a layer's
pages). Softmax runs in float32. Query head h reads kv head h // G (HF's repeat_kv)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.state import KVState, gather_layer

_MASKED = -1e30  # finite, so fully masked rows (padding queries) stay NaN-free


def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    B, T, Hq, D = q.shape
    return q.reshape(B, T, num_kv_heads, Hq // num_kv_heads, D)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None) -> jax.Array:
    """q `[B, T, Hq, D]`, k/v `[B, T, H, D]` -> `[B, T, Hq, D]`, causal over T."""
    B, T, Hq, D = q.shape
    H = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    qg = _grouped(q, H)
    scores = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(causal, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bshd->bthgd", probs.astype(v.dtype), v)
    return out.reshape(B, T, Hq, D)


def paged_attention(
    q: jax.Array, q_positions: jax.Array, state: KVState, layer: int, scale: float | None = None,
    return_probs: bool = False,
):
    """Queries `q [B, T, Hq, D]` at `q_positions int32[B, T]` over every valid slot of `layer` whose original
    position is not after the query's (so a chunk is causal within itself). Returns `[B, T, Hq, D]`, and
    with `return_probs` also the probabilities `f32[B, H, G, T, S]` in `gather_layer`'s slot order."""
    B, T, Hq, D = q.shape
    k, v, slot_pos, valid = gather_layer(state, layer)  # [B, H, S, D], [B, H, S]
    H = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    qg = _grouped(q, H)
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    visible = valid[:, :, None, None, :] & (slot_pos[:, :, None, None, :] <= q_positions[:, None, None, :, None])
    scores = jnp.where(visible, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bhsd->bthgd", probs.astype(q.dtype), v.astype(q.dtype)).reshape(B, T, Hq, D)
    return (out, jnp.where(visible, probs, 0.0)) if return_probs else out


def _layer_table(state: KVState, layer: int):
    return state.page_table[layer, :, :, : state.layer_read_pages(layer)], state.lengths[layer]


def dense_decode_attention(q: jax.Array, state: KVState, layer: int) -> jax.Array:
    """One decode query per head `q [B, 1, Hq, D]` over every valid slot of `layer`, through the
    backend-dispatched paged decode kernel (pallas_kernels). Returns `[B, 1, Hq, D]`."""
    import pallas_kernels

    table, lengths = _layer_table(state, layer)
    return pallas_kernels.paged_decode(q[:, 0], state.k_pages, state.v_pages, table, lengths)[:, None]


def sparse_decode_attention(q: jax.Array, state: KVState, layer: int, selected: jax.Array) -> jax.Array:
    """As `dense_decode_attention`, over the `selected int32[B, Hq or H, K]` logical pages plus each head's
    current page (Quest)."""
    import pallas_kernels

    table, lengths = _layer_table(state, layer)
    return pallas_kernels.sparse_paged_decode(q[:, 0], state.k_pages, state.v_pages, table, selected, lengths)[:, None]
