"""Sketch page scores as a Pallas GPU kernel (Triton backend), gathering the pages' code rows in-kernel.

Notes: docs/modules.md (`pallas_kernels/sketch_scores_gpu.py`)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _pages
from ._backend import triton_compiler_params
from ._quant import page_values
from .decode_gpu import MIN_QUERY_ROWS, _next_power_of_two
from .sketch_scores_tpu import decoded_rows, query_parts


def _scores_kernel(
    *refs,
    page_size: int,
    pages_per_block: int,
    codes_kind: str,
):
    """refs: the query parts (one `[Gp, R]` per decoded operand: 2 for 4-bit codes), then table, length,
    codes and the output."""
    parts = 2 if codes_kind == "int4" else 1
    _kernel(refs[:parts], *refs[parts:], page_size=page_size, pages_per_block=pages_per_block, codes_kind=codes_kind)


def _kernel(
    q_refs,  # [Gp, R] zero-padded query rows of one kv head, per decoded operand
    table_ref,  # int32[nb]  physical pages of this block (-1 = unallocated)
    length_ref,  # int32[1]  this kv head's length
    codes_ref,  # [N * ps, R]  whole array, one row per slot
    scores_ref,  # f32[Gp, nb]
    *,
    page_size: int,
    pages_per_block: int,
    codes_kind: str,
):
    block = pl.program_id(2)
    num_pages = codes_ref.shape[0] // page_size
    pages = jnp.clip(table_ref[...], 0, num_pages - 1)
    q_parts = [q_ref[...] for q_ref in q_refs]
    contract = (((1,), (1,)), ((), ()))
    best = None
    for slot in range(page_size):
        rows = codes_ref[pages * page_size + slot]  # [nb, R]
        scores = sum(lax.dot_general(qp, r, contract, preferred_element_type=jnp.float32)
                     for qp, r in zip(q_parts, decoded_rows(rows, codes_kind)))  # [Gp, nb]
        best = scores if best is None else jnp.maximum(best, scores)
    logical = block * pages_per_block + lax.broadcasted_iota(jnp.int32, best.shape, 1)
    length = length_ref[0]
    used = (length + page_size - 1) // page_size
    current = (length - 1) // page_size
    scores_ref[...] = jnp.where((logical < used) & (logical != current), best, -jnp.inf)


def sketch_scores_gpu(
    q,  # [B, Hq, R']
    codes,  # [N, ps, R]
    page_table,  # int32[B, KVH, P]
    lengths,  # int32[B, KVH]
    *,
    page_size: int,
    codes_kind: str,
    interpret,
    pages_per_block: int | None = None,
):
    """Run the GPU kernel; returns f32[B, KVH, G, P]."""
    batch, num_q_heads, width = q.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    group = num_q_heads // num_kv_heads
    compiler_params = triton_compiler_params()
    if compiler_params is None and not interpret:
        from .sketch_scores import sketch_page_scores_reference

        warnings.warn("this JAX has no Pallas Triton backend; pallas_gpu falls back to the XLA path")
        scores = sketch_page_scores_reference(q, codes, page_table, lengths, page_size=page_size, codes_kind=codes_kind)
        return scores.reshape(batch, num_kv_heads, group, max_pages)
    if codes_kind != "int4":
        codes = page_values(codes)
    if pages_per_block is None:
        pages_per_block = min(64, _next_power_of_two(max_pages))
    pages_per_block = max(MIN_QUERY_ROWS, _next_power_of_two(pages_per_block))  # N of the dots >= 16
    num_blocks = _pages.cdiv(max_pages, pages_per_block)
    table = _pages.pad_axis(page_table, num_blocks * pages_per_block, axis=2, value=-1)
    rows = max(MIN_QUERY_ROWS, _next_power_of_two(group))
    q_rows = _pages.pad_axis(q.astype(jnp.float32).reshape(batch, num_kv_heads, group, width), rows, axis=2, value=0)
    q_parts = query_parts(q_rows, codes_kind)
    flat_codes = codes.reshape(-1, codes.shape[-1])

    kernel = functools.partial(_scores_kernel, page_size=page_size, pages_per_block=pages_per_block,
                               codes_kind=codes_kind)
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, num_blocks * pages_per_block), jnp.float32),
        grid=(batch, num_kv_heads, num_blocks),
        in_specs=[
            *(pl.BlockSpec((None, None, rows, part.shape[-1]), lambda b, h, j: (b, h, 0, 0)) for part in q_parts),
            pl.BlockSpec((None, None, pages_per_block), lambda b, h, j: (b, h, j)),
            pl.BlockSpec((None, 1), lambda b, h, j: (b, h)),
            pl.BlockSpec(flat_codes.shape, lambda b, h, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, pages_per_block), lambda b, h, j: (b, h, 0, j)),
        compiler_params=compiler_params,
        interpret=interpret,
        name="sketch_page_scores_gpu",
    )(*q_parts, table, lengths, flat_codes)
    return scores[:, :, :group, :max_pages]
