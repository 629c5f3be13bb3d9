"""Attention formulations in plain jnp: dense causal (no cache) and paged (a chunk of queries over a layer's
pages). Softmax runs in float32. Query head h reads kv head h // G (HF's repeat_kv). A `layer` argument may
be a traced int32 scalar (the steps scan over layers); the pages it reads stay static (`KVState.read_pages`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.state import KVState, gather_layer

MASKED = -1e30  # finite, so fully masked rows (padding queries) stay NaN-free


def grouped_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """`q [B, T, Hq, D]` -> `[B, T, H, G, D]`: query head h*G + g reads kv head h (HF's repeat_kv order)."""
    B, T, Hq, D = q.shape
    return q.reshape(B, T, num_kv_heads, Hq // num_kv_heads, D)



def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None, block: int = 256
) -> jax.Array:
    """q `[B, T, Hq, D]`, k/v `[B, T, H, D]` -> `[B, T, Hq, D]`, causal over T.

    Queries go in blocks of `block` rows, each against the keys up to its last row only, so the masked
    upper triangle is mostly never computed (about half the work at long T). Measured on this project's
    2-core CPU (forward + backward, B=2, T=2048, 4 heads of 32): 0.38 s against 3.4 s for one
    `[B, H, G, T, T]` einsum over all keys, whose grouped layout XLA's CPU dot also handles poorly.
    """
    B, T, Hq, D = q.shape
    H = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    k_rep = jnp.repeat(k, Hq // H, axis=2) if Hq != H else k
    v_rep = jnp.repeat(v, Hq // H, axis=2) if Hq != H else v
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        scores = jnp.einsum("bthd,bshd->bhts", q[:, start:end], k_rep[:, :end], preferred_element_type=jnp.float32)
        causal = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        probs = jax.nn.softmax(jnp.where(causal, scores * scale, MASKED), axis=-1)
        outs.append(jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v_rep[:, :end]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def paged_attention(
    q: jax.Array, q_positions: jax.Array, state: KVState, layer, scale: float | None = None,
    return_probs: bool = False,
):
    """Queries `q [B, T, Hq, D]` at `q_positions int32[B, T]` over every valid slot of `layer` whose original
    position is not after the query's (so a chunk is causal within itself). Returns `[B, T, Hq, D]`, and
    with `return_probs` also the probabilities `f32[B, H, G, T, S]` in `gather_layer`'s slot order."""
    B, T, Hq, D = q.shape
    k, v, slot_pos, valid = gather_layer(state, layer)  # [B, H, S, D], [B, H, S]
    H = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    qg = grouped_queries(q, H)
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    visible = valid[:, :, None, None, :] & (slot_pos[:, :, None, None, :] <= q_positions[:, None, None, :, None])
    scores = jnp.where(visible, scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bhsd->bthgd", probs.astype(q.dtype), v.astype(q.dtype)).reshape(B, T, Hq, D)
    return (out, jnp.where(visible, probs, 0.0)) if return_probs else out


def _layer_table(state: KVState, layer):
    return state.page_table[layer, :, :, : state.layer_read_pages(layer)], state.lengths[layer]


def dense_decode_attention(q: jax.Array, state: KVState, layer) -> jax.Array:
    """One decode query per head `q [B, 1, Hq, D]` over every valid slot of `layer`, through the
    backend-dispatched paged decode kernel (pallas_kernels). Returns `[B, 1, Hq, D]`."""
    from kvjax import pallas_kernels

    table, lengths = _layer_table(state, layer)
    return pallas_kernels.paged_decode(q[:, 0], state.k_pages, state.v_pages, table, lengths)[:, None]


def sparse_decode_attention(q: jax.Array, state: KVState, layer, selected: jax.Array) -> jax.Array:
    """As `dense_decode_attention`, over the `selected int32[B, Hq or H, K]` logical pages plus each head's
    current page (Quest)."""
    from kvjax import pallas_kernels

    table, lengths = _layer_table(state, layer)
    return pallas_kernels.sparse_paged_decode(q[:, 0], state.k_pages, state.v_pages, table, selected, lengths)[:, None]


def blocked_paged_attention(
    q: jax.Array, q_positions: jax.Array, state: KVState, layer, block_pages: int = 32,
    scale: float | None = None,
) -> jax.Array:
    """`paged_attention` for a chunk of queries, computed block by block with an online softmax.

    The loop visits only blocks of `block_pages` logical pages below the longest head's length (a dynamic
    trip count), so a prefill chunk costs what has been written so far rather than the whole capacity,
    and no `[.., T, S]` score tensor over the capacity is ever materialised. Returns `[B, T, Hq, D]`.
    """
    B, T, Hq, D = q.shape
    ps, N = state.page_size, state.num_pages
    table = state.page_table[layer, :, :, : state.layer_read_pages(layer)]
    H, P = table.shape[1], table.shape[2]
    G = Hq // H
    block_pages = max(1, min(block_pages, P))
    num_blocks = -(-P // block_pages)
    table = jnp.pad(table, ((0, 0), (0, 0), (0, num_blocks * block_pages - P)), constant_values=-1)
    lengths = state.lengths[layer]  # [B, H]
    block_slots = block_pages * ps
    scale = D**-0.5 if scale is None else scale
    qg = (grouped_queries(q, H) * scale).astype(q.dtype)  # [B, T, H, G, D]

    def body(i, carry):
        m, l, acc = carry  # [B, H, G, T], [B, H, G, T], [B, T, H, G, D]
        pages = jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, axis=2)  # [B, H, bp]
        safe = jnp.clip(pages, 0, N - 1)
        k = state.k_pages[safe].reshape(B, H, block_slots, D)
        v = state.v_pages[safe].reshape(B, H, block_slots, D)
        pos = state.slot_pos[safe].reshape(B, H, block_slots)
        slot = i * block_slots + jnp.arange(block_slots)
        valid = (slot[None, None, :] < lengths[:, :, None]) & (pos >= 0) & jnp.repeat(pages >= 0, ps, axis=-1)
        visible = valid[:, :, None, None, :] & (pos[:, :, None, None, :] <= q_positions[:, None, None, :, None])
        s = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None]) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        pv = jnp.einsum("bhgts,bhsd->bthgd", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
        acc = acc * jnp.moveaxis(correction, 3, 1)[..., None] + pv
        return m_new, l, acc

    init = (
        jnp.full((B, H, G, T), MASKED, jnp.float32),
        jnp.zeros((B, H, G, T), jnp.float32),
        jnp.zeros((B, T, H, G, D), jnp.float32),
    )
    blocks_used = (jnp.max(lengths) + block_slots - 1) // block_slots
    _, l, acc = jax.lax.fori_loop(0, blocks_used, body, init)
    out = acc / jnp.maximum(jnp.moveaxis(l, 3, 1), 1e-30)[..., None]
    return out.reshape(B, T, Hq, D).astype(q.dtype)
