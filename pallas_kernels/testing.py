"""Builders of random paged-attention inputs for tests and benchmarks (numpy, host side).

Notes: docs/modules.md (`pallas_kernels/testing.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class PagedInputs:
    q: np.ndarray  # [B, Hq, D]
    k_pages: np.ndarray  # [N, ps, D]
    v_pages: np.ndarray  # [N, ps, D]
    kmin: np.ndarray  # [N, D]
    kmax: np.ndarray  # [N, D]
    page_table: np.ndarray  # int32[B, KVH, P]
    lengths: np.ndarray  # int32[B, KVH]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    def as_jax(self, dtype=jnp.float32):
        """(q, k_pages, v_pages, kmin, kmax, page_table, lengths) as jax arrays, floats in `dtype`."""
        floats = [jnp.asarray(x, dtype) for x in (self.q, self.k_pages, self.v_pages, self.kmin, self.kmax)]
        return (*floats, jnp.asarray(self.page_table), jnp.asarray(self.lengths))

    def as_int8(self):
        """(k_pages, v_pages, k_scale, v_scale) as int8 pages with per-slot scales (`quantize_int8`). A slot
        that is not valid keeps int8 garbage and a NaN scale, so a kernel that reads one shows it."""
        from ._quant import quantize_int8

        out = []
        for pages in (self.k_pages, self.v_pages):
            invalid = np.isnan(pages).any(axis=-1)  # [N, ps]
            q, scale = quantize_int8(jnp.asarray(np.where(invalid[..., None], 0.0, pages)))
            out.append((q, jnp.where(jnp.asarray(invalid), jnp.nan, scale)))
        (k, k_scale), (v, v_scale) = out
        return k, v, k_scale, v_scale


def make_paged_inputs(
    rng: np.random.Generator,
    *,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_pages: int,
    lengths=None,
    spare_pages: int = 3,
    poison=np.nan,
) -> PagedInputs:
    """Random inputs with heads of ragged `lengths` (default: uniform in [1, max_pages * page_size]).

    The pool has `spare_pages` more pages than the heads use; physical pages are a random permutation.
    """
    if lengths is None:
        lengths = rng.integers(1, max_pages * page_size + 1, size=(batch, num_kv_heads))
    lengths = np.asarray(lengths, np.int32).reshape(batch, num_kv_heads)
    used = -(-lengths // page_size)
    num_pages = int(used.sum()) + spare_pages
    physical = rng.permutation(num_pages).astype(np.int32)
    page_table = np.full((batch, num_kv_heads, max_pages), -1, np.int32)
    k_pages = np.full((num_pages, page_size, head_dim), poison, np.float32)
    v_pages = np.full((num_pages, page_size, head_dim), poison, np.float32)
    kmin = np.full((num_pages, head_dim), np.inf, np.float32)
    kmax = np.full((num_pages, head_dim), -np.inf, np.float32)
    next_page = 0
    for b in range(batch):
        for h in range(num_kv_heads):
            for p in range(used[b, h]):
                page = physical[next_page]
                next_page += 1
                page_table[b, h, p] = page
                valid = min(page_size, lengths[b, h] - p * page_size)
                keys = rng.standard_normal((valid, head_dim), dtype=np.float32)
                k_pages[page, :valid] = keys
                v_pages[page, :valid] = rng.standard_normal((valid, head_dim), dtype=np.float32)
                kmin[page] = keys.min(axis=0)
                kmax[page] = keys.max(axis=0)
    q = rng.standard_normal((batch, num_q_heads, head_dim), dtype=np.float32)
    return PagedInputs(q, k_pages, v_pages, kmin, kmax, page_table, lengths)


def random_selection(rng: np.random.Generator, inputs: PagedInputs, num_sel_heads: int, k: int) -> np.ndarray:
    """int32[B, Hsel, k]: random logical pages, including -1, the current page, repeats and pages past
    the used ones, so the kernels' clean-up of a selection is exercised too."""
    batch, num_kv_heads, max_pages = inputs.page_table.shape
    return rng.integers(-1, max_pages + 1, size=(batch, num_sel_heads, k)).astype(np.int32)

