"""Attention formulations in plain jnp: dense causal (no cache) and paged (a chunk of queries over a layer's
pages). Softmax runs in float32. Query head h reads kv head h // G (HF's repeat_kv). A `layer` argument may
be a traced int32 scalar (the steps scan over layers); the pages it reads stay static (`KVState.read_pages`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.state import KVState, gather_layer

MASKED = -1e30  # finite, so fully masked rows (padding queries) stay NaN-free


def visible_keys(key_positions: jax.Array, query_positions: jax.Array, window=0) -> jax.Array:
    """Causal visibility, broadcast: a query at p sees keys at positions <= p, and with a sliding `window`
    w > 0 (an int or a traced int32 scalar; 0 = none) only those after p - w (HF's Mistral / Gemma-2 mask:
    p - w + 1 .. p). Positions of empty slots (-1) must be masked by the caller's validity."""
    causal = key_positions <= query_positions
    return causal & ((window == 0) | (key_positions > query_positions - window))


def grouped_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """`q [B, T, Hq, D]` -> `[B, T, H, G, D]`: query head h*G + g reads kv head h (HF's repeat_kv order)."""
    B, T, Hq, D = q.shape
    return q.reshape(B, T, num_kv_heads, Hq // num_kv_heads, D)



def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None, block: int = 256, window=0
) -> jax.Array:
    """q `[B, T, Hq, D]`, k/v `[B, T, H, D]` -> `[B, T, Hq, D]`, causal over T (within a sliding `window`
    when it is > 0, `visible_keys`).

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
        causal = visible_keys(jnp.arange(end)[None, :], jnp.arange(start, end)[:, None], window)
        probs = jax.nn.softmax(jnp.where(causal, scores * scale, MASKED), axis=-1)
        outs.append(jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v_rep[:, :end]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float | None = None,
    return_probs: bool = False,
):
    """The masked-attention reference every cache layout reduces to: queries `q [B, T, Hq, D]` over keys and
    values `k, v [B, H, S, D]` (kv-head major) where `visible` (bool, broadcastable to `[B, H, G, T, S]`).
    Query head h*G + g reads kv head h. Scores and softmax in float32; a row that sees nothing is uniform
    over masked scores (finite, no NaN). Returns `[B, T, Hq, D]`, and with `return_probs` also the
    probabilities `f32[B, H, G, T, S]` (0 where not visible). `paged_attention` (the KV state) and CacheClip's
    recomputation (`kvjax.rag.selective`) call it."""
    B, T, Hq, D = q.shape
    H = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    qg = grouped_queries(q, H)
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(visible, scores, MASKED), axis=-1)
    out = jnp.einsum("bhgts,bhsd->bthgd", probs.astype(q.dtype), v.astype(q.dtype)).reshape(B, T, Hq, D)
    return (out, jnp.where(visible, probs, 0.0)) if return_probs else out


def attention_max(
    q: jax.Array, q_positions: jax.Array, q_real: jax.Array, k: jax.Array, key_pos: jax.Array, key_ok: jax.Array,
    probs: bool, block: int = 64,
) -> jax.Array:
    """f32[B, H, S]: for each key, the largest value any real query of its kv head's group gives it: the
    scaled logit `q . k / sqrt(D)` (`probs=False`, Locret's label) or the softmax probability over the keys
    the query sees (`probs=True`, KVzip's score). Queries `q [B, T, Hq, D]` at `q_positions int32[B, T]`,
    `q_real bool[B, T]`; keys `k [B, H, S, D]` at `key_pos int32[B, H, S]`, of which a query sees those
    with `key_ok bool[B, H, S]` and a position not after its own. Entries of keys that are not ok are 0.
    Queries go `block` at a time with a running max: the largest tensor is `[B, H, G, block, S]`."""
    B, T, Hq, D = q.shape
    H = k.shape[1]
    a = min(block, T)
    blocks = -(-T // a)
    pad = blocks * a - T
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    real = jnp.pad(q_real, ((0, 0), (0, pad)))
    qpos = jnp.pad(q_positions, ((0, 0), (0, pad)))
    qb = jnp.moveaxis(q.reshape(B, blocks, a, H, Hq // H, D), 1, 0)  # [blocks, B, a, H, G, D]
    rb, pb = (jnp.moveaxis(x.reshape(B, blocks, a), 1, 0) for x in (real, qpos))  # [blocks, B, a]
    k = k.astype(q.dtype)

    def body(best, xs):
        qg, r, p = xs
        s = jnp.einsum("bahgd,bhsd->bhgas", qg, k, preferred_element_type=jnp.float32) * D**-0.5
        seen = key_ok[:, :, None, None, :] & visible_keys(key_pos[:, :, None, None, :], p[:, None, None, :, None])
        s = jnp.where(seen, s, MASKED)
        if probs:
            s = jnp.where(seen, jax.nn.softmax(s, axis=-1), 0.0)
        s = jnp.where(r[:, None, None, :, None], s, MASKED)
        return jnp.maximum(best, s.max(axis=(2, 3))), None

    best, _ = jax.lax.scan(body, jnp.full(k.shape[:3], MASKED, jnp.float32), (qb, rb, pb))
    return jnp.where(key_ok, best, 0.0)


def paged_attention(
    q: jax.Array, q_positions: jax.Array, state: KVState, layer, scale: float | None = None,
    return_probs: bool = False, window=0, q_slots: jax.Array | None = None,
):
    """Queries `q [B, T, Hq, D]` at `q_positions int32[B, T]` over every valid slot of `layer` whose original
    position is not after the query's (so a chunk is causal within itself) and, with a `window`, inside it.
    With `q_slots int32[B, T]` (the queries' own logical slots) a query sees the slots at or before its slot
    instead: an assembled RAG context, whose slot order is its causal order even where chunks share
    positions (parallel encoding). Returns `[B, T, Hq, D]`, and with `return_probs` also the probabilities
    `f32[B, H, G, T, S]` in `gather_layer`'s slot order."""
    if not return_probs:  # the blocked form (plain batched matmuls, no [.., T, S] tensor) prefill uses
        return blocked_paged_attention(q, q_positions, state, layer, scale=scale, window=window, q_slots=q_slots)
    k, v, slot_pos, valid = gather_layer(state, layer)  # [B, H, S, D], [B, H, S]
    if q_slots is None:
        seen = visible_keys(slot_pos[:, :, None, None, :], q_positions[:, None, None, :, None], window)
    else:
        seen = jnp.arange(k.shape[2])[None, None, None, None, :] <= q_slots[:, None, None, :, None]
    visible = valid[:, :, None, None, :] & seen
    return masked_attention(q, k, v, visible, scale, return_probs)


def _layer_table(state: KVState, layer):
    return state.page_table[layer, :, :, : state.layer_read_pages(layer)], state.lengths[layer]


def decode_attention(q: jax.Array, state: KVState, layer, selected=None, return_stats: bool = False,
                     slots: bool = False):
    """One decode query per head `q [B, 1, Hq, D]` over `layer` through the backend-dispatched paged decode
    kernels (pallas_kernels): every valid slot, or with `selected int32[B, Hq or H, K]` the selected logical
    pages plus each head's current page (Quest). Returns `[B, 1, Hq, D]`, and with `return_stats` also the
    row max and row sum `f32[B, Hq]` of the scaled logits (p = exp(q.k / sqrt(D) - max) / sum). With `slots`,
    `selected` lists slots instead of pages: the pool is read as pages of one slot (`slot_pages`), and the
    newest slot is the one always read."""
    from kvjax import pallas_kernels

    table, lengths = _layer_table(state, layer)
    scales = dict(k_scale=state.k_scale, v_scale=state.v_scale)
    if slots:
        state, table, scales = slot_pages(state, table)
    if selected is None:
        result = pallas_kernels.paged_decode(
            q[:, 0], state.k_pages, state.v_pages, table, lengths, return_stats=return_stats, **scales
        )
    else:
        result = pallas_kernels.sparse_paged_decode(
            q[:, 0], state.k_pages, state.v_pages, table, selected, lengths, return_stats=return_stats, **scales
        )
    if return_stats:
        out, row_max, row_sum = result
        return out[:, None], row_max, row_sum
    return result[:, None]


def slot_table(table: jax.Array, page_size: int) -> jax.Array:
    """int32[B, H, P * ps]: the slots of `table int32[B, H, P]`'s pages as pages of one slot (-1 unallocated)."""
    rows = jnp.where(table[..., None] >= 0, table[..., None] * page_size + jnp.arange(page_size), -1)
    return rows.reshape(*table.shape[:2], -1)


def slot_pages(state: KVState, table: jax.Array):
    """The pool as pages of one slot: `(state, table int32[B, H, P * ps], scales)` with `k_pages`/`v_pages`
    `[N * ps, 1, D]` (a free reshape) and the table listing each page's slots, so the paged kernels read any
    set of single slots (`decode_attention(slots=True)`)."""
    N, ps = state.k_pages.shape[:2]
    rows = slot_table(table, ps)
    per_slot = lambda x: None if x is None else x.reshape(N * ps, 1, *x.shape[2:])
    state = state.replace(k_pages=per_slot(state.k_pages), v_pages=per_slot(state.v_pages))
    return state, rows, dict(k_scale=per_slot(state.k_scale), v_scale=per_slot(state.v_scale))


def read_slots(selected: jax.Array, lengths: jax.Array, page_size: int, max_pages: int) -> jax.Array:
    """bool[B, H, G, S]: the slots (S = max_pages * page_size) a sparse decode reads per query head, for a
    selection `int32[B, Hq or H, K]` (-1 = none) of logical pages of kv heads with `lengths int32[B, H]`: the
    selected pages and the current page, below the length as `sparse_decode_attention` reads them."""
    B, rows, _ = selected.shape
    H = lengths.shape[1]
    listed = jnp.zeros((B, rows, max_pages + 1), bool)
    listed = listed.at[jnp.arange(B)[:, None, None], jnp.arange(rows)[None, :, None],
                       jnp.where(selected >= 0, selected, max_pages)].set(True)[..., :max_pages]
    listed = listed.reshape(B, H, rows // H, max_pages)  # [B, H, 1 or G, P]
    current = ((jnp.maximum(lengths, 1) - 1) // page_size)[:, :, None, None] == jnp.arange(max_pages)
    slot = jnp.arange(max_pages * page_size)
    below = (slot < lengths[:, :, None])[:, :, None, :]
    return jnp.repeat(listed | current, page_size, axis=-1) & below


def _blocks(state: KVState, layer, block_pages: int):
    """The layer's page table cut into blocks of `block_pages` logical pages, and `gather(i)` giving block
    i's keys, values `[B, H, bs, D]`, positions `int32[B, H, bs]` and validity `bool[B, H, bs]` (bs = block
    slots). Returns (gather, block slots, number of blocks, blocks in use: a traced count)."""
    ps, N = state.page_size, state.num_pages
    table = state.page_table[layer, :, :, : state.layer_read_pages(layer)]
    B, H, P = table.shape
    D = state.k_pages.shape[-1]
    block_pages = max(1, min(block_pages, P))
    num_blocks = -(-P // block_pages)
    table = jnp.pad(table, ((0, 0), (0, 0), (0, num_blocks * block_pages - P)), constant_values=-1)
    lengths = state.lengths[layer]  # [B, H]
    block_slots = block_pages * ps

    def gather(i):
        pages = jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, axis=2)  # [B, H, bp]
        safe = jnp.clip(pages, 0, N - 1)
        k = state.read_k(safe).reshape(B, H, block_slots, D)
        v = state.read_v(safe).reshape(B, H, block_slots, D)
        pos = state.slot_pos[safe].reshape(B, H, block_slots)
        slot = i * block_slots + jnp.arange(block_slots)
        valid = (slot[None, None, :] < lengths[:, :, None]) & (pos >= 0) & jnp.repeat(pages >= 0, ps, axis=-1)
        return k, v, pos, valid

    blocks_used = (jnp.max(lengths) + block_slots - 1) // block_slots
    return gather, block_slots, num_blocks, blocks_used


def _query_rows(q: jax.Array, num_kv_heads: int, scale: float) -> jax.Array:
    """`q [B, T, Hq, D]` scaled, as `[B, H, G*T, D]` (group-major rows per kv head)."""
    B, T, Hq, D = q.shape
    qg = (grouped_queries(q, num_kv_heads) * scale).astype(q.dtype)  # [B, T, H, G, D]
    return jnp.moveaxis(qg, 1, 3).reshape(B, num_kv_heads, (Hq // num_kv_heads) * T, D)


def _visible_rows(valid: jax.Array, pos: jax.Array, q_positions: jax.Array, group: int, window=0,
                  slots: jax.Array | None = None, q_slots: jax.Array | None = None) -> jax.Array:
    """bool[B, H, G*T, S]: slots (`valid`, `pos [B, H, S]`) each query row (positions `[B, T]`) may see; with
    `q_slots int32[B, T]`, those at or before the query's own slot (`slots int32[S]`: the block's slots)."""
    if q_slots is None:
        seen = visible_keys(pos[:, :, None, :], q_positions[:, None, :, None], window)
    else:
        seen = slots[None, None, None, :] <= q_slots[:, None, :, None]
    visible = valid[:, :, None, :] & seen  # [B, H, T, S]
    return jnp.tile(visible, (1, 1, group, 1))


def blocked_paged_attention(
    q: jax.Array, q_positions: jax.Array, state: KVState, layer, block_pages: int = 32,
    scale: float | None = None, return_stats: bool = False, window=0, q_slots: jax.Array | None = None,
):
    """`paged_attention` for a chunk of queries (within a sliding `window` when > 0; with `q_slots`, each
    query over the slots at or before its own, as there), computed block by block with an online softmax.

    The loop visits only blocks of `block_pages` logical pages below the longest head's length (a dynamic
    trip count), so a prefill chunk costs what has been written so far rather than the whole capacity,
    and no `[.., T, S]` score tensor over the capacity is ever materialised. Returns `[B, T, Hq, D]`, and
    with `return_stats` also each query row's max and sum `f32[B, H, G, T]` of the scaled logits.
    """
    B, T, Hq, D = q.shape
    H = state.page_table.shape[2]
    G = Hq // H
    gather, block_slots, _, blocks_used = _blocks(state, layer, block_pages)
    scale = D**-0.5 if scale is None else scale
    # Queries as one [G*T, D] matrix per (sequence, kv head), so each block is two plain batched matmuls:
    # the grouped "bthgd,bhsd->bhgts" form ran 3x slower on XLA's CPU dot (30 vs 90 ms, 512 queries over
    # 2K slots of SmolLM2's heads).
    qh = _query_rows(q, H, scale)  # [B, H, GT, D]

    def body(i, carry):
        m, l, acc = carry  # [B, H, GT], [B, H, GT], [B, H, GT, D]
        k, v, pos, valid = gather(i)
        slots = i * block_slots + jnp.arange(block_slots)
        visible = _visible_rows(valid, pos, q_positions, G, window, slots, q_slots)  # [B, H, GT, S]
        s = jnp.einsum("bhqd,bhsd->bhqs", qh, k.astype(q.dtype), preferred_element_type=jnp.float32)
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None]) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        pv = jnp.einsum("bhqs,bhsd->bhqd", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[..., None] + pv

    init = (
        jnp.full((B, H, G * T), MASKED, jnp.float32),
        jnp.zeros((B, H, G * T), jnp.float32),
        jnp.zeros((B, H, G * T, D), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, blocks_used, body, init)
    out = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(B, H, G, T, D)
    out = jnp.moveaxis(out, 3, 1).reshape(B, T, Hq, D).astype(q.dtype)
    m, l = m.reshape(B, H, G, T), l.reshape(B, H, G, T)
    return (out, m, l) if return_stats else out


def attention_column_sums(
    q: jax.Array, q_positions: jax.Array, state: KVState, layer, row_max: jax.Array, row_sum: jax.Array,
    rows: jax.Array, block_pages: int = 32, scale: float | None = None,
) -> jax.Array:
    """f32[B, H, S]: the attention each slot of `layer` receives from the chunk's queries `q [B, T, Hq, D]`
    (at `q_positions int32[B, T]`), summed over the rows where `rows bool[B, T]` and over each kv head's
    query group, in `gather_layer`'s slot order (S = read pages * page_size). The probabilities are rebuilt
    block by block from the row statistics `blocked_paged_attention` returned, exp(s - row_max) / row_sum:
    one more pass over the keys, never a `[.., T, S]` tensor (H2O's accumulated attention)."""
    B, T, Hq, D = q.shape
    H = state.page_table.shape[2]
    gather, block_slots, num_blocks, blocks_used = _blocks(state, layer, block_pages)
    scale = D**-0.5 if scale is None else scale
    G = Hq // H
    qh = _query_rows(q, H, scale)  # [B, H, GT, D]
    row_max = row_max.reshape(B, H, G * T)
    weight = jnp.where(rows[:, None, None, :], 1.0 / jnp.maximum(row_sum, 1e-30), 0.0).reshape(B, H, G * T, 1)

    def body(i, sums):
        k, _, pos, valid = gather(i)
        visible = _visible_rows(valid, pos, q_positions, G)  # [B, H, GT, S]
        s = jnp.einsum("bhqd,bhsd->bhqs", qh, k.astype(q.dtype), preferred_element_type=jnp.float32)
        p = jnp.where(visible, jnp.exp(jnp.minimum(s - row_max[..., None], 0.0)) * weight, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(sums, p.sum(axis=2), i * block_slots, axis=2)

    sums = jax.lax.fori_loop(0, blocks_used, body, jnp.zeros((B, H, num_blocks * block_slots), jnp.float32))
    return sums[..., : state.layer_read_pages(layer) * state.page_size]
