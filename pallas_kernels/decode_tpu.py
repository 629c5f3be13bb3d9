"""Paged decode attention as a Pallas Mosaic (TPU) kernel; runs on CPU under the TPU interpreter.

Notes: docs/modules.md (`pallas_kernels/decode_tpu.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _pages
from ._backend import any_memory_space, tpu_compiler_params

STATS_LANES = 128  # row max / row sum are stored broadcast over one lane tile


def _entry_page_and_count(
    entry,  # traced int32 scalar: entry index within the row
    *,
    batch_index,
    sel_head,
    kv_row,
    length,
    page_table_ref,
    selected_ref,
    dense: bool,
    page_size: int,
    max_pages: int,
    num_sel_heads: int,
    num_selected: int,
):
    """Physical page and valid slot count of one read-list entry, from the scalar-prefetched tables.

    Dense: entry e is logical page e. Sparse: entry 0 is the current page, entries 1..K the (normalised)
    selection, later entries are padding. Count 0 means: nothing to read.
    """
    current = (length - 1) // page_size
    if dense:
        logical = entry
        count = jnp.clip(length - entry * page_size, 0, page_size)
    else:
        sel_index = jnp.clip(entry - 1, 0, num_selected - 1)
        chosen = selected_ref[(batch_index * num_sel_heads + sel_head) * num_selected + sel_index]
        is_current = entry == 0
        is_selected = (entry >= 1) & (entry <= num_selected) & (chosen >= 0)
        logical = jnp.where(is_current, current, chosen)
        count = jnp.where(is_current, length - current * page_size, jnp.where(is_selected, page_size, 0))
    page = page_table_ref[kv_row * max_pages + jnp.clip(logical, 0, max_pages - 1)]
    return page, count


def _decode_kernel(
    *refs,
    dense: bool,
    page_size: int,
    max_pages: int,
    num_kv_heads: int,
    num_sel_heads: int,
    num_selected: int,
    pages_per_block: int,
    blocks_per_split: int,
    sm_scale: float,
    precision,
    quantized: bool,
):
    if dense:
        page_table_ref, lengths_ref = refs[:2]
        selected_ref = None
        refs = refs[2:]
    else:
        page_table_ref, lengths_ref, selected_ref = refs[:3]
        refs = refs[3:]
    if quantized:
        # int8 pages: per-slot scales f32[N, ps, 1] in HBM, copied beside their pages into [2, nb, ps, 1]
        k_scale_hbm, v_scale_hbm = refs[3:5]
        k_scale_buf, v_scale_buf = refs[-2:]
        refs = refs[:3] + refs[5:-2]
    (
        q_ref,  # [Gq, D]
        k_hbm,  # [N, ps, D] in HBM
        v_hbm,  # [N, ps, D] in HBM
        acc_out,  # [Gq, D] f32
        max_out,  # [Gq, STATS_LANES] f32
        sum_out,  # [Gq, STATS_LANES] f32
        k_buf,  # VMEM [2, nb, ps, D]
        v_buf,  # VMEM [2, nb, ps, D]
        sems,  # DMA semaphores [2 buffers, 2 (k, v)]
        max_scratch,  # VMEM [Gq, STATS_LANES] f32
        sum_scratch,  # VMEM [Gq, STATS_LANES] f32
        acc_scratch,  # VMEM [Gq, D] f32
    ) = refs
    batch_index, sel_head, split, block = (pl.program_id(i) for i in range(4))
    kv_head = sel_head // (num_sel_heads // num_kv_heads)
    kv_row = batch_index * num_kv_heads + kv_head
    length = lengths_ref[kv_row]
    entry_of = functools.partial(
        _entry_page_and_count,
        batch_index=batch_index,
        sel_head=sel_head,
        kv_row=kv_row,
        length=length,
        page_table_ref=page_table_ref,
        selected_ref=selected_ref,
        dense=dense,
        page_size=page_size,
        max_pages=max_pages,
        num_sel_heads=num_sel_heads,
        num_selected=num_selected,
    )

    def block_copies(block_in_split, buffer):
        """(count, k copy, v copy) for each page of one block of this row's split."""
        first_entry = (split * blocks_per_split + block_in_split) * pages_per_block
        copies = []
        for i in range(pages_per_block):
            page, count = entry_of(first_entry + i)
            page_copies = [
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[buffer, i], sems.at[buffer, 0]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[buffer, i], sems.at[buffer, 1]),
            ]
            if quantized:
                page_copies += [
                    pltpu.make_async_copy(k_scale_hbm.at[page], k_scale_buf.at[buffer, i], sems.at[buffer, 0]),
                    pltpu.make_async_copy(v_scale_hbm.at[page], v_scale_buf.at[buffer, i], sems.at[buffer, 1]),
                ]
            copies.append((count, page_copies))
        return copies

    def start(copies):
        for count, page_copies in copies:

            @pl.when(count > 0)
            def _():
                for copy in page_copies:
                    copy.start()

    buffer = block % 2

    @pl.when(block == 0)
    def _():
        max_scratch[...] = jnp.full(max_scratch.shape, -jnp.inf, jnp.float32)
        sum_scratch[...] = jnp.zeros(sum_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)
        start(block_copies(0, 0))

    @pl.when(block + 1 < blocks_per_split)
    def _():
        start(block_copies(block + 1, 1 - buffer))

    copies = block_copies(block, buffer)
    counts = [count for count, _ in copies]
    for count, page_copies in copies:

        @pl.when(count > 0)
        def _():
            for copy in page_copies:
                copy.wait()

    any_slot = functools.reduce(jnp.logical_or, [count > 0 for count in counts])

    @pl.when(any_slot)
    def _():
        block_slots = pages_per_block * page_size
        shift = page_size.bit_length() - 1  # page_size is a power of two
        q = q_ref[...].astype(jnp.float32)  # [Gq, D]
        k = k_buf[buffer].astype(jnp.float32)  # [nb, ps, D]
        v = v_buf[buffer].astype(jnp.float32)
        if quantized:  # dequantised in VMEM: each slot times its scale (broadcast along lanes)
            k = k * k_scale_buf[buffer]
            v = v * v_scale_buf[buffer]
        k = k.reshape(block_slots, q.shape[-1])  # [T, D]
        v = v.reshape(block_slots, q.shape[-1])
        logits = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        ) * sm_scale  # [Gq, T]

        def slot_valid(shape, axis):
            slot = lax.broadcasted_iota(jnp.int32, shape, axis)
            page_of_slot = jnp.right_shift(slot, shift)
            count_of_slot = jnp.zeros(shape, jnp.int32)
            for i, count in enumerate(counts):
                count_of_slot = jnp.where(page_of_slot == i, count, count_of_slot)
            return jnp.bitwise_and(slot, page_size - 1) < count_of_slot

        logits = jnp.where(slot_valid(logits.shape, 1), logits, -jnp.inf)
        v = jnp.where(slot_valid(v.shape, 0), v, 0.0)  # slots past the length may hold NaN
        prev_max = max_scratch[...]  # [Gq, L], equal along lanes
        block_max = jnp.max(logits, axis=1, keepdims=True)  # [Gq, 1], finite: a slot is valid
        new_max = jnp.maximum(prev_max, block_max)  # [Gq, L]
        rescale = jnp.exp(prev_max - new_max)
        probs = jnp.exp(logits - new_max[:, :1])  # [Gq, T]
        sum_scratch[...] = rescale * sum_scratch[...] + jnp.sum(probs, axis=1, keepdims=True)
        max_scratch[...] = new_max
        weighted = lax.dot_general(
            probs, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        )  # [Gq, D]
        acc_scratch[...] = rescale[:, :1] * acc_scratch[...] + weighted

    @pl.when(block == blocks_per_split - 1)
    def _():
        acc_out[...] = acc_scratch[...]
        max_out[...] = max_scratch[...]
        sum_out[...] = sum_scratch[...]


