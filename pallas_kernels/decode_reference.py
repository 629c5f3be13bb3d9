"""Pure-jnp oracles for paged decode attention: plain, unoptimised, read every logical page.

They define the semantics the kernels are tested against: a slot takes part when its page is selected (or
is the current page) and it lies below the head's length; a page counts once however often it is listed.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _pages
from ._quant import dequantize
from ._validation import check_decode_inputs, resolve_sm_scale


def _attend_masked(q, k_pages, v_pages, page_table, lengths, page_read, sm_scale, return_stats, k_scale, v_scale):
    """Attention of q over every logical slot of each kv head, restricted to `page_read`.

    q [B, Hq, D]; k_pages, v_pages [N, ps, D] (int8 with `k_scale`, `v_scale` f32[N, ps], else None);
    page_table int32[B, KVH, P]; lengths int32[B, KVH]; page_read bool[B, Hq, P]: which logical pages each
    query head reads.
    """
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    group = num_q_heads // num_kv_heads
    pages = jnp.clip(page_table, 0, num_pages - 1)  # [B, KVH, P]
    k_scale_read = None if k_scale is None else k_scale[pages]
    v_scale_read = None if v_scale is None else v_scale[pages]
    k = dequantize(k_pages[pages], k_scale_read).reshape(batch, num_kv_heads, max_pages * page_size, head_dim)
    v = dequantize(v_pages[pages], v_scale_read).reshape(batch, num_kv_heads, max_pages * page_size, head_dim)
    k = jnp.repeat(k, group, axis=1)  # [B, Hq, S, D]  query head hq reads kv head hq // G
    v = jnp.repeat(v, group, axis=1)
    slot = jnp.arange(max_pages * page_size)  # [S]
    slot_valid = slot[None, None, :] < jnp.repeat(lengths, group, axis=1)[..., None]  # [B, Hq, S]
    slot_read = jnp.repeat(page_read, page_size, axis=-1) & slot_valid  # [B, Hq, S]
    logits = jnp.einsum("bhd,bhsd->bhs", q.astype(jnp.float32), k) * sm_scale
    logits = jnp.where(slot_read, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1)  # [B, Hq]
    probs = jnp.exp(logits - row_max[..., None])
    row_sum = jnp.sum(probs, axis=-1)
    v = jnp.where(slot_read[..., None], v, 0.0)  # slots never read may hold NaN
    out = jnp.einsum("bhs,bhsd->bhd", probs, v) / row_sum[..., None]
    out = out.astype(q.dtype)
    if return_stats:
        return out, row_max, row_sum
    return out


def sparse_paged_decode_reference(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    page_table,  # int32[B, KVH, P]
    selected,  # int32[B, Hsel, K], Hsel in {Hq, KVH}; -1 = none
    lengths,  # int32[B, KVH], 1 <= lengths <= P * ps
    *,
    sm_scale=None,
    return_stats=False,
    k_scale=None,
    v_scale=None,
):
    """Oracle for `sparse_paged_decode`: same signature and result, computed with masks over all pages.

    Returns out [B, Hq, D] in q's dtype, and with `return_stats` also row max and row sum f32[B, Hq]
    of the scaled logits.
    """
    dims = check_decode_inputs(q, k_pages, v_pages, page_table, lengths, selected, k_scale=k_scale, v_scale=v_scale)
    sm_scale = resolve_sm_scale(sm_scale, dims.head_dim)
    page_size, max_pages = dims.page_size, dims.max_pages
    logical = jnp.arange(max_pages)
    # [B, Hsel, K, P] -> [B, Hsel, P]: which pages the selection lists
    listed = jnp.any(selected[..., None] == logical, axis=2)
    listed = jnp.repeat(listed, dims.q_per_sel_head, axis=1)  # [B, Hq, P]
    lengths_q = jnp.repeat(lengths, dims.group_size, axis=1)  # [B, Hq]
    is_current = logical == _pages.current_page(lengths_q, page_size)[..., None]
    page_read = listed | is_current
    return _attend_masked(q, k_pages, v_pages, page_table, lengths, page_read, sm_scale, return_stats, k_scale, v_scale)


def paged_decode_reference(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    *,
    sm_scale=None,
    return_stats=False,
    k_scale=None,
    v_scale=None,
):
    """Oracle for `paged_decode`: dense attention over every valid slot of each kv head."""
    dims = check_decode_inputs(q, k_pages, v_pages, page_table, lengths, k_scale=k_scale, v_scale=v_scale)
    sm_scale = resolve_sm_scale(sm_scale, dims.head_dim)
    page_read = jnp.ones((dims.batch, dims.num_q_heads, dims.max_pages), bool)
    return _attend_masked(q, k_pages, v_pages, page_table, lengths, page_read, sm_scale, return_stats, k_scale, v_scale)
