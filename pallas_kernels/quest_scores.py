"""Quest page scores (an upper bound of q.k from each page's key min/max) and top-page selection.

Notes: docs/modules.md (`pallas_kernels/quest_scores.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import _pages
from ._backend import default_backend_for, resolve_backend, resolve_interpret
from ._validation import check_page_size, check_score_inputs
from .quest_scores_xla import finish_scores, quest_page_scores_reference, quest_page_scores_xla

__all__ = ["quest_page_scores", "quest_page_scores_reference", "select_top_pages", "select_top_pages_reference"]


def quest_page_scores(
    q,  # [B, Hq, D]
    kmin,  # [N, D]  per-page elementwise key min (+inf where never written)
    kmax,  # [N, D]  per-page elementwise key max (-inf where never written)
    page_table,  # int32[B, KVH, P]; -1 = unallocated
    lengths,  # int32[B, KVH]; >= 1
    *,
    page_size: int,
    per_kv_head: bool = False,
    backend=None,
    interpret=None,
):
    """Quest score of every logical page: f32[B, Hq, P], or f32[B, KVH, P] with `per_kv_head`.

    Query head hq scores the pages of kv head hq // G. -inf for pages at or past ceil(length / page_size)
    and for the current page (length - 1) // page_size. `per_kv_head` takes the max over each kv head's
    group of query heads. `page_size` is the pool's (k_pages.shape[1]); kmin/kmax do not carry it.
    `backend`/`interpret` as in `sparse_paged_decode`; "pallas_mosaic_gpu" scores with the XLA form (no Mosaic
    GPU scorer yet).
    """
    if backend is None:
        backend = default_backend_for(
            quest_page_scores, dict(q=q, kmin=kmin, kmax=kmax, page_table=page_table, lengths=lengths),
            dict(page_size=page_size, per_kv_head=per_kv_head), interpret,
        )
    backend = resolve_backend(backend)
    if backend == "reference":
        return quest_page_scores_reference(
            q, kmin, kmax, page_table, lengths, page_size=page_size, per_kv_head=per_kv_head
        )
    dims = check_score_inputs(q, kmin, kmax, page_table, lengths)
    check_page_size(page_size, strict=backend != "xla")
    if backend in ("xla", "pallas_mosaic_gpu"):  # no Mosaic GPU scorer: its XLA form runs on any platform
        scores = quest_page_scores_xla(q, kmin, kmax, page_table, lengths, page_size=page_size, dims=dims)
    elif backend == "pallas_tpu":
        from .quest_scores_tpu import quest_scores_tpu

        scores = quest_scores_tpu(
            q, kmin, kmax, page_table, lengths, page_size=page_size, interpret=resolve_interpret(backend, interpret)
        )
    else:
        from .quest_scores_gpu import quest_scores_gpu

        scores = quest_scores_gpu(
            q, kmin, kmax, page_table, lengths, page_size=page_size, interpret=resolve_interpret(backend, interpret)
        )
    return finish_scores(scores, per_kv_head)


def select_top_pages_reference(scores, k: int):
    """Oracle for `select_top_pages`: a full descending sort (stable, so ties keep the lower page)."""
    order = jnp.argsort(-scores, axis=-1, stable=True)
    order = order[..., :k].astype(jnp.int32)
    chosen = jnp.take_along_axis(scores, order, axis=-1)
    chosen_pages = jnp.where(chosen == -jnp.inf, -1, order)
    return _pages.pad_axis(chosen_pages, k, axis=-1, value=-1)


def select_top_pages(
    scores,  # f32[B, H, P]
    k: int,
    *,
    approx: bool | None = None,
):
    """The k best-scoring logical pages per row: int32[B, H, k], -1 where the chosen score is -inf.

    Uses `lax.top_k` (ties: lower page index first). k may exceed P; the extra entries are -1. On TPU
    (or with `approx=True`) `lax.approx_max_k` with recall_target=1.0 is used instead.
    """
    if scores.ndim != 3:
        raise ValueError(f"scores must have shape [B, H, P], got {scores.shape}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    max_pages = scores.shape[-1]
    if k == 0:
        return jnp.zeros(scores.shape[:2] + (0,), jnp.int32)
    width = min(k, max_pages)
    if approx is None:
        approx = jax.default_backend() == "tpu"
    if approx:
        values, indices = lax.approx_max_k(scores, width, recall_target=1.0)
    else:
        values, indices = lax.top_k(scores, width)
    chosen_pages = jnp.where(values == -jnp.inf, -1, indices.astype(jnp.int32))
    return _pages.pad_axis(chosen_pages, k, axis=-1, value=-1)