def decode_tpu(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    selected=None,  # int32[B, Hsel, K] normalised (pallas_kernels._pages.normalize_selection), or None = dense
    *,
    sm_scale: float,
    interpret,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    k_scale=None,  # f32[N, ps] with int8 pages, else None
    v_scale=None,
):
    """Run the Mosaic kernel; returns (out f32[B, Hq, D], row_max f32[B, Hq], row_sum f32[B, Hq])."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    dense = selected is None
    if dense:
        num_sel_heads, num_selected = num_kv_heads, 0
        num_entries = max_pages
    else:
        if selected.shape[2] == 0:  # only the current page: keep one (empty) column for SMEM
            selected = jnp.full(selected.shape[:2] + (1,), -1, jnp.int32)
        num_sel_heads, num_selected = selected.shape[1:]
        num_entries = num_selected + 1
    q_per_row = num_q_heads // num_sel_heads

    if pages_per_block is None:
        pages_per_block = 8 if num_entries >= 64 else 4
    pages_per_block = max(1, min(pages_per_block, num_entries))
    num_blocks = _pages.cdiv(num_entries, pages_per_block)
    if num_splits is None:
        # Split long rows so a few heads still fill both cores of a megacore chip.
        num_splits = max(1, min(8, num_blocks // 16)) if batch * num_sel_heads < 8 else 1
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = _pages.cdiv(num_blocks, num_splits)

    # [B, Hq, 1, D] with blocks (None, Gq, None, D): a [Gq, D] tile, as JAX's paged attention does when
    # Gq is not a multiple of 8.
    q4 = q.reshape(batch, num_q_heads, 1, head_dim)
    if q_per_row % 8:
        q4 = q4.astype(jnp.float32)
    q_spec = pl.BlockSpec((None, q_per_row, None, head_dim), lambda b, h, s, j, *_: (b, h, 0, 0))
    acc_spec = pl.BlockSpec((None, None, q_per_row, None, head_dim), lambda b, h, s, j, *_: (s, b, h, 0, 0))
    stats_spec = pl.BlockSpec((None, None, q_per_row, None, STATS_LANES), lambda b, h, s, j, *_: (s, b, h, 0, 0))
    out_shape = (
        jax.ShapeDtypeStruct((num_splits, batch, num_q_heads, 1, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, batch, num_q_heads, 1, STATS_LANES), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, batch, num_q_heads, 1, STATS_LANES), jnp.float32),
    )
    scalar_args = [page_table.reshape(-1), lengths.reshape(-1)]
    if not dense:
        scalar_args.append(selected.reshape(-1))
    quantized = k_scale is not None
    precision = lax.Precision.HIGHEST if k_pages.dtype in (jnp.float32, jnp.int8) else None
    kernel = functools.partial(
        _decode_kernel,
        dense=dense,
        page_size=page_size,
        max_pages=max_pages,
        num_kv_heads=num_kv_heads,
        num_sel_heads=num_sel_heads,
        num_selected=num_selected,
        pages_per_block=pages_per_block,
        blocks_per_split=blocks_per_split,
        sm_scale=sm_scale,
        precision=precision,
        quantized=quantized,
    )
    buffer_shape = (2, pages_per_block, page_size, head_dim)
    in_hbm = pl.BlockSpec(memory_space=any_memory_space())
    scales = (k_scale.reshape(num_pages, page_size, 1), v_scale.reshape(num_pages, page_size, 1)) if quantized else ()
    scale_buffer_shape = (2, pages_per_block, page_size, 1)
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_args),
            grid=(batch, num_sel_heads, num_splits, blocks_per_split),
            in_specs=[q_spec, in_hbm, in_hbm, *(in_hbm for _ in scales)],
            out_specs=[acc_spec, stats_spec, stats_spec],
            scratch_shapes=[
                pltpu.VMEM(buffer_shape, k_pages.dtype),
                pltpu.VMEM(buffer_shape, v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((q_per_row, STATS_LANES), jnp.float32),
                pltpu.VMEM((q_per_row, STATS_LANES), jnp.float32),
                pltpu.VMEM((q_per_row, head_dim), jnp.float32),
                *(pltpu.VMEM(scale_buffer_shape, jnp.float32) for _ in scales),
            ],
        ),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="sparse_paged_decode" if not dense else "paged_decode",
    )(*scalar_args, q4, k_pages, v_pages, *scales)
    acc, row_max, row_sum = acc[:, :, :, 0], row_max[:, :, :, 0, 0], row_sum[:, :, :, 0, 0]
    if num_splits == 1:
        return acc[0] / row_sum[0][..., None], row_max[0], row_sum[0]
    return _pages.merge_partials(acc, row_max, row_sum)
