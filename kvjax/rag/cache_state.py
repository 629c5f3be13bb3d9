"""Per-layer K/V arrays into a fresh paged `KVState` and back: how chunk caches and assembled RAG contexts
become states that `kvjax.decode_step` continues."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.models.config import ModelConfig
from kvjax.cache.state import KVState, allocate_for_append, append_to_layer, init_state, overflow_error, pages_for


@functools.partial(jax.jit, static_argnames=("cfg", "capacity", "page_size", "long_rope"))
def _write(k_layers, v_layers, positions, num_tokens, *, cfg: ModelConfig, capacity: int, page_size: int, long_rope: bool):
    B, S = positions.shape
    state = init_state(cfg, B, capacity, page_size, dtype=k_layers[0].dtype, long_rope=long_rope)
    state, ok = allocate_for_append(state, num_tokens, S)
    num_new = jnp.where(ok, num_tokens, 0)
    for layer in range(cfg.num_layers):
        state = append_to_layer(state, layer, k_layers[layer], v_layers[layer], positions, num_new)
    real = jnp.arange(S)[None, :] < num_tokens[:, None]
    next_position = jnp.max(jnp.where(real, positions, -1), axis=1) + 1
    return state.replace(next_position=next_position.astype(jnp.int32))


def state_from_kv(
    cfg: ModelConfig, k_layers, v_layers, positions, num_tokens=None, *, capacity: int, page_size: int = 16,
    long_rope: bool = False,
) -> KVState:
    """A paged state holding, for every layer, `k_layers[l], v_layers[l] [B, S, H, D]` (post-RoPE) at
    `positions int32[B, S]`; the first `num_tokens int32[B]` slots of each row (default all S) are real.

    `next_position` is one past each row's largest position. Raises
    `CacheCapacityError` when `capacity` (tokens per layer and head) cannot hold them.
    """
    positions = jnp.asarray(positions, jnp.int32)
    B, S = positions.shape
    if len(k_layers) != cfg.num_layers or len(v_layers) != cfg.num_layers:
        raise ValueError(f"expected K/V for {cfg.num_layers} layers, got {len(k_layers)} and {len(v_layers)}")
    if S > pages_for(capacity, page_size) * page_size:
        raise ValueError(f"capacity {capacity} cannot hold the {S} slots given; pass a larger capacity")
    num_tokens = jnp.full((B,), S, jnp.int32) if num_tokens is None else jnp.asarray(num_tokens, jnp.int32)
    state = _write(tuple(k_layers), tuple(v_layers), positions, num_tokens, cfg=cfg, capacity=capacity,
                   page_size=page_size, long_rope=long_rope)
    error = overflow_error(state)
    if error is not None:
        raise error
    return state


def kv_from_state(state: KVState, num_slots: int, layer=None):
    """`k, v [L, B, num_slots, H, D]`: slots 0..num_slots-1 of every layer and kv head of `state`, in slot
    order (the inverse of `state_from_kv`; the keys as stored), or `[B, num_slots, H, D]` of one `layer`.
    Every head must hold them, with no eviction hole. Traceable; `num_slots` is static."""
    P = pages_for(num_slots, state.page_size)
    table = state.page_table if layer is None else state.page_table[layer]
    table = jnp.clip(table[..., :P], 0, state.num_pages - 1)  # [(L,) B, H, P]

    def read(pages):  # [(L,) B, H, P, ps, D] -> [(L,) B, num_slots, H, D]
        slots = pages.reshape(*table.shape[:-1], P * state.page_size, -1)[..., :num_slots, :]
        return jnp.swapaxes(slots, -3, -2)

    return read(state.read_k(table)), read(state.read_v(table))
