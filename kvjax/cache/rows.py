"""Rows of a batch state: place a prefilled sequence at host-chosen pages (`place_row`), clear a finished one.

Notes: docs/modules.md (`kvjax/cache/rows.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.compaction import push_free
from kvjax.cache.state import OVERFLOW_NONE, OVERFLOW_POOL, KeySketch, KVState, _empty_state

# per-page fields copied with a page (the scales only exist for int8 pages)
_PAGE_FIELDS = ("k_pages", "v_pages", "kmin", "kmax", "slot_pos", "slot_score", "k_scale", "v_scale")


def pages_held(state: KVState, row: int = 0) -> int:
    """Pages sequence `row` of `state` holds over all layers and heads (a small device read)."""
    return int(np.sum(np.asarray(state.page_table[:, row]) >= 0))


@functools.partial(jax.jit, donate_argnames=("batch",))
def insert_row(batch: KVState, row: KVState, slot: jax.Array, share_from: jax.Array = -1,
               shared_pages: jax.Array = 0) -> KVState:
    """Copy sequence 0 of `row` (a one-sequence state of the same model, page size and page dtype) into row
    `slot` (int32[], a row holding no pages) of `batch`, on pages taken from `batch`'s free stack: K/V (and
    scales), min/max, positions, scores, lengths, the eviction hole and the next position. A narrower row
    table is padded; a wider one is cut to `batch`'s width, so its pages past that width must be empty
    (`narrow_row` relies on it). When the pool has too few free pages nothing is copied and `overflow`
    records it (check `pages_held(row)` against `batch.num_free` first). Donates `batch`.

    Prefix sharing: with `share_from` (int32[], a live row of `batch`) and `shared_pages` (int32[]), the
    first `shared_pages` logical pages of every (layer, head) are not copied but point at `share_from`'s
    physical pages, whose refcounts grow by one; the caller guarantees those pages hold the same slots
    (the same whole-page prefix, prefilled the same way) and that no policy rewrites them.

    A selector's key sketch (`row.key_sketch`) travels with the row: its codes with the pages, its fit into
    row `slot` of the batch's params; a batch without one gets an empty sketch of the row's shapes first."""
    N = batch.num_pages
    L, _, H, Pr = row.page_table.shape
    bL, _, bH, P = batch.page_table.shape
    if (bL, bH) != (L, H) or batch.page_size != row.page_size:
        raise ValueError(f"a row of page table {row.page_table.shape} and page size {row.page_size} does not fit a "
                         f"batch of {batch.page_table.shape} and page size {batch.page_size}")
    if batch.k_pages.dtype != row.k_pages.dtype:
        raise ValueError(f"row pages are {row.k_pages.dtype}, the batch's {batch.k_pages.dtype}")
    table = row.page_table[:, 0, :, :P]
    table = jnp.pad(table, ((0, 0), (0, 0), (0, P - table.shape[-1])), constant_values=-1)  # [L, H, P]
    source = batch.page_table[:, jnp.clip(share_from, 0, batch.page_table.shape[1] - 1)]  # [L, H, P]
    shared = (table >= 0) & (jnp.arange(P) < shared_pages) & (share_from >= 0) & (source >= 0)
    table, shared, source = table.reshape(-1), shared.reshape(-1), source.reshape(-1)  # [L*H*P]
    held = (table >= 0) & ~shared  # pages to copy
    need = jnp.sum(held)
    ok = need <= batch.num_free
    rank = jnp.cumsum(held) - 1
    taken = batch.free_pages[jnp.clip(batch.num_free - 1 - rank, 0, N - 1)]
    dst = jnp.where(held & ok, taken, N)  # N: out of bounds, dropped
    src = jnp.clip(table, 0, row.num_pages - 1)
    copies = {
        name: getattr(batch, name).at[dst].set(getattr(row, name)[src], mode="drop")
        for name in _PAGE_FIELDS
        if getattr(batch, name) is not None
    }
    new_table = jnp.where(shared, source, jnp.where(held, dst, -1)).reshape(L, H, P)
    first_failure = ~ok & (batch.overflow[0] == OVERFLOW_NONE)
    overflow = jnp.where(first_failure, jnp.stack([OVERFLOW_POOL, need, batch.num_free]).astype(jnp.int32),
                         batch.overflow)
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    sketch = _inserted_sketch(batch, row, dst, src, slot, keep)
    refcount = batch.refcount.at[dst].set(1, mode="drop")
    refcount = refcount.at[jnp.where(shared & ok, source, N)].add(1, mode="drop")
    return batch.replace(
        **copies,
        key_sketch=sketch,
        page_table=batch.page_table.at[:, slot].set(keep(new_table, batch.page_table[:, slot])),
        lengths=batch.lengths.at[:, slot].set(keep(row.lengths[:, 0], batch.lengths[:, slot])),
        hole=batch.hole.at[:, slot].set(keep(row.hole[:, 0], batch.hole[:, slot])),
        next_position=batch.next_position.at[slot].set(keep(row.next_position[0], batch.next_position[slot])),
        refcount=refcount,
        num_free=batch.num_free - jnp.where(ok, need, 0),
        overflow=overflow,
    )


def _reset_pages(batch: KVState, pages: jax.Array) -> KVState:
    """`batch` with the metadata of `pages int32[K]` (N = none) emptied, as `allocate_for_append` leaves a
    page it takes: no slot, an empty min/max, no score."""
    return batch.replace(
        kmin=batch.kmin.at[pages].set(jnp.inf, mode="drop"), kmax=batch.kmax.at[pages].set(-jnp.inf, mode="drop"),
        slot_pos=batch.slot_pos.at[pages].set(-1, mode="drop"),
        slot_score=batch.slot_score.at[pages].set(0.0, mode="drop"),
    )


@functools.partial(jax.jit, donate_argnames=("batch",))
def place_row(batch: KVState, row: KVState, slot: jax.Array, table: jax.Array, copy: jax.Array,
              fresh: jax.Array) -> KVState:
    """Put sequence 0 of `row` into row `slot` (int32[]) of `batch` on pages chosen outside (the batch
    engine's Jenga pool): `table int32[L, H, P]` is the row's page table in `batch` (-1: none), `copy
    bool[L, H, P]` marks the logical pages whose slots are copied from `row`'s page at the same place (the
    others are shared pages already holding them, or pages placed ahead for growth), and `fresh int32[K]`
    lists the pages new to the row (padded with `batch.num_pages`), whose metadata is emptied first. Copies
    what `insert_row` copies; the free stack and refcounts are not used. Donates `batch`."""
    N, P = batch.num_pages, batch.max_pages
    if batch.page_table.shape[0] != row.page_table.shape[0] or batch.page_size != row.page_size:
        raise ValueError(f"a row of page table {row.page_table.shape} and page size {row.page_size} does not fit a "
                         f"batch of {batch.page_table.shape} and page size {batch.page_size}")
    if batch.k_pages.dtype != row.k_pages.dtype:
        raise ValueError(f"row pages are {row.k_pages.dtype}, the batch's {batch.k_pages.dtype}")
    source = row.page_table[:, 0, :, :P]
    source = jnp.pad(source, ((0, 0), (0, 0), (0, P - source.shape[-1])), constant_values=-1).reshape(-1)
    moved = copy.reshape(-1) & (source >= 0) & (table.reshape(-1) >= 0)
    dst = jnp.where(moved, table.reshape(-1), N)
    src = jnp.clip(source, 0, row.num_pages - 1)
    batch = _reset_pages(batch, fresh)
    copies = {name: getattr(batch, name).at[dst].set(getattr(row, name)[src], mode="drop")
              for name in _PAGE_FIELDS if getattr(batch, name) is not None}
    keep = lambda new, old: new  # noqa: E731
    return batch.replace(
        **copies,
        key_sketch=_inserted_sketch(batch, row, dst, src, slot, keep),
        page_table=batch.page_table.at[:, slot].set(table),
        lengths=batch.lengths.at[:, slot].set(row.lengths[:, 0]),
        hole=batch.hole.at[:, slot].set(row.hole[:, 0]),
        next_position=batch.next_position.at[slot].set(row.next_position[0]),
    )


@functools.partial(jax.jit, donate_argnames=("batch",))
def place_pages(batch: KVState, table: jax.Array, fresh: jax.Array) -> KVState:
    """`batch` with page table `table int32[L, B, H, P]` (pages placed ahead for the next steps' tokens)
    and the metadata of its `fresh int32[K]` pages (padded with `batch.num_pages`) emptied. Donates `batch`."""
    return _reset_pages(batch, fresh).replace(page_table=table)


@functools.partial(jax.jit, donate_argnames=("batch",))
def clear_row(batch: KVState, slot: jax.Array) -> KVState:
    """Empty row `slot` (int32[]) without touching its pages: whoever placed them takes them back."""
    return batch.replace(
        page_table=batch.page_table.at[:, slot].set(-1),
        lengths=batch.lengths.at[:, slot].set(0),
        hole=batch.hole.at[:, slot].set(-1),
        next_position=batch.next_position.at[slot].set(0),
    )


def _inserted_sketch(batch: KVState, row: KVState, dst, src, slot, keep) -> KeySketch | None:
    """`batch`'s key sketch with sequence 0 of `row`'s copied in: code rows of the copied pages at `dst`,
    the row's fit (params `[L, 1, H, ...]`) at `slot` (params `[L, B, H, ...]`)."""
    if row.key_sketch is None:
        return batch.key_sketch
    sketch = batch.key_sketch
    if sketch is None:
        codes = row.key_sketch.codes
        widen = lambda x: jnp.zeros((x.shape[0], batch.page_table.shape[1], *x.shape[2:]), x.dtype)  # noqa: E731
        sketch = KeySketch(jnp.zeros((batch.num_pages, *codes.shape[1:]), codes.dtype),
                           jax.tree.map(widen, row.key_sketch.params))
    codes = sketch.codes.at[dst].set(row.key_sketch.codes[src], mode="drop")
    params = jax.tree.map(lambda b, r: b.at[:, slot].set(keep(r[:, 0], b[:, slot])), sketch.params,
                          row.key_sketch.params)
    return KeySketch(codes, params)


def empty_like(state: KVState, batch: int, max_pages: int, num_pages: int) -> KVState:
    """An empty state with `state`'s layers, heads, page size and page dtype, for `batch` sequences of
    `max_pages` logical pages per (layer, head) on a pool of `num_pages` pages."""
    L, _, H, _ = state.page_table.shape
    # init_state's one program (its k_scale and v_scale two buffers: `insert_row` donates the state)
    return _empty_state(num_pages, state.page_size, state.k_pages.shape[-1], L, batch, H, max_pages,
                        state.k_pages.dtype, state.kmin.dtype, state.k_scale is not None, state.long_rope)


def narrow_row(state: KVState) -> KVState:
    """A copy of one-sequence `state` on a pool of exactly the pages it holds, its table as wide as its
    longest (layer, head) needs: what a prefix cache keeps of a prefill (`kvjax.serving.prefix_states`).
    `insert_row` puts it back into a full-width state. Static read bounds are dropped."""
    lengths = np.asarray(state.lengths[:, 0])
    width = max(1, -(-int(lengths.max()) // state.page_size))
    held = pages_held(state)
    if np.asarray(state.page_table[:, 0, :, width:] >= 0).any():
        raise ValueError(f"the state holds pages past its longest length's {width} pages (a hole-filled or "
                         "compacted row): narrow_row copies prefills only")
    return insert_row(empty_like(state, 1, width, max(held, 1)), state.replace(read_pages=None), jnp.int32(0))


@functools.partial(jax.jit, donate_argnames=("batch",))
def release_row(batch: KVState, slot: jax.Array) -> KVState:
    """Drop row `slot`'s (int32[]) reference to each of its pages, return those no other row shares to the
    free stack, and empty the row. Donates `batch`."""
    table = batch.page_table[:, slot].reshape(-1)  # [L*H*P]
    held = table >= 0
    N = batch.num_pages
    refcount = batch.refcount.at[jnp.where(held, table, N)].add(-1, mode="drop")
    batch = push_free(batch.replace(refcount=refcount), table, held & (refcount[jnp.clip(table, 0, N - 1)] <= 0))
    return clear_row(batch, slot)


__all__ = ["clear_row", "empty_like", "insert_row", "narrow_row", "pages_held", "place_pages", "place_row",
           "release_row"]
