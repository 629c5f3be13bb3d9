"""The paged KV state: an immutable pytree of single-head pages, page tables and allocation bookkeeping,
and the operations that allocate, write and read it inside `jit`.

Notes: docs/modules.md (`kvjax/cache/state.py`)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.models.config import ModelConfig
from kvjax.pallas_kernels import (
    BFLOAT16_BITS,
    bfloat16_bits,
    dequantize,
    is_bfloat16_bits,
    page_values,
    quantize_int8,
)

# overflow[0] codes
OVERFLOW_NONE, OVERFLOW_POOL, OVERFLOW_TABLE = 0, 1, 2


class CacheCapacityError(RuntimeError):
    """The KV cache cannot hold what a step or a request needs. Says how many pages were needed and free."""

    def __init__(self, message: str, pages_needed: int, pages_available: int):
        super().__init__(message)
        self.pages_needed = pages_needed
        self.pages_available = pages_available


class KeySketch(NamedTuple):
    """Page metadata of a selector beyond Quest's bound (`kvjax.policies.key_sketch`): one row of `codes` per
    slot, and what the selector needs to sketch a new key (`params`, e.g. a projection per layer and head)."""

    codes: jax.Array  # [N, ps, R] one sketch row per slot (a low-rank projection, packed 4-bit codes, ...)
    params: Any = None  # pytree of arrays, read by the selector that attached the sketch


EMPTY_PAGE = {"kmin": np.inf, "kmax": -np.inf, "slot_pos": -1}  # what a free page's fields hold (others 0)


@struct.dataclass
class KVState:
    """Paged KV cache. N = num_pages, ps = page_size, D = head_dim, L = layers, B = batch, H = kv heads,
    P = max logical pages per (layer, sequence, head)."""

    k_pages: jax.Array  # [N, ps, D]   keys after RoPE, at their original positions (float, or int8 with scales;
    #                  bfloat16 pages on CPU as uint16 bit patterns: read them through `read_k`, `page_dtype`)
    v_pages: jax.Array  # [N, ps, D]
    kmin: jax.Array  # [N, D]        elementwise min of valid keys of the page (+inf when empty); for int8
    #                  pages the min of the dequantised keys, so Quest's bound holds for what attention reads
    kmax: jax.Array  # [N, D]        elementwise max (-inf when empty)
    slot_pos: jax.Array  # int32[N, ps]  original token position of each slot, -1 when empty
    slot_score: jax.Array  # f32[N, ps]  a policy's per-slot score (H2O's running sum, Locret's CIS)
    page_table: jax.Array  # int32[L, B, H, P]  physical page of each logical page, -1 when unallocated
    lengths: jax.Array  # int32[L, B, H]  valid slots per (layer, sequence, head)
    free_pages: jax.Array  # int32[N]  free stack: free_pages[:num_free] are free
    num_free: jax.Array  # int32[]
    refcount: jax.Array  # int32[N]  references to each page (0 = free)
    next_position: jax.Array  # int32[B]  position of the next token of each sequence
    overflow: jax.Array  # int32[3]  (code, pages needed, pages available) of the first failed step
    hole: jax.Array  # int32[L, B, H]  a slot below the length freed by decode-time eviction, -1 if none;
    #                  the next appended token fills it, so eviction never writes the K/V pool
    k_scale: jax.Array | None = None  # f32[N, ps]  int8 pages: each slot's scale (value = int8 * scale), else None
    v_scale: jax.Array | None = None  # f32[N, ps]
    # A per-slot sketch of the keys that a selector scores pages from (`KeySketch`), or None: absent unless a
    # selector attaches one after prefill; `append_to_layer` writes new tokens' rows when given them.
    key_sketch: "KeySketch | None" = None
    long_rope: bool = struct.field(pytree_node=False, default=False)  # LongRoPE factor set, fixed at prefill
    # Logical pages attention reads per layer (static), after a policy bounded the layer; None = all.
    read_pages: tuple | None = struct.field(pytree_node=False, default=None)

    def layer_read_pages(self, layer) -> int:
        """Logical pages attention reads in `layer` (static). Inside a scan over layers `layer` is traced:
        then every layer must read the same number (`for_layers` makes it so for a segment)."""
        if self.read_pages is None:
            return self.max_pages
        if isinstance(layer, (int, np.integer)):
            return self.read_pages[layer]
        if len(set(self.read_pages)) != 1:
            raise ValueError(
                f"a traced layer index needs one read bound for every layer, got {self.read_pages}: scan layers "
                "in segments of equal bounds and use KVState.for_layers(start, stop)"
            )
        return self.read_pages[0]

    def for_layers(self, start: int, stop: int) -> "KVState":
        """This state as layers `start .. stop - 1` read it: their common read bound for every layer, so
        their ops accept a traced layer index. Restore `read_pages` before the state leaves the segment."""
        if self.read_pages is None:
            return self
        bounds = set(self.read_pages[start:stop])
        if len(bounds) != 1:
            raise ValueError(f"layers {start}..{stop - 1} read different page counts {self.read_pages[start:stop]}")
        return self.replace(read_pages=(bounds.pop(),) * len(self.read_pages))

    @property
    def quantized(self) -> bool:
        """Whether pages hold int8 values with per-slot scales (`kvjax.pallas_kernels.quantize_int8`)."""
        return self.k_scale is not None

    @property
    def page_dtype(self):
        """The pages' dtype: float32, bfloat16 or int8 (bfloat16 also when held as uint16 bit patterns, the
        layout `init_state` picks on CPU)."""
        return jnp.dtype(jnp.bfloat16) if is_bfloat16_bits(self.k_pages) else jnp.dtype(self.k_pages.dtype)

    def read_k(self, pages: jax.Array) -> jax.Array:
        """Keys of physical `pages [...]`, `[..., ps, D]`: in the pages' dtype, or float32 dequantised from
        int8 pages."""
        k = page_values(self.k_pages[pages])
        return k if self.k_scale is None else dequantize(k, self.k_scale[pages])

    def read_v(self, pages: jax.Array) -> jax.Array:
        """Values of physical `pages [...]`, as `read_k`."""
        v = page_values(self.v_pages[pages])
        return v if self.v_scale is None else dequantize(v, self.v_scale[pages])

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[-2]  # counted from the end: also a stacked state's (kvjax.distributed), per shard

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[-3]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[-1]

    @property
    def capacity(self) -> int:
        """Most tokens one (layer, sequence, head) can hold."""
        return self.max_pages * self.page_size


def pages_for(num_slots, page_size: int):
    """Pages that `num_slots` slots occupy (ceil division; works on ints and arrays)."""
    return (num_slots + page_size - 1) // page_size


def init_state(
    cfg: ModelConfig,
    batch: int,
    capacity: int,
    page_size: int = 16,
    num_pages: int | None = None,
    dtype=jnp.float32,
    long_rope: bool = False,
) -> KVState:
    """An empty state for `batch` sequences of up to `capacity` tokens per (layer, head).

    `num_pages` defaults to what a full cache of that capacity needs (L * B * H * ceil(capacity/page_size));
    bounded policies may ask for fewer. `dtype` is the pages' dtype: float32, bfloat16, or int8 (symmetric,
    one float32 scale per slot; see `kvjax.pallas_kernels.quantize_int8`).
    """
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a positive power of two, got {page_size}")
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    max_pages = pages_for(capacity, page_size)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    if num_pages is None:
        num_pages = L * batch * H * max_pages
    N = num_pages
    quantized = jnp.dtype(dtype) == jnp.dtype(jnp.int8)
    meta_dtype = jnp.float32 if quantized else dtype
    stored = dtype
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and jax.default_backend() == "cpu":
        # XLA:CPU has no bfloat16 scatter: it converted the whole pool (and the metadata) to float32 and back
        # around every write. Held as uint16 bit patterns, the pool is written by integer scatters and read
        # through bitcasts of gathered blocks; the metadata is float32, exact for bfloat16 keys.
        stored, meta_dtype = BFLOAT16_BITS, jnp.float32
    return _empty_state(N, page_size, D, L, batch, H, max_pages, jnp.dtype(stored), jnp.dtype(meta_dtype), quantized,
                        long_rope)


@functools.partial(jax.jit, static_argnums=tuple(range(11)))
def _empty_state(N, page_size, D, L, batch, H, max_pages, stored, meta_dtype, quantized, long_rope) -> KVState:
    """`init_state`'s arrays, made by one program (one compile, or one read of the compilation cache, rather
    than one per array)."""
    return KVState(
        k_pages=jnp.zeros((N, page_size, D), stored),
        v_pages=jnp.zeros((N, page_size, D), stored),
        kmin=jnp.full((N, D), EMPTY_PAGE["kmin"], meta_dtype),
        kmax=jnp.full((N, D), EMPTY_PAGE["kmax"], meta_dtype),
        slot_pos=jnp.full((N, page_size), EMPTY_PAGE["slot_pos"], jnp.int32),
        slot_score=jnp.zeros((N, page_size), jnp.float32),
        page_table=jnp.full((L, batch, H, max_pages), -1, jnp.int32),
        lengths=jnp.zeros((L, batch, H), jnp.int32),
        # Pop from the top: page 0 is handed out first.
        free_pages=jnp.arange(N - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.asarray(N, jnp.int32),
        refcount=jnp.zeros((N,), jnp.int32),
        next_position=jnp.zeros((batch,), jnp.int32),
        overflow=jnp.zeros((3,), jnp.int32),
        hole=jnp.full((L, batch, H), -1, jnp.int32),
        k_scale=jnp.zeros((N, page_size), jnp.float32) if quantized else None,
        v_scale=jnp.zeros((N, page_size), jnp.float32) if quantized else None,
        long_rope=long_rope,
    )


def allocate_for_append(state: KVState, num_new: jax.Array, max_new_tokens: int) -> tuple[KVState, jax.Array]:
    """Allocate the pages every (layer, sequence, head) needs to append `num_new int32[B]` slots.

    `max_new_tokens` is a static bound on `num_new`. Returns the state and `ok` (bool[]); when not ok no
    page is taken, the page tables are unchanged and `state.overflow` records the first failure. Logical
    pages already in the table past a head's length (placed ahead by an allocator outside the step, as the
    batch engine's Jenga pool does) are used as they are: no page is taken from the free stack for them.
    """
    ps, N = state.page_size, state.num_pages
    L, B, H, P = state.page_table.shape
    # pages in use or placed ahead: a head's table is filled from its first logical page on
    used = jnp.maximum(pages_for(state.lengths, ps), jnp.sum(state.page_table >= 0, axis=-1))  # [L, B, H]
    fills_hole = ((state.hole >= 0) & (num_new[None, :, None] > 0)).astype(jnp.int32)
    new_used = pages_for(state.lengths + num_new[None, :, None] - fills_hole, ps)
    need = jnp.maximum(new_used - used, 0).reshape(-1)  # [L*B*H]
    total = jnp.sum(need)
    limit = jnp.asarray([state.layer_read_pages(l) for l in range(L)], jnp.int32)[:, None, None]
    fits_table = jnp.all(new_used <= limit)
    fits_pool = total <= state.num_free
    ok = fits_table & fits_pool

    M = pages_for(max_new_tokens, ps) + 1  # most new pages one head can need
    j = jnp.arange(M, dtype=jnp.int32)
    rank = (jnp.cumsum(need) - need)[:, None] + j[None, :]  # [LBH, M] order of each request
    take = (j[None, :] < need[:, None]) & ok
    source = jnp.clip(state.num_free - 1 - rank, 0, N - 1)
    page = jnp.where(take, state.free_pages[source], N)  # N = out of bounds, dropped by scatters
    logical = jnp.where(take, used.reshape(-1)[:, None] + j[None, :], P)
    rows = jnp.arange(L * B * H, dtype=jnp.int32)[:, None]
    page_table = state.page_table.reshape(L * B * H, P).at[rows, logical].set(page, mode="drop")

    page = page.reshape(-1)
    code = jnp.where(fits_table, OVERFLOW_POOL, OVERFLOW_TABLE)
    over = jnp.argmax(jnp.any(new_used > limit, axis=(1, 2)))  # first layer over its limit
    needed = jnp.where(fits_table, total, jnp.max(new_used[over]))
    available = jnp.where(fits_table, state.num_free, limit[over, 0, 0])
    first_failure = (~ok) & (state.overflow[0] == OVERFLOW_NONE)
    overflow = jnp.where(first_failure, jnp.stack([code, needed, available]).astype(jnp.int32), state.overflow)
    state = state.replace(
        page_table=page_table.reshape(L, B, H, P),
        num_free=jnp.where(ok, state.num_free - total, state.num_free),
        refcount=state.refcount.at[page].set(1, mode="drop"),
        kmin=state.kmin.at[page].set(EMPTY_PAGE["kmin"], mode="drop"),
        kmax=state.kmax.at[page].set(EMPTY_PAGE["kmax"], mode="drop"),
        slot_pos=state.slot_pos.at[page].set(EMPTY_PAGE["slot_pos"], mode="drop"),
        slot_score=state.slot_score.at[page].set(0.0, mode="drop"),
        overflow=overflow,
    )
    return state, ok


def _write_kv(state: KVState, page: jax.Array, offset: jax.Array, k: jax.Array, v: jax.Array):
    """Store `k, v [..., D]` at physical `(page, offset) [...]` (out-of-bounds pages are dropped) in the
    pages' layout: quantised with per-slot scales for int8 pages, as bit patterns for CPU bfloat16 pages.
    Returns the state and the keys attention will read back, in the metadata's dtype (what kmin/kmax bound)."""
    if state.quantized:
        k_stored, k_scale = quantize_int8(k)  # [..., D], [...]
        v_stored, v_scale = quantize_int8(v)
        k = dequantize(k_stored, k_scale)
        state = state.replace(
            k_scale=state.k_scale.at[page, offset].set(k_scale, mode="drop"),
            v_scale=state.v_scale.at[page, offset].set(v_scale, mode="drop"),
        )
    else:
        k = k_stored = k.astype(state.page_dtype)
        v_stored = v.astype(state.page_dtype)
        if is_bfloat16_bits(state.k_pages):
            k_stored, v_stored = bfloat16_bits(k_stored), bfloat16_bits(v_stored)
    state = state.replace(
        k_pages=state.k_pages.at[page, offset].set(k_stored, mode="drop"),
        v_pages=state.v_pages.at[page, offset].set(v_stored, mode="drop"),
    )
    return state, k.astype(state.kmin.dtype)


