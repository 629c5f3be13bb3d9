"""Sketch page scores as a Pallas Mosaic GPU kernel (Hopper, TMA): score a block of slots and reduce it to
page maxima in one pass. Notes: docs/modules.md (`pallas_kernels/sketch_scores_mosaic_gpu.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _pages
from ._quant import page_values
from .decode_mosaic_gpu import (
    BLOCK_SLOTS,
    ENTRY_ALIGN,
    SUPPORTED_PAGE_SIZES,
    _barrier,
    _kernel_entry,
    _layouts,
    gpu_interpret_params,
    mosaic_gpu_module,
)
from .sketch_scores_tpu import decoded_rows, query_parts

SCORES_WIDTH = 32  # page maxima of one block padded to 32 floats per query row (128-byte copies)


def _scores_body(
    q_ref, table_ref, codes_ref,  # inputs, GMEM
    scores_ref,  # output, GMEM
    q_smem, table_smem, codes_smem, scores_smem, in_barrier, codes_barrier,
    *, plgpu, page_size: int, group: int, parts: int, interpreting: bool,
):
    # q_ref f32[parts, R, G, W] (the query per decoded operand); table_ref int32[R, nblk, 32] (physical pages
    # of the block's pages in [..., :pages_per_block], clamped); codes_ref [N, ps, W]; scores_ref
    # f32[R, nblk, G, 32] (page j's maximum at [..., j]).
    block_layout, row_layout, col_layout = _layouts(plgpu)

    def load(ref, layout):
        if interpreting:  # the interpreter implements neither plgpu.load nor layout_cast
            return ref[...]
        return plgpu.load(ref, (), layout=layout, optimized=False)

    row, block = lax.axis_index("row"), lax.axis_index("block")
    pages_per_block = BLOCK_SLOTS // page_size
    for part in range(parts):
        plgpu.copy_gmem_to_smem(q_ref.at[part, row], q_smem.at[part], _barrier(in_barrier, 0))
    plgpu.copy_gmem_to_smem(table_ref.at[row, block], table_smem, _barrier(in_barrier, 0))
    plgpu.barrier_wait(_barrier(in_barrier, 0))
    for j in range(pages_per_block):  # one TMA copy per page into its 16-64 rows of the block
        plgpu.copy_gmem_to_smem(codes_ref.at[table_smem[j]], codes_smem.at[pl.ds(j * page_size, page_size)],
                                _barrier(codes_barrier, 0))
    plgpu.barrier_wait(_barrier(codes_barrier, 0))

    # [64, W] float32 operands: the rows, or the sign-extended low and high nibbles of 4-bit codes
    operands = decoded_rows(load(codes_smem, block_layout), "int4" if parts == 2 else "float")
    slot = lax.broadcasted_iota(jnp.int32, (BLOCK_SLOTS,), 0)
    if not interpreting:
        slot = plgpu.layout_cast(slot, row_layout)
    for g in range(group):
        scores = None
        for part, operand in enumerate(operands):
            query = load(q_smem.at[part, g], col_layout)
            term = jnp.sum(operand * lax.broadcast_in_dim(query, operand.shape, (1,)), axis=1)  # [64]
            scores = term if scores is None else scores + term
        for j in range(pages_per_block):  # the page's best slot
            in_page = (slot >= j * page_size) & (slot < (j + 1) * page_size)
            scores_smem[g, j] = jnp.max(jnp.where(in_page, scores, -jnp.inf))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(scores_smem, scores_ref.at[row, block])
    plgpu.wait_smem_to_gmem(0)


def sketch_scores_mosaic_gpu(
    q,  # [B, Hq, R']
    codes,  # [N, ps, R]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    *,
    page_size: int,
    codes_kind: str,
    interpret,
):
    """Run the Mosaic GPU kernel; returns f32[B, KVH, G, P] (masked: -inf past the used pages and at the
    current page). Grid (B * KVH rows, blocks of 64 slots); each CUDA block TMA-copies its pages' code rows
    into SMEM, scores them for the kv head's query group on CUDA cores and writes each page's maximum."""
    from .quest_scores_xla import scoreable_pages

    plgpu = mosaic_gpu_module()
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"pallas_mosaic_gpu needs page_size in {SUPPORTED_PAGE_SIZES}, got {page_size}")
    if codes.shape[-1] % 8:
        raise ValueError(f"pallas_mosaic_gpu needs sketch rows a multiple of 8 wide, got {codes.shape[-1]}")
    if interpret is True:
        interpret = gpu_interpret_params()
        if interpret is None:
            raise NotImplementedError("backend 'pallas_mosaic_gpu': this JAX has no Mosaic GPU interpret mode")
    interpreting = interpret not in (False, None)
    if codes_kind != "int4":
        codes = page_values(codes)  # bfloat16 bit patterns (the CPU layout) as values
    batch, num_q_heads, width = q.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    group, rows = num_q_heads // num_kv_heads, batch * num_kv_heads
    pages_per_block = BLOCK_SLOTS // page_size
    num_blocks = _pages.cdiv(max_pages, pages_per_block)
    table = jnp.clip(page_table, 0, codes.shape[0] - 1).reshape(rows, max_pages)
    table = _pages.pad_axis(table, num_blocks * pages_per_block, axis=1, value=0)
    table = _pages.pad_axis(table.reshape(rows, num_blocks, pages_per_block), ENTRY_ALIGN, axis=2, value=0)
    q_parts = jnp.stack(query_parts(q.astype(jnp.float32).reshape(rows, group, width), codes_kind))
    parts, sketch_width = q_parts.shape[0], codes.shape[-1]

    body = functools.partial(_scores_body, plgpu=plgpu, page_size=page_size, group=group, parts=parts,
                             interpreting=interpreting)
    kernel = _kernel_entry(
        plgpu,
        body,
        jax.ShapeDtypeStruct((rows, num_blocks, group, SCORES_WIDTH), jnp.float32),
        [
            plgpu.SMEM((parts, group, sketch_width), jnp.float32),
            plgpu.SMEM((ENTRY_ALIGN,), jnp.int32),
            plgpu.SMEM((BLOCK_SLOTS, sketch_width), codes.dtype),
            plgpu.SMEM((group, SCORES_WIDTH), jnp.float32),
            plgpu.Barrier(num_arrivals=parts + 1),
            plgpu.Barrier(num_arrivals=pages_per_block),
        ],
        grid=(rows, num_blocks),
        grid_names=("row", "block"),
        compiler_params=plgpu.CompilerParams(),
        **({"interpret": interpret} if interpreting else {}),
    )
    scores = kernel(q_parts, table, codes)[..., :pages_per_block]  # [R, nblk, G, ppb]
    scores = jnp.moveaxis(scores, 2, 1).reshape(batch, num_kv_heads, group, -1)[..., :max_pages]
    return jnp.where(scoreable_pages(lengths, max_pages, page_size)[:, :, None], scores, -jnp.inf)
