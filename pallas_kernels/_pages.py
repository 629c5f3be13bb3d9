"""Page bookkeeping shared by the decode backends: which logical pages a head reads and how many of
their slots are valid, the clean-up of a selection, and the merge of sequence-split partial results.

All of it is small XLA work on `[B, H, K]`-sized index arrays; the kernels consume its results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def used_pages(lengths, page_size: int):
    """Pages holding at least one valid slot: ceil(lengths / page_size). Same shape as `lengths`."""
    return (lengths + page_size - 1) // page_size


def current_page(lengths, page_size: int):
    """Logical page of the newest slot, (lengths - 1) // page_size (lengths >= 1 at decode)."""
    return (jnp.maximum(lengths, 1) - 1) // page_size


def lengths_per_sel_head(lengths, num_sel_heads: int):
    """`lengths int32[B, KVH]` repeated to one entry per selection row: [B, Hsel] (Hsel = KVH or Hq)."""
    num_kv_heads = lengths.shape[1]
    return jnp.repeat(lengths, num_sel_heads // num_kv_heads, axis=1)


def table_per_sel_head(page_table, num_sel_heads: int):
    """`page_table int32[B, KVH, P]` repeated to one table per selection row: [B, Hsel, P]."""
    num_kv_heads = page_table.shape[1]
    return jnp.repeat(page_table, num_sel_heads // num_kv_heads, axis=1)


def normalize_selection(selected, lengths, page_size: int):
    """Clean a selection so each listed page is read exactly once.

    selected: int32[B, Hsel, K] logical pages (-1 = none); lengths: int32[B, KVH].
    Returns int32[B, Hsel, K]: per row the distinct valid pages in ascending order, then -1s. Entries
    outside [0, used pages), entries equal to the current page (always read separately) and repeats
    become -1.
    """
    lengths_sel = lengths_per_sel_head(lengths, selected.shape[1])[..., None]  # [B, Hsel, 1]
    in_range = (selected >= 0) & (selected < used_pages(lengths_sel, page_size))
    keep = in_range & (selected != current_page(lengths_sel, page_size))
    none = jnp.iinfo(jnp.int32).max  # sorts after every page
    ordered = jnp.sort(jnp.where(keep, selected, none), axis=-1)
    repeated = jnp.concatenate(
        [jnp.zeros_like(ordered[..., :1], dtype=bool), ordered[..., 1:] == ordered[..., :-1]], axis=-1
    )
    # a second sort moves the repeats behind the distinct pages
    distinct = jnp.sort(jnp.where(repeated, none, ordered), axis=-1)
    return jnp.where(distinct == none, -1, distinct)


def sparse_read_list(selected, lengths, page_size: int):
    """Logical pages a sparse decode reads, and their valid slot counts.

    selected: int32[B, Hsel, K], already `normalize_selection`-ed; lengths: int32[B, KVH].
    Returns (logical int32[B, Hsel, K+1], counts int32[B, Hsel, K+1]): the current page first, then the
    K selected entries, so the entries with slots form a prefix of each row. The current page holds
    length - current*page_size valid slots, a selected page is full (page_size), a -1 entry has count 0
    and logical page 0 (never read).
    """
    lengths_sel = lengths_per_sel_head(lengths, selected.shape[1])  # [B, Hsel]
    current = current_page(lengths_sel, page_size)  # [B, Hsel]
    logical = jnp.concatenate([current[..., None], selected], axis=-1)
    counts = jnp.concatenate(
        [(lengths_sel - current * page_size)[..., None], jnp.where(selected >= 0, page_size, 0)], axis=-1
    ).astype(jnp.int32)
    return jnp.maximum(logical, 0), counts


def dense_read_list(lengths, max_pages: int, page_size: int):
    """Every used page, in the read-list order of `sparse_read_list`: the current page, then the full
    pages 0 .. current-1, then entries with nothing to read.

    lengths: int32[B, KVH]. Returns (logical int32[B, KVH, P], counts int32[B, KVH, P]).
    """
    current = current_page(lengths, page_size)[..., None]  # [B, KVH, 1]
    full = jnp.arange(max_pages - 1, dtype=jnp.int32)  # [P-1]
    logical = jnp.concatenate([current, jnp.broadcast_to(full, lengths.shape + (max_pages - 1,))], axis=-1)
    counts = jnp.concatenate(
        [lengths[..., None] - current * page_size, jnp.where(full < current, page_size, 0)], axis=-1
    )
    return logical, counts.astype(jnp.int32)


def physical_pages(page_table, logical, num_pages: int):
    """Physical page of each logical entry, clamped into [0, num_pages) so a gather never leaves the pool.

    page_table: int32[B, KVH, P]; logical: int32[B, Hsel, E] with Hsel a multiple of KVH.
    Returns int32[B, Hsel, E]. Entries whose page is unallocated (-1) clamp to 0; callers mask them.
    """
    table = table_per_sel_head(page_table, logical.shape[1])
    logical = jnp.clip(logical, 0, page_table.shape[2] - 1)
    return jnp.clip(jnp.take_along_axis(table, logical, axis=-1), 0, num_pages - 1)


def merge_partials(acc, row_max, row_sum):
    """Merge flash-decoding partials computed over disjoint slot sets.

    acc: f32[S, ..., D] unnormalised sums of p*v; row_max, row_sum: f32[S, ...] (row_max -inf and
    row_sum 0 for a split that read nothing). Returns (out f32[..., D], row_max f32[...], row_sum f32[...])
    with out normalised.
    """
    merged_max = jnp.max(row_max, axis=0)
    weight = jnp.exp(row_max - merged_max)  # 0 for empty splits
    weight = jnp.where(row_max == -jnp.inf, 0.0, weight)
    merged_sum = jnp.sum(weight * row_sum, axis=0)
    merged_acc = jnp.sum(weight[..., None] * acc, axis=0)
    return merged_acc / merged_sum[..., None], merged_max, merged_sum


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_axis(x: jax.Array, size: int, axis: int, value) -> jax.Array:
    """Pad `x` along `axis` with `value` up to `size` entries."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)