def append_to_layer(
    state: KVState, layer, k: jax.Array, v: jax.Array, positions: jax.Array, num_new: jax.Array,
    score: jax.Array | None = None, sketch: jax.Array | None = None,
) -> KVState:
    """Write the first `num_new[b]` tokens of `k, v [B, C, H, D]` (at `positions int32[B, C]`) after each
    head's last slot of `layer`, and keep `kmin`/`kmax` exact. Pages must have been allocated. `score
    f32[B, C, H]`, when given, becomes the new slots' `slot_score` (Locret); `sketch [B, C, H, R]` the new
    slots' rows of `key_sketch.codes`. int8 pages store each token quantised with its own scale, and
    `kmin`/`kmax` bound the dequantised keys."""
    ps, N = state.page_size, state.num_pages
    B, C, H, _ = k.shape
    lengths = state.lengths[layer]  # [B, H]
    hole = state.hole[layer]  # [B, H]
    c = jnp.arange(C, dtype=jnp.int32)[None, :, None]
    has_hole = (hole >= 0)[:, None, :]
    # the first new token fills a hole left by eviction; the rest append after the last slot
    slot = jnp.where(has_hole, jnp.where(c == 0, hole[:, None, :], lengths[:, None, :] + c - 1), lengths[:, None, :] + c)
    valid = c < num_new[:, None, None]
    logical = jnp.minimum(slot // ps, state.max_pages - 1)
    b_idx = jnp.arange(B)[:, None, None]
    h_idx = jnp.arange(H)[None, None, :]
    page = state.page_table[layer][b_idx, h_idx, logical]
    page = jnp.where(valid & (page >= 0), page, N)  # [B, C, H]
    offset = slot % ps
    if score is not None:
        state = state.replace(slot_score=state.slot_score.at[page, offset].set(score.astype(jnp.float32), mode="drop"))
    if sketch is not None and state.key_sketch is not None:
        codes = state.key_sketch.codes.at[page, offset].set(sketch.astype(state.key_sketch.codes.dtype), mode="drop")
        state = state.replace(key_sketch=state.key_sketch._replace(codes=codes))
    state, k = _write_kv(state, page, offset, k, v)
    return state.replace(
        kmin=state.kmin.at[page].min(k, mode="drop"),
        kmax=state.kmax.at[page].max(k, mode="drop"),
        slot_pos=state.slot_pos.at[page, offset].set(jnp.broadcast_to(positions[:, :, None], page.shape), mode="drop"),
        lengths=state.lengths.at[layer].add(num_new[:, None] - ((hole >= 0) & (num_new[:, None] > 0))),
        hole=state.hole.at[layer].set(jnp.where(num_new[:, None] > 0, -1, hole)),
    )


def gather_layer(state: KVState, layer):
    """One layer's slots in logical order: k, v `[B, H, S, D]`, slot positions `int32[B, H, S]` and a
    validity mask `bool[B, H, S]` (S = read pages * page_size). Reads the layer's `read_pages`."""
    pt = jnp.clip(state.page_table[layer, :, :, : state.layer_read_pages(layer)], 0, state.num_pages - 1)  # [B, H, P]
    B, H, P = pt.shape
    S = P * state.page_size
    k = state.read_k(pt).reshape(B, H, S, -1)
    v = state.read_v(pt).reshape(B, H, S, -1)
    pos = state.slot_pos[pt].reshape(B, H, S)
    valid = (jnp.arange(S, dtype=jnp.int32)[None, None, :] < state.lengths[layer][:, :, None]) & (pos >= 0)
    return k, v, pos, valid


def page_minmax(state: KVState, pages: jax.Array, num_valid: jax.Array):
    """Exact (kmin, kmax) `[..., D]` of `pages [...]` over their first `num_valid [...]` slots (of the keys
    attention reads: dequantised when the pages are int8)."""
    k = state.read_k(jnp.clip(pages, 0, state.num_pages - 1))  # [..., ps, D]
    valid = jnp.arange(k.shape[-2])[None, :] < num_valid.reshape(-1)[:, None]
    valid = valid.reshape(num_valid.shape + (k.shape[-2], 1))
    return jnp.min(jnp.where(valid, k, jnp.inf), axis=-2), jnp.max(jnp.where(valid, k, -jnp.inf), axis=-2)


def write_slots(state: KVState, layer, slots: jax.Array, k: jax.Array, v: jax.Array) -> KVState:
    """Overwrite the K/V of existing logical `slots int32[B, n]` (the same slots in every head) of `layer`
    with `k, v [B, n, H, D]`, and recompute the layer's `kmin`/`kmax` exactly. Positions, lengths and scores
    are unchanged. How a RAG context recomputes some of its reused slots in place (`kvjax.rag.selective`). The
    layer must have no eviction hole (`hole`): the min/max counts every slot below the length."""
    if state.key_sketch is not None:
        raise ValueError("write_slots does not rewrite key-sketch rows: attach a selector's sketch after the writes")
    ps = state.page_size
    B, n, H, _ = k.shape
    table = state.page_table[layer]  # [B, H, P]
    page = table[jnp.arange(B)[:, None, None], jnp.arange(H)[None, None, :], (slots // ps)[:, :, None]]  # [B, n, H]
    real = (page >= 0) & (slots[:, :, None] < state.lengths[layer][:, None, :])
    page = jnp.where(real, page, state.num_pages)
    state, _ = _write_kv(state, page, jnp.broadcast_to((slots % ps)[:, :, None], page.shape), k, v)
    filled = jnp.clip(state.lengths[layer][:, :, None] - jnp.arange(table.shape[-1]) * ps, 0, ps)  # [B, H, P]
    kmin, kmax = page_minmax(state, table, filled)
    held = jnp.where((table >= 0) & (filled > 0), table, state.num_pages)
    return state.replace(kmin=state.kmin.at[held].set(kmin, mode="drop"), kmax=state.kmax.at[held].set(kmax, mode="drop"))


def overflow_error(state: KVState) -> CacheCapacityError | None:
    """The host-side error for a state whose step overflowed, or None. (Reads `overflow`: a device sync.)"""
    code, needed, available = (int(x) for x in jax.device_get(state.overflow))
    if code == OVERFLOW_NONE:
        return None
    if code == OVERFLOW_POOL:
        msg = (
            f"KV cache pool is full: a step needed {needed} new pages of {state.page_size} slots, "
            f"{available} of {state.num_pages} were free"
        )
    else:
        msg = (
            f"a sequence outgrew its page table: it needed {needed} pages per (layer, head), capacity is "
            f"{available} pages ({available * state.page_size} tokens) for that layer; pass a larger capacity "
            "(or max_new_tokens, which sizes the pages a compressed layer may still grow into)"
        )
    return CacheCapacityError(msg, needed, available)


def _slot_cells(state: KVState, layer):
    """(page, offset) `int32[B, H, S]` of the layer's slots in `gather_layer`'s order; slots past a head's
    length point at page `num_pages` (dropped by a `mode="drop"` write)."""
    P = state.layer_read_pages(layer)
    table = state.page_table[layer, :, :, :P]
    S = P * state.page_size
    page = jnp.repeat(table, state.page_size, axis=-1)  # [B, H, S]
    valid = jnp.arange(S)[None, None, :] < state.lengths[layer][:, :, None]
    page = jnp.where(valid & (page >= 0), page, state.num_pages)
    return page, jnp.broadcast_to(jnp.arange(S) % state.page_size, page.shape)


def add_slot_scores(state: KVState, layer, delta: jax.Array) -> KVState:
    """Add `delta f32[B, H, S]` (in `gather_layer`'s slot order) to the layer's `slot_score`."""
    page, offset = _slot_cells(state, layer)
    return state.replace(slot_score=state.slot_score.at[page, offset].add(delta, mode="drop"))


def set_slot_scores(state: KVState, layer, scores: jax.Array) -> KVState:
    """Set the layer's `slot_score` to `scores f32[B, H, S]` (in `gather_layer`'s slot order)."""
    page, offset = _slot_cells(state, layer)
    return state.replace(slot_score=state.slot_score.at[page, offset].set(scores.astype(jnp.float32), mode="drop"))


__all__ = [
    "CacheCapacityError",
    "EMPTY_PAGE",
    "KVState",
    "KeySketch",
    "allocate_for_append",
    "append_to_layer",
    "gather_layer",
    "init_state",
    "overflow_error",
    "page_minmax",
    "pages_for",
    "set_slot_scores",
    "write_slots",
]
