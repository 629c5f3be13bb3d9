"""Paged decode attention as a Pallas GPU kernel (Triton backend) that gathers pages in-kernel.

Notes: docs/modules.md (`pallas_kernels/decode_gpu.py`)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _pages
from ._backend import triton_compiler_params

MIN_QUERY_ROWS = 16  # smallest M of a Triton dot


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _decode_kernel(*refs, pages_per_block: int, sm_scale: float, quantized: bool):
    if quantized:
        q_ref, pages_ref, counts_ref, k_ref, v_ref, k_scale_ref, v_scale_ref, acc_ref, max_ref, sum_ref = refs
    else:
        q_ref, pages_ref, counts_ref, k_ref, v_ref, acc_ref, max_ref, sum_ref = refs
    # q_ref [Gp, D]: query rows of one selection row, zero-padded; pages_ref, counts_ref int32[E_split]:
    # physical pages of this split's entries and their valid slots (entries with slots first); k_ref,
    # v_ref [N, ps, D]: the whole pool (int8 with scale refs f32[N, ps] when quantized); acc_ref f32[Gp, D],
    # max_ref, sum_ref f32[Gp].
    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    block_slots = pages_per_block * page_size
    q = q_ref[...].astype(jnp.float32) * sm_scale
    entries_with_slots = jnp.sum((counts_ref[...] > 0).astype(jnp.int32))
    active_blocks = (entries_with_slots + pages_per_block - 1) // pages_per_block
    slot = lax.broadcasted_iota(jnp.int32, (block_slots,), 0)

    def fold_block(block, state):
        row_max, row_sum, acc = state
        first = block * pages_per_block
        pages = pages_ref[pl.ds(first, pages_per_block)]  # [nb]
        k = k_ref[pages].astype(jnp.float32).reshape(block_slots, head_dim)  # gathered pages
        v = v_ref[pages].astype(jnp.float32).reshape(block_slots, head_dim)
        if quantized:  # int8 pages: each slot's values times its scale, dequantised in registers
            k = k * k_scale_ref[pages].reshape(block_slots)[:, None]
            v = v * v_scale_ref[pages].reshape(block_slots)[:, None]
        count_of_slot = counts_ref[first + slot // page_size]  # [T]
        valid = slot % page_size < count_of_slot
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = jnp.where(valid[None, :], logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))  # finite: the block has a valid slot
        rescale = jnp.exp(row_max - new_max)
        probs = jnp.exp(logits - new_max[:, None])
        v = jnp.where(valid[:, None], v, 0.0)  # slots past the length may hold NaN
        weighted = lax.dot_general(probs, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return new_max, rescale * row_sum + jnp.sum(probs, axis=1), rescale[:, None] * acc + weighted

    rows = q.shape[0]
    state = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    row_max, row_sum, acc = lax.fori_loop(0, active_blocks, fold_block, state)
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def decode_gpu(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    physical,  # int32[B, Hsel, E]  physical page per entry
    counts,  # int32[B, Hsel, E]  valid slots per entry, entries with slots first
    *,
    sm_scale: float,
    interpret,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    k_scale=None,  # f32[N, ps] with int8 pages, else None
    v_scale=None,
):
    """Run the GPU kernel; returns (out f32[B, Hq, D], row_max f32[B, Hq], row_sum f32[B, Hq])."""
    batch, num_q_heads, head_dim = q.shape
    num_sel_heads, num_entries = physical.shape[1:]
    q_per_row = num_q_heads // num_sel_heads
    compiler_params = triton_compiler_params()
    if compiler_params is None and not interpret:
        from .decode_xla import attend_read_list_xla

        warnings.warn("this JAX has no Pallas Triton backend; pallas_gpu falls back to the XLA path")
        return attend_read_list_xla(
            q, k_pages, v_pages, physical, counts, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale
        )
    if head_dim & (head_dim - 1):
        raise ValueError(f"pallas_gpu needs a power-of-two head_dim (Triton blocks), got {head_dim}")

    if pages_per_block is None:
        pages_per_block = max(1, 64 // k_pages.shape[1])  # 64 slots per step
    pages_per_block = _next_power_of_two(min(pages_per_block, _next_power_of_two(num_entries)))
    num_blocks = _pages.cdiv(num_entries, pages_per_block)
    if num_splits is None:
        # enough programs to fill the GPU when rows are few
        num_splits = max(1, min(num_blocks // 4, 256 // max(1, batch * num_sel_heads)))
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = _pages.cdiv(num_blocks, num_splits)
    entries_per_split = _next_power_of_two(blocks_per_split * pages_per_block)
    padded = num_splits * entries_per_split
    physical = _pages.pad_axis(physical, padded, axis=2, value=0)
    counts = _pages.pad_axis(counts, padded, axis=2, value=0)
    # Entries with slots must be a prefix of every split: splits take interleaved blocks of the row.
    # (Row entries with slots are a prefix, so split s gets prefix blocks s, s+S, ... in order.)
    physical = _interleave_splits(physical, num_splits, pages_per_block)
    counts = _interleave_splits(counts, num_splits, pages_per_block)

    rows = max(MIN_QUERY_ROWS, _next_power_of_two(q_per_row))
    q_rows = q.reshape(batch, num_sel_heads, q_per_row, head_dim)
    q_rows = _pages.pad_axis(q_rows, rows, axis=2, value=0)

    quantized = k_scale is not None
    kernel = functools.partial(_decode_kernel, pages_per_block=pages_per_block, sm_scale=sm_scale, quantized=quantized)
    pool_spec = pl.BlockSpec(k_pages.shape, lambda b, h, s: (0, 0, 0))
    scale_spec = pl.BlockSpec(k_pages.shape[:2], lambda b, h, s: (0, 0))
    scales = (k_scale, v_scale) if quantized else ()
    entries_spec = pl.BlockSpec((None, None, entries_per_split), lambda b, h, s: (b, h, s))
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_splits, batch, num_sel_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, num_sel_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, num_sel_heads, rows), jnp.float32),
        ),
        grid=(batch, num_sel_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            entries_spec,
            entries_spec,
            pool_spec,
            pool_spec,
            *(scale_spec for _ in scales),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
        ],
        compiler_params=compiler_params,
        interpret=interpret,
        name="paged_decode_gpu",
    )(q_rows, physical, counts, k_pages, v_pages, *scales)
    acc = acc[:, :, :, :q_per_row].reshape(num_splits, batch, num_q_heads, head_dim)
    row_max = row_max[:, :, :, :q_per_row].reshape(num_splits, batch, num_q_heads)
    row_sum = row_sum[:, :, :, :q_per_row].reshape(num_splits, batch, num_q_heads)
    if num_splits == 1:
        return acc[0] / row_sum[0][..., None], row_max[0], row_sum[0]
    return _pages.merge_partials(acc, row_max, row_sum)


def _interleave_splits(entries, num_splits: int, pages_per_block: int):
    """Reorder `[B, H, S * E_split]` so split s holds blocks s, s+S, s+2S, ... of the row, in order.

    The entries with slots form a prefix of the row, so they also form a prefix of every split, and each
    split's work is balanced within one block.
    """
    batch, heads, total = entries.shape
    blocks = total // pages_per_block
    per_split = blocks // num_splits
    entries = entries.reshape(batch, heads, per_split, num_splits, pages_per_block)
    return jnp.swapaxes(entries, 2, 3).reshape(batch, heads, total)
