"""Sketch page scores as a Pallas Mosaic (TPU) kernel; runs on CPU under the TPU interpreter.

Notes: docs/modules.md (`pallas_kernels/sketch_scores_tpu.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _pages
from ._backend import any_memory_space, tpu_compiler_params
from ._quant import page_values
from .quest_scores_tpu import copy_used_pages

PAGES_PER_BLOCK = 16  # pages scored per grid step (an unrolled loop of small products)


def decoded_rows(rows, codes_kind: str):
    """Code rows `[S, R]` as float32 operands: `[rows]`, or the (low, high) nibbles of 4-bit codes."""
    if codes_kind != "int4":
        return [rows.astype(jnp.float32)]
    x = rows.astype(jnp.int32)
    return [(jnp.left_shift(x, 28) >> 28).astype(jnp.float32), (x >> 4).astype(jnp.float32)]


def query_parts(q, codes_kind: str) -> list:
    """The query `[..., R']` split as the decoded operands: whole, or the channels of the low and the high
    nibbles of 4-bit codes (the kernels take each part as its own input; Triton has no in-kernel slice)."""
    if codes_kind != "int4":
        return [q]
    half = q.shape[-1] // 2
    return [q[..., :half], q[..., half:]]


def best_slot_scores(q_parts, rows, codes_kind: str, precision):
    """max over the rows `[S, R]` of q . decode(row), for query parts `[G, R]` (one per decoded operand): f32[G, 1]."""
    contract = (((1,), (1,)), ((), ()))
    scores = sum(
        lax.dot_general(q, r, contract, preferred_element_type=jnp.float32, precision=precision)
        for q, r in zip(q_parts, decoded_rows(rows, codes_kind))
    )  # [G, S]
    return jnp.max(scores, axis=1, keepdims=True)


def _scores_kernel(page_table_ref, lengths_ref, *refs, codes_kind: str, **options):
    """refs: the query parts (`query_parts`: 2 for 4-bit codes), codes, output and scratch."""
    parts = 2 if codes_kind == "int4" else 1
    _kernel(page_table_ref, lengths_ref, refs[:parts], *refs[parts:], codes_kind=codes_kind, **options)


def _kernel(
    page_table_ref,  # SMEM int32[B * KVH * P]
    lengths_ref,  # SMEM int32[B * KVH]
    q_refs,  # [G, R] per decoded operand
    codes_hbm,  # [N, ps, R] in HBM
    scores_ref,  # f32[G, nb]
    codes_buf,  # VMEM [nb, ps, R]
    sem,  # DMA semaphore
    *,
    page_size: int,
    max_pages: int,
    num_kv_heads: int,
    pages_per_block: int,
    codes_kind: str,
    precision,
):
    batch_index, kv_head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_row = batch_index * num_kv_heads + kv_head
    length = lengths_ref[kv_row]
    used = (length + page_size - 1) // page_size
    current = (length - 1) // page_size
    first = block * pages_per_block

    copy_used_pages(page_table_ref, kv_row * max_pages, max_pages, first, pages_per_block, used,
                    [(codes_hbm, codes_buf, sem)])

    q_parts = [q_ref[...] for q_ref in q_refs]  # float32 [G, R] each
    lane = lax.broadcasted_iota(jnp.int32, scores_ref.shape, 1)
    scores = jnp.full(scores_ref.shape, -jnp.inf, jnp.float32)
    for i in range(pages_per_block):
        scores = jnp.where(lane == i, best_slot_scores(q_parts, codes_buf[i], codes_kind, precision), scores)
    logical = first + lane
    scores_ref[...] = jnp.where((logical < used) & (logical != current), scores, -jnp.inf)  # stale rows masked


def sketch_scores_tpu(
    q,  # [B, Hq, R']
    codes,  # [N, ps, R]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    *,
    page_size: int,
    codes_kind: str,
    interpret,
    pages_per_block: int = PAGES_PER_BLOCK,
):
    """Run the Mosaic kernel; returns f32[B, KVH, G, P]."""
    batch, num_q_heads, width = q.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    group = num_q_heads // num_kv_heads
    if codes_kind != "int4":
        codes = page_values(codes)  # bfloat16 bit patterns (the CPU layout) as values
    pages_per_block = min(pages_per_block, max_pages)
    num_blocks = _pages.cdiv(max_pages, pages_per_block)
    q_parts = query_parts(q.astype(jnp.float32).reshape(batch, num_kv_heads, group, width), codes_kind)
    precision = lax.Precision.HIGHEST if codes.dtype == jnp.float32 else None
    kernel = functools.partial(
        _scores_kernel, page_size=page_size, max_pages=max_pages, num_kv_heads=num_kv_heads,
        pages_per_block=pages_per_block, codes_kind=codes_kind, precision=precision,
    )
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks, group, pages_per_block), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_kv_heads, num_blocks),
            in_specs=[
                *(pl.BlockSpec((None, None, group, part.shape[-1]), lambda b, h, j, *_: (b, h, 0, 0)) for part in q_parts),
                pl.BlockSpec(memory_space=any_memory_space()),
            ],
            out_specs=pl.BlockSpec((None, None, None, group, pages_per_block), lambda b, h, j, *_: (b, h, j, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((pages_per_block,) + codes.shape[1:], codes.dtype),
                pltpu.SemaphoreType.DMA(()),
            ],
        ),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="sketch_page_scores",
    )(page_table.reshape(-1), lengths.reshape(-1), *q_parts, codes)
    scores = jnp.moveaxis(scores, 3, 2).reshape(batch, num_kv_heads, group, -1)
    return scores[..., :max_pages]
