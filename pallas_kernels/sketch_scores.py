"""Page scores from a per-slot key sketch: the best approximate q.k over a page's slots.

Notes: docs/modules.md (`pallas_kernels/sketch_scores.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax import lax

from . import _pages
from ._backend import default_backend_for, resolve_backend, resolve_interpret
from ._quant import page_values
from .quest_scores_xla import finish_scores, scoreable_pages

__all__ = ["CODE_KINDS", "pack_int4", "sketch_page_scores", "sketch_page_scores_reference", "sketch_page_scores_xla",
           "unpack_int4", "unpack_int4_x16"]

CODE_KINDS = ("float", "int4")


def pack_int4(codes: jax.Array) -> jax.Array:
    """int8[..., R] from integer codes `[..., 2R]` in [-8, 7]: channel j in the low nibble of byte j,
    channel j + R in its high nibble."""
    codes = codes.astype(jnp.int32)
    half = codes.shape[-1] // 2
    return ((codes[..., :half] & 15) | (codes[..., half:] << 4)).astype(jnp.int8)


def unpack_int4(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(low, high) int8 codes `[..., R]` of `int8[..., R]` packed by `pack_int4` (sign-extended nibbles, by
    arithmetic shifts of the bytes themselves: no wider integer copy)."""
    return jnp.left_shift(packed, 4) >> 4, packed >> 4


def check_sketch_inputs(q, codes, page_table, lengths, codes_kind: str):
    if codes_kind not in CODE_KINDS:
        raise ValueError(f"codes_kind must be one of {CODE_KINDS}, got {codes_kind!r}")
    if q.ndim != 3 or codes.ndim != 3 or page_table.ndim != 3 or lengths.shape != page_table.shape[:2]:
        raise ValueError(
            f"expected q [B, Hq, R'], codes [N, ps, R], page_table [B, KVH, P], lengths [B, KVH]; got "
            f"{q.shape}, {codes.shape}, {page_table.shape}, {lengths.shape}"
        )
    width = codes.shape[-1] * (2 if codes_kind == "int4" else 1)
    if q.shape[-1] != width:
        raise ValueError(f"q's last axis must be {width} for {codes_kind!r} codes of width {codes.shape[-1]}, got {q.shape[-1]}")
    if codes_kind == "int4" and codes.dtype != jnp.int8:
        raise TypeError(f"int4 codes are packed in int8, got {codes.dtype}")
    if q.shape[1] % page_table.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({page_table.shape[1]})")


def slot_scores(q_groups, rows, codes_kind: str):
    """q_groups `[..., G, R']` against sketch rows `[..., S, R]`: f32[..., G, S]."""
    q_groups = q_groups.astype(jnp.float32)
    if codes_kind == "int4":
        low, high = (x.astype(jnp.float32) for x in unpack_int4(rows))
        half = rows.shape[-1]
        return (jnp.einsum("...gr,...sr->...gs", q_groups[..., :half], low, precision="highest")
                + jnp.einsum("...gr,...sr->...gs", q_groups[..., half:], high, precision="highest"))
    return jnp.einsum("...gr,...sr->...gs", q_groups, page_values(rows).astype(jnp.float32), precision="highest")


