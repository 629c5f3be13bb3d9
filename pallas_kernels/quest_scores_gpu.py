"""Quest page scores as a Pallas GPU kernel (Triton backend), gathering kmin/kmax rows in-kernel.

Notes: docs/modules.md (`pallas_kernels/quest_scores_gpu.py`)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _pages
from ._backend import triton_compiler_params
from .decode_gpu import MIN_QUERY_ROWS, _next_power_of_two


def _scores_kernel(
    q_ref,  # [Gp, D] zero-padded query rows of one kv head
    table_ref,  # int32[nb]  physical pages of this block (-1 = unallocated)
    length_ref,  # int32[1]  this kv head's length
    kmin_ref,  # [N, D]  whole array
    kmax_ref,  # [N, D]
    scores_ref,  # f32[Gp, nb]
    *,
    page_size: int,
    pages_per_block: int,
):
    block = pl.program_id(2)
    num_pages = kmin_ref.shape[0]
    length = length_ref[0]
    pages = jnp.clip(table_ref[...], 0, num_pages - 1)
    page_min = kmin_ref[pages].astype(jnp.float32)  # [nb, D]
    page_max = kmax_ref[pages].astype(jnp.float32)
    q = q_ref[...].astype(jnp.float32)
    contract_d = (((1,), (1,)), ((), ()))
    scores = lax.dot_general(jnp.maximum(q, 0.0), page_max, contract_d, preferred_element_type=jnp.float32)
    scores += lax.dot_general(jnp.minimum(q, 0.0), page_min, contract_d, preferred_element_type=jnp.float32)
    logical = block * pages_per_block + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    used = (length + page_size - 1) // page_size
    current = (length - 1) // page_size
    scores_ref[...] = jnp.where((logical < used) & (logical != current), scores, -jnp.inf)


def quest_scores_gpu(
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
    """Run the GPU kernel; returns f32[B, KVH, G, P]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, max_pages = page_table.shape[1:]
    group = num_q_heads // num_kv_heads
    compiler_params = triton_compiler_params()
    if compiler_params is None and not interpret:
        from .quest_scores_xla import quest_page_scores_xla
        from ._validation import check_score_inputs

        warnings.warn("this JAX has no Pallas Triton backend; pallas_gpu falls back to the XLA path")
        dims = check_score_inputs(q, kmin, kmax, page_table, lengths)
        return quest_page_scores_xla(q, kmin, kmax, page_table, lengths, page_size=page_size, dims=dims)
    if head_dim & (head_dim - 1):
        raise ValueError(f"pallas_gpu needs a power-of-two head_dim (Triton blocks), got {head_dim}")
    if pages_per_block is None:
        pages_per_block = min(64, _next_power_of_two(max_pages))
    pages_per_block = max(MIN_QUERY_ROWS, _next_power_of_two(pages_per_block))  # N of the dots >= 16
    num_blocks = _pages.cdiv(max_pages, pages_per_block)
    padded_pages = num_blocks * pages_per_block
    table = _pages.pad_axis(page_table, padded_pages, axis=2, value=-1)
    rows = max(MIN_QUERY_ROWS, _next_power_of_two(group))
    q_rows = _pages.pad_axis(q.reshape(batch, num_kv_heads, group, head_dim), rows, axis=2, value=0)

    kernel = functools.partial(_scores_kernel, page_size=page_size, pages_per_block=pages_per_block)
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, padded_pages), jnp.float32),
        grid=(batch, num_kv_heads, num_blocks),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, pages_per_block), lambda b, h, j: (b, h, j)),
            pl.BlockSpec((None, 1), lambda b, h, j: (b, h)),
            pl.BlockSpec(kmin.shape, lambda b, h, j: (0, 0)),
            pl.BlockSpec(kmax.shape, lambda b, h, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, pages_per_block), lambda b, h, j: (b, h, 0, j)),
        compiler_params=compiler_params,
        interpret=interpret,
        name="quest_page_scores_gpu",
    )(q_rows, table, lengths, kmin, kmax)
    return scores[:, :, :group, :max_pages]
