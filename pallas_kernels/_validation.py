"""Static input checks shared by every kernel and backend.

Notes: docs/modules.md (`pallas_kernels/_validation.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ._quant import is_bfloat16_bits

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SUPPORTED_PAGE_SIZES = (16, 32, 64)


@dataclasses.dataclass(frozen=True)
class DecodeDims:
    """Static sizes of one decode-attention call."""

    batch: int  # B
    num_q_heads: int  # Hq
    num_kv_heads: int  # KVH
    head_dim: int  # D
    num_pages: int  # N, physical pages in the pool
    page_size: int  # ps
    max_pages: int  # P, logical pages per (sequence, kv-head)
    num_sel_heads: int  # Hsel: Hq (per query head) or KVH (per kv head); KVH when dense
    num_selected: int  # K, static selection width; 0 when dense

    @property
    def group_size(self) -> int:
        """Query heads per kv head (G)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_per_sel_head(self) -> int:
        """Query heads that share one selection row (1 per query head, G per kv head)."""
        return self.num_q_heads // self.num_sel_heads


def _shape_error(name: str, array, expected: str) -> ValueError:
    return ValueError(f"{name} must have shape {expected}, got {tuple(np.shape(array))}")


def _check_int32(name: str, array) -> None:
    if jnp.dtype(array.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32, got {array.dtype}")


def _check_float(name: str, array) -> None:
    if jnp.dtype(array.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {array.dtype}")


def check_page_size(page_size: int, *, strict: bool) -> None:
    """Raise unless `page_size` is usable; `strict` restricts it to the sizes the Pallas kernels support."""
    if page_size < 1:
        raise ValueError(f"k_pages.shape[1] (page_size) must be positive, got {page_size}")
    if strict and page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"k_pages.shape[1] (page_size) must be one of {SUPPORTED_PAGE_SIZES} for the Pallas kernels, "
            f"got {page_size}"
        )


def check_tables(page_table, lengths, batch: int, num_kv_heads: int) -> int:
    """Check `page_table int32[B, KVH, P]` and `lengths int32[B, KVH]`; returns P."""
    _check_int32("page_table", page_table)
    _check_int32("lengths", lengths)
    if page_table.ndim != 3 or page_table.shape[:2] != (batch, num_kv_heads):
        raise _shape_error("page_table", page_table, f"[B={batch}, KVH={num_kv_heads}, max_pages]")
    if lengths.shape != (batch, num_kv_heads):
        raise _shape_error("lengths", lengths, f"[B={batch}, KVH={num_kv_heads}]")
    if page_table.shape[2] < 1:
        raise ValueError("page_table must have at least one logical page (max_pages >= 1)")
    return page_table.shape[2]


def check_q_heads(q, num_kv_heads: int) -> None:
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q.shape[1] (query heads, {q.shape[1]}) must be a multiple of the kv heads in page_table "
            f"({num_kv_heads})"
        )


def check_page_scales(k_pages, k_scale, v_scale) -> None:
    """int8 pages need float32 scales `[N, ps]` for K and V (pallas_kernels._quant); float pages take none."""
    if jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.int8):
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(f"int8 pages need {name}: float32 [num_pages, page_size], one scale per slot")
            if jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32):
                raise TypeError(f"{name} must be float32, got {scale.dtype}")
            if tuple(scale.shape) != tuple(k_pages.shape[:2]):
                raise _shape_error(name, scale, f"{tuple(k_pages.shape[:2])} (num_pages, page_size of k_pages)")
        return
    if not is_bfloat16_bits(k_pages):  # uint16: bfloat16 bit patterns (pallas_kernels._quant.BFLOAT16_BITS)
        _check_float("k_pages", k_pages)
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale are for int8 pages; k_pages is {k_pages.dtype}")