def sketch_page_scores_reference(q, codes, page_table, lengths, *, page_size: int, codes_kind: str = "float",
                                 per_kv_head: bool = False):
    """Oracle for `sketch_page_scores`: every logical page's slots gathered and scored, then masked."""
    check_sketch_inputs(q, codes, page_table, lengths, codes_kind)
    B, Hq, _ = q.shape
    KVH, P = page_table.shape[1:]
    pages = jnp.clip(page_table, 0, codes.shape[0] - 1)
    rows = codes[pages].reshape(B, KVH, P * page_size, codes.shape[-1])  # [B, KVH, P*ps, R]
    scores = slot_scores(q.reshape(B, KVH, Hq // KVH, -1), rows, codes_kind)  # [B, KVH, G, P*ps]
    scores = scores.reshape(B, KVH, Hq // KVH, P, page_size).max(axis=-1)
    valid = scoreable_pages(lengths, P, page_size)[:, :, None]
    return finish_scores(jnp.where(valid, scores, -jnp.inf), per_kv_head)


def unpack_int4_x16(packed: jax.Array) -> jax.Array:
    """int8[..., 2R] of `int8[..., R]` packed by `pack_int4`: 16 x (low | high) codes, each nibble moved to
    its byte's top (`byte << 4`, `byte & 0xF0`), four bytes a 32-bit word (no byte shifts); R % 4 == 0."""
    if packed.shape[-1] % 4:
        raise ValueError(f"packed codes' last axis must be a multiple of 4 bytes, got {packed.shape}")
    words = lax.bitcast_convert_type(packed.reshape(*packed.shape[:-1], -1, 4), jnp.int32)
    high_nibbles = jnp.int32(-0x0F0F0F10)  # 0xF0F0F0F0: a nibble shifted out of its byte is dropped
    both = jnp.concatenate([(words << 4) & high_nibbles, words & high_nibbles], -1)
    return lax.bitcast_convert_type(both, jnp.int8).reshape(*packed.shape[:-1], -1)


def sketch_page_scores_xla(q, codes, page_table, lengths, *, page_size: int, codes_kind: str = "float",
                           pages_per_block: int | None = None):
    """The CPU path, f32[B, KVH, G, P]: the pages scored a block at a time in a scan, each block's code rows
    decoded (in cache) and reduced to page maxima at once; the reference decodes every slot of the context to
    float32 first (64 MiB a layer for int4 codes at 8K tokens and 16 heads of 128). Grouped int4 scores
    (G > 1, R % 4 == 0) feed 16 x codes as int8 to one product with q / 16 (~1 MiB blocks); float32 rows otherwise
    (~2 MiB blocks). Form and sizes as measured: docs/modules.md."""
    B, Hq, width = q.shape
    KVH, P = page_table.shape[1:]
    rows, group = B * KVH, Hq // KVH
    int8_rows = codes_kind == "int4" and group > 1 and codes.shape[-1] % 4 == 0
    if pages_per_block is None:  # ~1 MiB of int8 rows or ~2 MiB of float32 rows per step
        per_page, budget = rows * page_size * width, 1 << 20
        if not int8_rows:
            per_page, budget = per_page * 4, 2 << 20
        pages_per_block = max(1, min(1024, budget // per_page))
    pages_per_block = _pages.cdiv(P, _pages.cdiv(P, min(pages_per_block, P)))  # even blocks, least padding
    num_blocks = _pages.cdiv(P, pages_per_block)
    pages = jnp.clip(page_table, 0, codes.shape[0] - 1).reshape(rows, P)
    pages = _pages.pad_axis(pages, num_blocks * pages_per_block, axis=1, value=0)
    page_blocks = jnp.swapaxes(pages.reshape(rows, num_blocks, pages_per_block), 0, 1)  # [nblk, R, nb]
    q_rows = q.astype(jnp.float32).reshape(rows, group, width)
    if int8_rows:
        q_rows = q_rows * (1 / 16)  # exact: a power of two, against 16 x codes

    def score_block(carry, block_pages):
        block = codes.at[block_pages].get(mode="promise_in_bounds")  # [R, nb, ps, W]
        block = block.reshape(rows, pages_per_block * page_size, -1)
        if int8_rows:  # slots as the product's rows: XLA:CPU fuses the int8 -> f32 convert, dot and page max
            scores = jnp.einsum("rsc,rgc->rsg", unpack_int4_x16(block), q_rows, precision="highest")
            return carry, jnp.swapaxes(scores.reshape(rows, pages_per_block, page_size, group).max(axis=2), 1, 2)
        scores = slot_scores(q_rows, block, codes_kind)
        return carry, scores.reshape(rows, group, pages_per_block, page_size).max(axis=-1)

    _, scores = lax.scan(score_block, None, page_blocks)  # [nblk, R, G, nb]
    scores = jnp.moveaxis(scores, 0, 2).reshape(rows, group, -1)[..., :P].reshape(B, KVH, group, P)
    valid = scoreable_pages(lengths, P, page_size)[:, :, None]
    return jnp.where(valid, scores, -jnp.inf)


def sketch_page_scores(
    q,  # [B, Hq, R']  the query in the sketch's space
    codes,  # [N, ps, R]  one sketch row per slot
    page_table,  # int32[B, KVH, P]; -1 = unallocated
    lengths,  # int32[B, KVH]; >= 1
    *,
    page_size: int,
    codes_kind: str = "float",
    per_kv_head: bool = False,
    backend=None,
    interpret=None,
):
    """Sketch score of every logical page: f32[B, Hq, P] (or [B, KVH, P], max over the group, with
    `per_kv_head`); -inf past the used pages and at the current page. Backends as `quest_page_scores`: "xla"
    (the CPU default) scores a block of pages at a time (`sketch_page_scores_xla`); "pallas_tpu" and
    "pallas_gpu" gather the pages' rows in the kernel; "pallas_mosaic_gpu" TMA-copies blocks of 64 slots
    and writes their pages' maxima (never the default: correct on an H200, never timed)."""
    if backend is None:
        backend = default_backend_for(
            sketch_page_scores, dict(q=q, codes=codes, page_table=page_table, lengths=lengths),
            dict(page_size=page_size, codes_kind=codes_kind, per_kv_head=per_kv_head), interpret,
        )
    backend = resolve_backend(backend)
    if backend == "reference":
        return sketch_page_scores_reference(
            q, codes, page_table, lengths, page_size=page_size, codes_kind=codes_kind, per_kv_head=per_kv_head
        )
    check_sketch_inputs(q, codes, page_table, lengths, codes_kind)
    if backend == "xla":
        scores = sketch_page_scores_xla(q, codes, page_table, lengths, page_size=page_size, codes_kind=codes_kind)
        return finish_scores(scores, per_kv_head)
    if backend == "pallas_mosaic_gpu":
        from .sketch_scores_mosaic_gpu import sketch_scores_mosaic_gpu

        scores = sketch_scores_mosaic_gpu(q, codes, page_table, lengths, page_size=page_size, codes_kind=codes_kind,
                                          interpret=resolve_interpret(backend, interpret))
        return finish_scores(scores, per_kv_head)
    if backend == "pallas_tpu":
        from .sketch_scores_tpu import sketch_scores_tpu as kernel
    else:
        from .sketch_scores_gpu import sketch_scores_gpu as kernel
    scores = kernel(q, codes, page_table, lengths, page_size=page_size, codes_kind=codes_kind,
                    interpret=resolve_interpret(backend, interpret))
    return finish_scores(scores, per_kv_head)
