"""Decode attention over a paged KV pool: sparse (selected pages + the current page) and dense.

Notes: docs/modules.md (`pallas_kernels/paged_decode.py`)."""

from __future__ import annotations

from . import _pages
from ._backend import default_backend_for, resolve_backend, resolve_interpret
from ._quant import page_values
from ._validation import check_decode_inputs, resolve_sm_scale
from .decode_reference import paged_decode_reference, sparse_paged_decode_reference
from .decode_xla import attend_read_list_xla

__all__ = ["sparse_paged_decode", "paged_decode", "sparse_paged_decode_reference", "paged_decode_reference"]


def _finish(q, out, row_max, row_sum, return_stats):
    out = out.astype(q.dtype)
    return (out, row_max, row_sum) if return_stats else out


def _attend_read_list(
    backend, q, k_pages, v_pages, physical, counts, *, sm_scale, interpret, pages_per_block, num_splits, formulation,
    k_scale, v_scale, row_groups=None,
):
    """Attention over a read list (physical pages and valid slots per entry) on the XLA or a Pallas GPU path."""
    if backend == "xla":
        return attend_read_list_xla(
            q,
            k_pages,
            v_pages,
            physical,
            counts,
            sm_scale=sm_scale,
            pages_per_block=pages_per_block,
            k_scale=k_scale,
            v_scale=v_scale,
            row_groups=row_groups,
            **({"formulation": formulation} if formulation else {}),
        )
    if backend == "pallas_mosaic_gpu":
        from .decode_mosaic_gpu import attend_read_list_mosaic_gpu as attend_on_gpu
    else:
        from .decode_gpu import decode_gpu as attend_on_gpu
    return attend_on_gpu(
        q,
        k_pages,
        v_pages,
        physical,
        counts,
        sm_scale=sm_scale,
        interpret=resolve_interpret(backend, interpret),
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def sparse_paged_decode(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    page_table,  # int32[B, KVH, P]; -1 = unallocated
    selected,  # int32[B, Hsel, K] logical pages, Hsel = Hq (per query head) or KVH (per kv head); -1 = none
    lengths,  # int32[B, KVH]; 1 <= lengths <= P * ps
    *,
    sm_scale=None,
    return_stats=False,
    backend=None,
    interpret=None,
    pages_per_block=None,
    num_splits=None,
    formulation=None,
    k_scale=None,
    v_scale=None,
    row_groups=None,
):
    """Attention of one decode query per head over its selected pages plus its current page.

    Query head hq reads kv head hq // G (G = Hq // KVH) and selection row hq (Hsel = Hq) or hq // G
    (Hsel = KVH). The current page, (length - 1) // ps, is always read and only below the length; a
    selected page is read in full. Entries that are -1, outside the used pages, equal to the current page,
    or repeated are read once or not at all (set semantics).

    Args:
      sm_scale: logit scale, default 1/sqrt(D).
      return_stats: also return row max m and row sum l, f32[B, Hq], of the scaled logits, so that
        p = exp(s * sm_scale - m) / l.
      backend: None (by `jax.default_backend()`), "reference", "xla", "pallas_tpu", "pallas_gpu" or
        "pallas_mosaic_gpu" (never chosen by default).
      interpret: for Pallas backends; None interprets off their own platform.
      pages_per_block, num_splits: tuning of the loop/grid (None = heuristic); formulation: the XLA
        path's block computation (see `decode_xla.FORMULATIONS`); row_groups: the XLA path's loops, each
        over a group of rows (None = `decode_xla.default_row_groups`).
      k_scale, v_scale: f32[N, ps], the per-slot scales of int8 pages (`pallas_kernels._quant`); every
        backend dequantises as it reads. None for float pages.

    Pages may also be uint16: bfloat16 pages held as their bit patterns (`_quant.BFLOAT16_BITS`, kvjax's
    layout on CPU). The XLA path bitcasts each gathered block; other backends bitcast the pool first.

    Returns:
      out [B, Hq, D] in q's dtype (and row max, row sum f32[B, Hq] with `return_stats`).
    """
    return _decode(
        sparse_paged_decode, q, k_pages, v_pages, page_table, lengths, selected, sm_scale=sm_scale,
        return_stats=return_stats, backend=backend, interpret=interpret, pages_per_block=pages_per_block,
        num_splits=num_splits, formulation=formulation, k_scale=k_scale, v_scale=v_scale, row_groups=row_groups,
    )


def _pool_for(backend: str, k_pages, v_pages):
    """The pools as `backend` reads them: bfloat16 bit patterns (uint16) stay bits for the XLA path, which
    bitcasts each gathered block, and become bfloat16 arrays for the others."""
    if backend == "xla":
        return k_pages, v_pages
    return page_values(k_pages), page_values(v_pages)


def paged_decode(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    page_table,  # int32[B, KVH, P]; -1 = unallocated
    lengths,  # int32[B, KVH]; 1 <= lengths <= P * ps
    *,
    sm_scale=None,
    return_stats=False,
    backend=None,
    interpret=None,
    pages_per_block=None,
    num_splits=None,
    formulation=None,
    k_scale=None,
    v_scale=None,
    row_groups=None,
):
    """Dense paged decode: attention of each query head over every valid slot of its kv head.

    Equal to `sparse_paged_decode` with every page selected. Arguments and results as there.
    """
    return _decode(
        paged_decode, q, k_pages, v_pages, page_table, lengths, None, sm_scale=sm_scale,
        return_stats=return_stats, backend=backend, interpret=interpret, pages_per_block=pages_per_block,
        num_splits=num_splits, formulation=formulation, k_scale=k_scale, v_scale=v_scale, row_groups=row_groups,
    )


def _decode(entry, q, k_pages, v_pages, page_table, lengths, selected, *, sm_scale, return_stats, backend,
            interpret, pages_per_block, num_splits, formulation, k_scale, v_scale, row_groups):
    """The one body of both entry points: `selected` None reads every page (`paged_decode`), else the
    selected pages plus the current one (`sparse_paged_decode`, the entry whose compile is probed)."""
    options = dict(sm_scale=sm_scale, return_stats=return_stats, pages_per_block=pages_per_block,
                   num_splits=num_splits, formulation=formulation, row_groups=row_groups)
    if backend is None:
        arrays = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, lengths=lengths,
                      k_scale=k_scale, v_scale=v_scale)
        if selected is not None:
            arrays["selected"] = selected
        backend = default_backend_for(entry, arrays, options, interpret)
    backend = resolve_backend(backend)
    k_pages, v_pages = _pool_for(backend, k_pages, v_pages)
    if backend == "reference":
        scales = dict(sm_scale=sm_scale, return_stats=return_stats, k_scale=k_scale, v_scale=v_scale)
        if selected is None:
            return paged_decode_reference(q, k_pages, v_pages, page_table, lengths, **scales)
        return sparse_paged_decode_reference(q, k_pages, v_pages, page_table, selected, lengths, **scales)
    dims = check_decode_inputs(
        q, k_pages, v_pages, page_table, lengths, selected, strict_page_size=backend != "xla", k_scale=k_scale,
        v_scale=v_scale,
    )
    sm_scale = resolve_sm_scale(sm_scale, dims.head_dim)
    if selected is not None:
        selected = _pages.normalize_selection(selected, lengths, dims.page_size)
    if backend == "pallas_tpu":
        from .decode_tpu import decode_tpu

        out, row_max, row_sum = decode_tpu(
            q, k_pages, v_pages, page_table, lengths, selected, sm_scale=sm_scale,
            interpret=resolve_interpret(backend, interpret), pages_per_block=pages_per_block,
            num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
        )
        return _finish(q, out, row_max, row_sum, return_stats)
    if selected is None:
        logical, counts = _pages.dense_read_list(lengths, dims.max_pages, dims.page_size)
    else:
        logical, counts = _pages.sparse_read_list(selected, lengths, dims.page_size)
    physical = _pages.physical_pages(page_table, logical, dims.num_pages)
    out, row_max, row_sum = _attend_read_list(
        backend, q, k_pages, v_pages, physical, counts, sm_scale=sm_scale, interpret=interpret,
        pages_per_block=pages_per_block, num_splits=num_splits, formulation=formulation, k_scale=k_scale,
        v_scale=v_scale, row_groups=row_groups,
    )
    return _finish(q, out, row_max, row_sum, return_stats)