def check_decode_inputs(
    q, k_pages, v_pages, page_table, lengths, selected=None, *, strict_page_size=False, k_scale=None, v_scale=None
):
    """Validate decode inputs; returns `DecodeDims`.

    q [B, Hq, D]; k_pages, v_pages [N, ps, D] (float, or int8 with `k_scale`, `v_scale` f32[N, ps]);
    page_table int32[B, KVH, P]; lengths int32[B, KVH]; selected int32[B, Hsel, K] with Hsel in {Hq, KVH},
    or None for dense decode.
    """
    _check_float("q", q)
    check_page_scales(k_pages, k_scale, v_scale)
    if q.ndim != 3:
        raise _shape_error("q", q, "[B, Hq, D]")
    if k_pages.ndim != 3:
        raise _shape_error("k_pages", k_pages, "[num_pages, page_size, head_dim]")
    if v_pages.shape != k_pages.shape:
        raise _shape_error("v_pages", v_pages, f"{tuple(k_pages.shape)} (the shape of k_pages)")
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages must have the dtype of k_pages ({k_pages.dtype}), got {v_pages.dtype}")
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, page_head_dim = k_pages.shape
    if page_head_dim != head_dim:
        raise ValueError(f"k_pages.shape[2] (head_dim, {page_head_dim}) must equal q.shape[2] ({head_dim})")
    check_page_size(page_size, strict=strict_page_size)
    if page_table.ndim != 3:
        raise _shape_error("page_table", page_table, "[B, KVH, max_pages]")
    num_kv_heads = page_table.shape[1]
    max_pages = check_tables(page_table, lengths, batch, num_kv_heads)
    check_q_heads(q, num_kv_heads)
    if selected is None:
        num_sel_heads, num_selected = num_kv_heads, 0
    else:
        _check_int32("selected", selected)
        if selected.ndim != 3 or selected.shape[0] != batch or selected.shape[1] not in (num_q_heads, num_kv_heads):
            raise _shape_error(
                "selected", selected, f"[B={batch}, Hq={num_q_heads} or KVH={num_kv_heads}, K]"
            )
        num_sel_heads, num_selected = selected.shape[1], selected.shape[2]
    return DecodeDims(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        max_pages=max_pages,
        num_sel_heads=num_sel_heads,
        num_selected=num_selected,
    )


@dataclasses.dataclass(frozen=True)
class ScoreDims:
    """Static sizes of one Quest scoring call."""

    batch: int  # B
    num_q_heads: int  # Hq
    num_kv_heads: int  # KVH
    head_dim: int  # D
    num_pages: int  # N
    max_pages: int  # P

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def check_score_inputs(q, kmin, kmax, page_table, lengths) -> ScoreDims:
    """Validate Quest scoring inputs: q [B, Hq, D]; kmin, kmax [N, D]; page_table int32[B, KVH, P];
    lengths int32[B, KVH]. Returns `ScoreDims`."""
    _check_float("q", q)
    _check_float("kmin", kmin)
    if q.ndim != 3:
        raise _shape_error("q", q, "[B, Hq, D]")
    if kmin.ndim != 2 or kmin.shape[1] != q.shape[2]:
        raise _shape_error("kmin", kmin, f"[num_pages, head_dim={q.shape[2]}]")
    if kmax.shape != kmin.shape:
        raise _shape_error("kmax", kmax, f"{tuple(kmin.shape)} (the shape of kmin)")
    if kmax.dtype != kmin.dtype:
        raise TypeError(f"kmax must have the dtype of kmin ({kmin.dtype}), got {kmax.dtype}")
    if page_table.ndim != 3:
        raise _shape_error("page_table", page_table, "[B, KVH, max_pages]")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = page_table.shape[1]
    max_pages = check_tables(page_table, lengths, batch, num_kv_heads)
    check_q_heads(q, num_kv_heads)
    return ScoreDims(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=kmin.shape[0],
        max_pages=max_pages,
    )


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    """Softmax scale: 1/sqrt(D) by default."""
    if sm_scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    return float(sm_scale)
