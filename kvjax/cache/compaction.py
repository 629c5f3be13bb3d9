"""Real eviction: keep chosen slots, move them to each head's first pages, free the rest.

Notes: docs/modules.md (`kvjax/cache/compaction.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.state import KVState, page_minmax, pages_for


def push_free(state: KVState, pages: jax.Array, release: jax.Array) -> KVState:
    """Return `pages` (any shape) where `release` holds to the free stack; refcounts drop to 0."""
    N = state.num_pages
    pages, release = pages.reshape(-1), release.reshape(-1)
    rank = jnp.cumsum(release) - release
    target = jnp.where(release, state.num_free + rank, N)
    return state.replace(
        free_pages=state.free_pages.at[target].set(pages, mode="drop"),
        num_free=state.num_free + jnp.sum(release).astype(jnp.int32),
        refcount=state.refcount.at[jnp.where(release, pages, N)].set(0, mode="drop"),
    )


def compact_layer(state: KVState, layer, keep_slots: jax.Array, keep_count: jax.Array) -> KVState:
    """Keep `keep_slots int32[B, H, K]` (logical slot indices, the first `keep_count[b, h]` of each row real)
    of `layer` and free every page the kept slots no longer need."""
    ps, N, P = state.page_size, state.num_pages, state.max_pages
    B, H, K = keep_slots.shape
    table = state.page_table[layer]  # [B, H, P]
    b_idx, h_idx = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    j = jnp.arange(K, dtype=jnp.int32)[None, None, :]
    real = j < keep_count[:, :, None]
    source = jnp.where(real, keep_slots, 0)
    src_page = jnp.clip(table[b_idx, h_idx, source // ps], 0, N - 1)
    src_off = source % ps
    k = state.k_pages[src_page, src_off]  # [B, H, K, D] as stored (int8 pages move with their scales)
    v = state.v_pages[src_page, src_off]
    pos = state.slot_pos[src_page, src_off]
    score = state.slot_score[src_page, src_off]
    scales = {}
    if state.quantized:
        scales = {name: getattr(state, name)[src_page, src_off] for name in ("k_scale", "v_scale")}  # [B, H, K]

    # every slot of the kept pages, kept or past keep_count (cleared)
    K_pad = pages_for(K, ps) * ps
    jj = jnp.arange(K_pad, dtype=jnp.int32)[None, None, :]
    dst_logical = jnp.minimum(jj // ps, P - 1)
    in_kept_pages = jj < pages_for(keep_count, ps)[:, :, None] * ps
    dst_page = jnp.where(in_kept_pages, table[b_idx, h_idx, dst_logical], N)
    dst_off = jj % ps
    pad = K_pad - K
    is_real = jnp.pad(real, ((0, 0), (0, 0), (0, pad)))
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    pos = jnp.where(is_real, jnp.pad(pos, ((0, 0), (0, 0), (0, pad))), -1)
    score = jnp.where(is_real, jnp.pad(score, ((0, 0), (0, 0), (0, pad))), 0.0)
    scales = {
        name: getattr(state, name).at[dst_page, dst_off].set(jnp.pad(x, ((0, 0), (0, 0), (0, pad))), mode="drop")
        for name, x in scales.items()
    }
    state = state.replace(
        **scales,
        k_pages=state.k_pages.at[dst_page, dst_off].set(k, mode="drop"),
        v_pages=state.v_pages.at[dst_page, dst_off].set(v, mode="drop"),
        slot_pos=state.slot_pos.at[dst_page, dst_off].set(pos, mode="drop"),
        slot_score=state.slot_score.at[dst_page, dst_off].set(score, mode="drop"),
    )
    # exact metadata of the kept pages
    Pk = K_pad // ps
    kept_pages = dst_page.reshape(B, H, Pk, ps)[..., 0]  # [B, H, Pk]
    in_page = jnp.clip(keep_count[:, :, None] - jnp.arange(Pk)[None, None, :] * ps, 0, ps)
    kmin, kmax = page_minmax(state, kept_pages, in_page)
    state = state.replace(
        kmin=state.kmin.at[kept_pages].set(kmin.astype(state.kmin.dtype), mode="drop"),
        kmax=state.kmax.at[kept_pages].set(kmax.astype(state.kmax.dtype), mode="drop"),
    )
    # free the pages past the kept ones
    p = jnp.arange(P, dtype=jnp.int32)[None, None, :]
    new_used = pages_for(keep_count, ps)[:, :, None]
    old_used = pages_for(state.lengths[layer], ps)[:, :, None]
    release = (p >= new_used) & (p < old_used)
    state = push_free(state, table, release)
    return state.replace(
        page_table=state.page_table.at[layer].set(jnp.where(p >= new_used, -1, table)),
        lengths=state.lengths.at[layer].set(keep_count.astype(jnp.int32)),
    )


def evict_one_slot(state: KVState, layer, victim: jax.Array, evict: jax.Array, keys: jax.Array) -> KVState:
    """Drop logical slot `victim int32[B, H]` of the heads where `evict bool[B, H]`.

    The slot becomes the head's hole (slot_pos -1); the next appended token fills it. Nothing in the K/V
    pool is written: on CPU, XLA copied the whole pool for a scatter whose values it gathered from the
    same pool, twice per layer per step. The victim page's `kmin`/`kmax` are recomputed exactly from
    `keys [B, H, S, D]`, the layer's keys in slot order as the policy's view gathered them (gathering
    them from the pool again here also made XLA copy the pool)."""
    ps, N = state.page_size, state.num_pages
    table = state.page_table[layer]
    B, H, _ = table.shape
    b_idx, h_idx = jnp.arange(B)[:, None], jnp.arange(H)[None, :]
    page = jnp.where(evict, table[b_idx, h_idx, victim // ps], N)
    slot_pos = state.slot_pos.at[page, victim % ps].set(-1, mode="drop")
    # exact metadata over the page's remaining slots
    safe = jnp.clip(page, 0, N - 1)
    first = (victim // ps * ps)[:, :, None]  # first slot of the victim's page
    in_page = jnp.minimum(first + jnp.arange(ps)[None, None, :], keys.shape[2] - 1)  # [B, H, ps]
    page_keys = jnp.take_along_axis(keys, in_page[..., None], axis=2)  # [B, H, ps, D]
    below = first + jnp.arange(ps)[None, None, :] < state.lengths[layer][:, :, None]
    keep = (below & (slot_pos[safe] >= 0))[..., None]
    kmin = jnp.min(jnp.where(keep, page_keys, jnp.inf), axis=-2)
    kmax = jnp.max(jnp.where(keep, page_keys, -jnp.inf), axis=-2)
    return state.replace(
        slot_pos=slot_pos,
        slot_score=state.slot_score.at[page, victim % ps].set(0.0, mode="drop"),
        kmin=state.kmin.at[page].set(kmin.astype(state.kmin.dtype), mode="drop"),
        kmax=state.kmax.at[page].set(kmax.astype(state.kmax.dtype), mode="drop"),
        hole=state.hole.at[layer].set(jnp.where(evict, victim, state.hole[layer])),
    )


def kept_positions(state: KVState) -> list:
    """Original token positions held per (layer, sequence, kv-head), in slot order: a nested list
    `[layer][batch][head] -> np.ndarray[int32]`."""
    table = np.asarray(state.page_table)
    lengths = np.asarray(state.lengths)
    slot_pos = np.asarray(state.slot_pos)
    ps = state.page_size
    out = []
    for l in range(table.shape[0]):
        per_b = []
        for b in range(table.shape[1]):
            per_h = []
            for h in range(table.shape[2]):
                n = int(lengths[l, b, h])
                pages = table[l, b, h, : pages_for(n, ps)]
                held = slot_pos[pages].reshape(-1)[:n]
                per_h.append(held[held >= 0].astype(np.int32))  # a decode-time eviction hole is skipped
            per_b.append(per_h)
        out.append(per_b)
    return out


def memory_report(state: KVState) -> dict:
    """Pages and bytes in use per layer and per (layer, head), against a full cache of the same positions."""
    table = np.asarray(state.page_table)
    lengths = np.asarray(state.lengths)
    next_pos = np.asarray(state.next_position)
    ps, D = state.page_size, state.k_pages.shape[-1]
    page_bytes = 2 * ps * D * state.k_pages.dtype.itemsize + 2 * D * state.kmin.dtype.itemsize + ps * 8
    if state.quantized:
        page_bytes += 2 * ps * 4  # one float32 scale per slot for K and for V
    pages = (table >= 0).sum(-1)  # [L, B, H]
    full_pages = pages_for(next_pos, ps)[None, :, None] * np.ones_like(pages)
    return {
        "page_size": ps,
        "bytes_per_page": int(page_bytes),
        "pages_in_use": int(pages.sum()),
        "pages_full_cache": int(full_pages.sum()),
        "bytes_in_use": int(pages.sum() * page_bytes),
        "bytes_full_cache": int(full_pages.sum() * page_bytes),
        "pages_per_layer": pages.sum(axis=(1, 2)).tolist(),
        "pages_per_layer_head": pages.sum(axis=1).tolist(),
        "slots_per_layer_head": (lengths - (np.asarray(state.hole) >= 0)).sum(axis=1).tolist(),
        "free_pages": int(state.num_free),
        "pool_pages": state.num_pages,
    }
