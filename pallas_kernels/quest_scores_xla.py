"""Quest's page scores on the XLA path (every platform's fallback, CPU's fast path) and the reference they
and the kernels are tested against; `quest_scores` dispatches."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _pages
from ._validation import check_page_size, check_score_inputs


def scoreable_pages(lengths, max_pages: int, page_size: int):
    """bool[B, KVH, P]: pages that hold slots and are not the current page."""
    logical = jnp.arange(max_pages)
    used = _pages.used_pages(lengths, page_size)[..., None]
    current = _pages.current_page(lengths, page_size)[..., None]
    return (logical < used) & (logical != current)


def finish_scores(scores, per_kv_head: bool):
    """[B, KVH, G, P] -> [B, KVH, P] (max over the group) or [B, Hq, P]."""
    if per_kv_head:
        return jnp.max(scores, axis=2)
    batch, num_kv_heads, group, max_pages = scores.shape
    return scores.reshape(batch, num_kv_heads * group, max_pages)


def quest_page_scores_reference(
    q,  # [B, Hq, D]
    kmin,  # [N, D]
    kmax,  # [N, D]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    *,
    page_size: int,
    per_kv_head: bool = False,
):
    """Oracle for `quest_page_scores`: the max form over every logical page, then masked."""
    dims = check_score_inputs(q, kmin, kmax, page_table, lengths)
    check_page_size(page_size, strict=False)
    pages = jnp.clip(page_table, 0, dims.num_pages - 1)
    page_min = kmin[pages].astype(jnp.float32)[:, :, None]  # [B, KVH, 1, P, D]
    page_max = kmax[pages].astype(jnp.float32)[:, :, None]
    q_groups = q.astype(jnp.float32).reshape(dims.batch, dims.num_kv_heads, dims.group_size, 1, dims.head_dim)
    scores = jnp.sum(jnp.maximum(q_groups * page_min, q_groups * page_max), axis=-1)  # [B, KVH, G, P]
    valid = scoreable_pages(lengths, dims.max_pages, page_size)[:, :, None]
    return finish_scores(jnp.where(valid, scores, -jnp.inf), per_kv_head)


def quest_page_scores_xla(q, kmin, kmax, page_table, lengths, *, page_size: int, dims, pages_per_block=None):
    """CPU path: kmin/kmax rows gathered a block of pages at a time in a scan, each block scored with two
    products; gathering every page at once ran ~8x slower on CPU. Returns f32[B, KVH, G, P]."""
    rows, group, max_pages, head_dim = dims.batch * dims.num_kv_heads, dims.group_size, dims.max_pages, dims.head_dim
    if pages_per_block is None:  # ~2 MiB of kmin + kmax per step
        pages_per_block = max(16, min(1024, (2 << 20) // (rows * head_dim * 8)))
    pages_per_block = min(pages_per_block, max_pages)
    num_blocks = _pages.cdiv(max_pages, pages_per_block)
    pages = jnp.clip(page_table, 0, dims.num_pages - 1).reshape(rows, max_pages)
    pages = _pages.pad_axis(pages, num_blocks * pages_per_block, axis=1, value=0)
    page_blocks = jnp.swapaxes(pages.reshape(rows, num_blocks, pages_per_block), 0, 1)  # [nblk, R, nb]
    q_rows = q.astype(jnp.float32).reshape(rows, group, head_dim)
    q_pos, q_neg = jnp.maximum(q_rows, 0.0), jnp.minimum(q_rows, 0.0)

    def score_block(carry, block_pages):
        page_max = kmax.at[block_pages].get(mode="promise_in_bounds").astype(jnp.float32)  # [R, nb, D]
        page_min = kmin.at[block_pages].get(mode="promise_in_bounds").astype(jnp.float32)
        scores = jnp.einsum("rgd,rpd->rgp", q_pos, page_max) + jnp.einsum("rgd,rpd->rgp", q_neg, page_min)
        return carry, scores

    _, scores = lax.scan(score_block, None, page_blocks)  # [nblk, R, G, nb]
    scores = jnp.moveaxis(scores, 0, 2).reshape(rows, group, -1)[..., :max_pages]
    scores = scores.reshape(dims.batch, dims.num_kv_heads, group, max_pages)
    valid = scoreable_pages(lengths, max_pages, page_size)[:, :, None]
    return jnp.where(valid, scores, -jnp.inf)
