"""Quest page scores as a Pallas Mosaic (TPU) kernel; runs on CPU under the TPU interpreter.

Notes: docs/modules.md (`pallas_kernels/quest_scores_tpu.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _pages
from ._backend import any_memory_space, tpu_compiler_params

LANES = 128


def copy_used_pages(page_table_ref, table_start, max_pages: int, first, count: int, used, arrays) -> None:
    """Copy, for the block's `count` logical pages from `first` that are below `used`, each physical page's
    row of every `(hbm, vmem buffer, semaphore)` in `arrays` (the buffer's row i for logical page first + i),
    all started before any is waited on. `table_start`: the head's offset in the flat SMEM page table."""
    copies = []
    for i in range(count):
        logical = first + i
        page = page_table_ref[table_start + jnp.minimum(logical, max_pages - 1)]
        copies.append((logical < used, [pltpu.make_async_copy(hbm.at[pl.ds(page, 1)], buf.at[pl.ds(i, 1)], sem)
                                        for hbm, buf, sem in arrays]))
    for in_use, page_copies in copies:
        for copy in page_copies:
            pl.when(in_use)(copy.start)
    for in_use, page_copies in copies:
        for copy in page_copies:
            pl.when(in_use)(copy.wait)


def _scores_kernel(
    page_table_ref,  # SMEM int32[B * KVH * P]
    lengths_ref,  # SMEM int32[B * KVH]
    q_ref,  # [G, D]
    kmin_hbm,  # [N, D] in HBM
    kmax_hbm,  # [N, D] in HBM
    scores_ref,  # f32[G, nb]
    kmin_buf,  # VMEM [nb, D]
    kmax_buf,  # VMEM [nb, D]
    sems,  # DMA semaphores [2]
    *,
    page_size: int,
    max_pages: int,
    num_kv_heads: int,
    pages_per_block: int,
    precision,
):
    batch_index, kv_head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_row = batch_index * num_kv_heads + kv_head
    length = lengths_ref[kv_row]
    used = (length + page_size - 1) // page_size
    current = (length - 1) // page_size
    first = block * pages_per_block

    copy_used_pages(
        page_table_ref, kv_row * max_pages, max_pages, first, pages_per_block, used,
        [(kmin_hbm, kmin_buf, sems.at[0]), (kmax_hbm, kmax_buf, sems.at[1])],
    )

    q = q_ref[...].astype(jnp.float32)  # [G, D]
    q_pos, q_neg = jnp.maximum(q, 0.0), jnp.minimum(q, 0.0)
    contract_d = (((1,), (1,)), ((), ()))
    scores = lax.dot_general(
        q_pos, kmax_buf[...].astype(jnp.float32), contract_d, preferred_element_type=jnp.float32, precision=precision
    ) + lax.dot_general(
        q_neg, kmin_buf[...].astype(jnp.float32), contract_d, preferred_element_type=jnp.float32, precision=precision
    )  # [G, nb]
    logical = first + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    valid = (logical < used) & (logical != current)
    scores_ref[...] = jnp.where(valid, scores, -jnp.inf)  # rows not copied hold stale data: masked here


def quest_scores_tpu(
    q,  # [B, Hq, D]
    kmin,  # [N, D]
    kmax,  # [N, D]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    *,
    page_size: int,
    interpret,
    pages_per_block: int | None = None,
):
    """Run the Mosaic kernel; returns f32[B, KVH, G, P]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    group = num_q_heads // num_kv_heads
    if pages_per_block is None:
        # A block's pages lie along lanes: one lane tile, or all pages when fewer.
        pages_per_block = max_pages if max_pages <= LANES else LANES
    num_blocks = _pages.cdiv(max_pages, pages_per_block)
    padded_pages = num_blocks * pages_per_block

    q4 = q.reshape(batch, num_q_heads, 1, head_dim)  # [G, D] tiles, as in decode_tpu
    if group % 8:
        q4 = q4.astype(jnp.float32)
    precision = lax.Precision.HIGHEST if kmin.dtype == jnp.float32 else None
    kernel = functools.partial(
        _scores_kernel,
        page_size=page_size,
        max_pages=max_pages,
        num_kv_heads=num_kv_heads,
        pages_per_block=pages_per_block,
        precision=precision,
    )
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, padded_pages), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_kv_heads, num_blocks),
            in_specs=[
                pl.BlockSpec((None, group, None, head_dim), lambda b, h, j, *_: (b, h, 0, 0)),
                pl.BlockSpec(memory_space=any_memory_space()),
                pl.BlockSpec(memory_space=any_memory_space()),
            ],
            out_specs=pl.BlockSpec((None, None, group, pages_per_block), lambda b, h, j, *_: (b, h, 0, j)),
            scratch_shapes=[
                pltpu.VMEM((pages_per_block, head_dim), kmin.dtype),
                pltpu.VMEM((pages_per_block, head_dim), kmax.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="quest_page_scores",
    )(page_table.reshape(-1), lengths.reshape(-1), q4, kmin, kmax)
    return scores[..., :max_pages]
