"""Paged decode attention in plain XLA, tuned for CPU.

Notes: docs/modules.md (`pallas_kernels/decode_xla.py`)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from . import _pages
from ._quant import page_values

# How one block of gathered pages is folded into the softmax state:
#   mulsum : logits and p.v as broadcast-multiply + reduce (XLA maps them to its CPU library fusions)
#   einsum : logits and p.v as einsum (dot_general; a batched matmul over the group when Gq > 1)
#   mulsum_barrier : the gathered block materialised first (optimization_barrier), then mulsum
#   auto : einsum (fastest measured, flattened, for rows of one query head and of a group alike)
FORMULATIONS = ("auto", "mulsum", "einsum", "mulsum_barrier")
DEFAULT_FORMULATION = "auto"
# K bytes gathered per loop step over all rows, measured best on CPU: 4 MiB for rows of one query head
# (mulsum and einsum alike), 2 MiB for grouped einsum rows; 8 MiB and more fell out of cache
_BLOCK_BYTES = {"mulsum": 4 << 20, "mulsum_barrier": 4 << 20, "einsum": 4 << 20, "einsum_grouped": 2 << 20}
# Below this much K per call the rows are one group (small calls gain nothing from more and compile more)
_ROW_GROUP_MIN_BYTES = 8 << 20


def default_pages_per_block(num_rows: int, page_size: int, head_dim: int, formulation: str = "einsum",
                            grouped: bool = False) -> int:
    """Pages per row per loop step: `_BLOCK_BYTES` of f32 K over all rows, between 1 and 64 pages."""
    page_bytes = page_size * head_dim * 4
    key = "einsum_grouped" if grouped and formulation == "einsum" else formulation
    return int(max(1, min(64, _BLOCK_BYTES[key] // max(1, num_rows * page_bytes))))


def default_row_groups(num_rows: int, row_bytes: int) -> int:
    """Groups the rows are cut into: one per core this process may run on (at most 4 and at most the
    rows) when the call reads at least `_ROW_GROUP_MIN_BYTES` of K, else 1. Grouped rows fold every group's
    next block in one loop, as operations of their own that XLA:CPU may run side by side; rows of one query
    head take a loop per group (docs/kernels.md, "Row groups"). `row_bytes`: K bytes of one row's read list.
    1 off the CPU (a GPU or TPU runs this path only as a fallback)."""
    if num_rows * row_bytes < _ROW_GROUP_MIN_BYTES or jax.default_backend() != "cpu":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 4, num_rows))


def _logits(q, k, formulation):
    """q [R, Gq, D] (or [R, D] when Gq == 1), k [R, ..., ps, D] -> [R, Gq, ..., ps] (or [R, ..., ps])."""
    if q.ndim == 2:
        extra = (None,) * (k.ndim - 2)
        if formulation == "einsum":  # flattened: a matrix-vector product per row
            flat = jnp.einsum("rd,rtd->rt", q, k.reshape(k.shape[0], -1, k.shape[-1]))
            return flat.reshape(k.shape[:-1])
        return jnp.sum(k * q[(slice(None), *extra, slice(None))], axis=-1)
    if formulation == "einsum":
        flat = jnp.einsum("rgd,rtd->rgt", q, k.reshape(k.shape[0], -1, k.shape[-1]))
        return flat.reshape(q.shape[:2] + k.shape[1:-1])
    extra = (None,) * (k.ndim - 2)
    return jnp.sum(k[:, None] * q[(slice(None), slice(None), *extra, slice(None))], axis=-1)


def _weighted_values(probs, v, formulation):
    """probs [R, (Gq,) ..., ps], v [R, ..., ps, D] -> sum over pages and slots: [R, (Gq,) D]."""
    grouped = probs.ndim == v.ndim  # probs carries a query axis
    summed = tuple(range(-1 - (v.ndim - 2), -1))  # the page/slot axes of the product
    if formulation == "einsum":
        if grouped:
            flat_probs = probs.reshape(probs.shape[:2] + (-1,))  # [R, Gq, T]
            return jnp.einsum("rgt,rtd->rgd", flat_probs, v.reshape(v.shape[0], -1, v.shape[-1]))
        return jnp.einsum("rt,rtd->rd", probs.reshape(probs.shape[0], -1), v.reshape(v.shape[0], -1, v.shape[-1]))
    product = probs[..., None] * (v[:, None] if grouped else v)
    return jnp.sum(product, axis=summed)


def attend_read_list_xla(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    physical,  # int32[B, Hsel, E]  physical page of each entry
    counts,  # int32[B, Hsel, E]  valid slots per entry; entry 0 is the current page, full pages follow,
    #                             entries with nothing to read (count 0) come last
    *,
    sm_scale: float,
    pages_per_block: int | None = None,
    formulation: str = DEFAULT_FORMULATION,
    k_scale=None,  # f32[N, ps] with int8 pages (pallas_kernels._quant), else None
    v_scale=None,
    row_groups: int | None = None,
):
    """Online-softmax attention of each query head over its row's listed pages.

    Row (b, hs) of the read list serves query heads hs*Gq .. hs*Gq+Gq-1 (Gq = Hq // Hsel). int8 pages are
    read as int8 and their per-slot scales applied to the logits and the probabilities. `row_groups`: the
    rows are cut into this many groups (None: `default_row_groups`), grouped rows' groups folded in one loop,
    each as operations of its own, rows of one query head in a loop per group.
    Returns (out f32[B, Hq, D], row_max f32[B, Hq], row_sum f32[B, Hq]) over logits scaled by sm_scale.
    """
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    batch, num_q_heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    num_sel_heads, num_entries = physical.shape[1:]
    rows, q_per_row = batch * num_sel_heads, num_q_heads // num_sel_heads
    if formulation == "auto":
        formulation = "einsum"
    physical = physical.reshape(rows, num_entries)
    counts = counts.reshape(rows, num_entries)
    # Scale folded into q: one multiply per query element instead of one per logit.
    q_rows = (q.astype(jnp.float32) * sm_scale).reshape(rows, q_per_row, head_dim)
    if q_per_row == 1:
        q_rows = q_rows[:, 0]  # [R, D]: no size-1 axis (see the module docstring)
    if row_groups is None:
        row_groups = default_row_groups(rows, num_entries * page_size * head_dim * k_pages.dtype.itemsize)
    if row_groups < 1:
        raise ValueError(f"row_groups must be >= 1, got {row_groups}")
    num_groups = min(row_groups, rows)
    bounds = [rows * g // num_groups for g in range(num_groups + 1)]
    groups = [(q_rows[lo:hi], physical[lo:hi], counts[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    # Grouped rows: every group in one loop (separate loops ran one after another, docs/kernels.md "Row
    # groups"); rows of one query head: a loop per group, as measured fastest for them before that was known
    loops = [groups] if q_per_row > 1 else [[group] for group in groups]
    parts = []
    for loop_groups in loops:
        loop_rows = sum(group[0].shape[0] for group in loop_groups)
        block = pages_per_block or default_pages_per_block(loop_rows, page_size, head_dim, formulation,
                                                           grouped=q_per_row > 1)  # over the loop's rows
        parts += _attend_rows(loop_groups, k_pages, v_pages, k_scale=k_scale, v_scale=v_scale, pages_per_block=block,
                              formulation=formulation)
    acc, row_max, row_sum = (jnp.concatenate(part, axis=0) if len(parts) > 1 else part[0] for part in zip(*parts))
    return _finish(acc, row_max, row_sum, batch, num_q_heads, head_dim)


def _attend_rows(groups, k_pages, v_pages, *, k_scale, v_scale, pages_per_block, formulation):
    """The online softmax of `attend_read_list_xla` over groups of rows of its read list, in one loop whose
    every step folds the next block of each group as operations of its own (independent, so XLA:CPU may run
    the groups side by side).

    groups: (q_rows [R, D] (a row serves one query head) or [R, Gq, D], scaled; physical, counts int32[R, E])
    per group, every group with the same E and query layout.
    Returns per group (acc f32[R, (Gq,) D] unnormalised, row_max f32[R(, Gq)], row_sum f32[R(, Gq)]).
    """
    num_entries = groups[0][1].shape[1]
    page_size, head_dim = k_pages.shape[1:]
    q_per_row = 1 if groups[0][0].ndim == 2 else groups[0][0].shape[1]

    def gather(pool, pages):
        gathered = page_values(pool.at[pages].get(mode="promise_in_bounds"))  # pages are clamped into the pool
        if formulation == "mulsum_barrier":
            gathered = lax.optimization_barrier(gathered)
        return gathered.astype(jnp.float32)

    # int8 pages: the per-slot scales multiply the logits (K) and the probabilities (V) rather than every
    # value, one multiply per slot instead of one per element
    def slot_scale(scale, pages):  # [R, ..., ps], broadcast over the query axis of grouped rows, or 1
        if scale is None:
            return 1.0
        per_slot = scale.at[pages].get(mode="promise_in_bounds")
        return per_slot if q_per_row == 1 else per_slot[:, None]

    # 1. The current page (entry 0), masked slot by slot: the only page with slots past the length.
    def attend_current(q_rows, physical, counts):
        slot = jnp.arange(page_size, dtype=jnp.int32)
        current_valid = slot < counts[:, :1]  # [R, ps]
        k_current = gather(k_pages, physical[:, 0])  # [R, ps, D]
        v_current = jnp.where(current_valid[..., None], gather(v_pages, physical[:, 0]), 0.0)
        if q_per_row > 1:
            current_valid = current_valid[:, None]
        k_current_scale = slot_scale(k_scale, physical[:, 0])
        logits = jnp.where(current_valid, _logits(q_rows, k_current, formulation) * k_current_scale, -jnp.inf)
        row_max = jnp.max(logits, axis=-1)  # finite: the current page holds >= 1 slot
        probs = jnp.exp(logits - row_max[..., None])
        row_sum = jnp.sum(probs, axis=-1)
        if v_scale is not None:  # int8: scale the probabilities (a scale past the length may be NaN: masked)
            probs = probs * jnp.where(current_valid, slot_scale(v_scale, physical[:, 0]), 0.0)
        return _weighted_values(probs, v_current, formulation), row_max, row_sum

    states = [attend_current(*group) for group in groups]
    num_full = num_entries - 1
    if num_full == 0:
        return states

    # 2. Full pages in blocks. Entries with nothing to read point at the row's first full page (finite
    # values; their logits are masked), or, in rows with no full page at all, their contribution is
    # dropped as a whole.
    pages_per_block = max(1, min(pages_per_block, num_full))
    num_blocks = _pages.cdiv(num_full, pages_per_block)
    padded = num_blocks * pages_per_block

    def plan(physical, counts):  # the group's pages per block [nblk, R, nb], readable, rows with a full page
        rows = physical.shape[0]
        full_physical, full_counts = physical[:, 1:], counts[:, 1:]
        readable = full_counts > 0
        full_physical = jnp.where(readable, full_physical, full_physical[:, :1])
        full_physical = _pages.pad_axis(full_physical, padded, axis=1, value=0)
        full_physical = jnp.where(jnp.arange(padded) < num_full, full_physical, full_physical[:, :1])
        readable = _pages.pad_axis(readable, padded, axis=1, value=False)
        page_blocks = jnp.swapaxes(full_physical.reshape(rows, num_blocks, pages_per_block), 0, 1)
        readable_blocks = jnp.swapaxes(readable.reshape(rows, num_blocks, pages_per_block), 0, 1)
        has_full = full_counts[:, :1] > 0  # [R, 1]
        return page_blocks, readable_blocks, has_full if q_per_row == 1 else has_full[:, :, None]

    plans = [plan(physical, counts) for _, physical, counts in groups]
    # every group's blocks up to the last holding a page of any row (past a group's own last, its pages
    # are all unreadable: masked, and the block changes nothing)
    most_full = functools.reduce(jnp.maximum, [jnp.max(jnp.sum(counts[:, 1:] > 0, axis=1)) for _, _, counts in groups])
    active_blocks = _pages.cdiv(most_full, pages_per_block)

    def fold_block(block_index, q_rows, group_plan, state):
        acc, row_max, row_sum = state  # [R, (Gq,) D], [R(, Gq)], [R(, Gq)]
        page_blocks, readable_blocks, row_keep = group_plan
        block_pages = lax.dynamic_index_in_dim(page_blocks, block_index, keepdims=False)  # [R, nb]
        block_readable = lax.dynamic_index_in_dim(readable_blocks, block_index, keepdims=False)
        k = gather(k_pages, block_pages)  # [R, nb, ps, D]
        v = gather(v_pages, block_pages)
        page_mask = block_readable[:, :, None] if q_per_row == 1 else block_readable[:, None, :, None]
        logits = _logits(q_rows, k, formulation) * slot_scale(k_scale, block_pages)
        logits = jnp.where(page_mask, logits, -jnp.inf)  # [R, (Gq,) nb, ps]
        block_shape = logits.shape
        if q_per_row > 1:  # grouped rows' softmax over one slot axis [R, Gq, nb*ps]: over [Gq, nb, ps] XLA:CPU
            logits = logits.reshape(block_shape[:-2] + (-1,))  # ran the exp several times slower
        slot_axes = (-1,) if q_per_row > 1 else (-2, -1)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=slot_axes))  # finite: current page seen
        rescale = jnp.exp(row_max - new_max)
        probs = jnp.exp(logits - jnp.expand_dims(new_max, slot_axes))
        weighted = _weighted_values(probs.reshape(block_shape) * slot_scale(v_scale, block_pages), v, formulation)
        weighted = jnp.where(row_keep, weighted, 0.0)
        row_sum = row_sum * rescale + jnp.sum(probs, axis=slot_axes)
        return acc * rescale[..., None] + weighted, new_max, row_sum

    def fold_blocks(block_index, states):
        return tuple(fold_block(block_index, group[0], group_plan, state)
                     for group, group_plan, state in zip(groups, plans, states))

    return list(lax.fori_loop(0, active_blocks, fold_blocks, tuple(states)))


def _finish(acc, row_max, row_sum, batch, num_q_heads, head_dim):
    out = acc / row_sum[..., None]
    return (
        out.reshape(batch, num_q_heads, head_dim),
        row_max.reshape(batch, num_q_heads),
        row_sum.reshape(batch, num_q_heads),
    )
