"""The serving engine's jitted model step: a batch of token chunks runs through CausalLM, each layer
writing its keys and values into the one uint8 pool and reading them back through its group's typed
view with the allocator's page tables, under a causal (and, per layer, sliding-window) mask.

Shapes are static per call (batch rows B, chunk C, pages read per group P_g); the engine buckets them.
The model scans its layers in segments of consecutive layers of one group (their tables share a shape);
inside a segment a layer's slot in its group's page and its window are data indexed by the traced layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from kvjax.attention import masked_attention, visible_keys
from kvjax.config import ModelConfig
from kvjax.models import CausalLM, Segment, segments_by
from kvjax.rope import rope_frequencies
from kvjax.serving.layout import PoolLayout
from kvjax.serving.model_groups import LayerGroups, row_bytes
from kvjax.serving.views import reinterpret_pages

@dataclass(frozen=True)
class StepGeometry:
    """Everything static about the pool a step needs: the layout and how layers map to groups."""

    layout: PoolLayout
    groups: LayerGroups

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.groups)


def window_attention(
    q: jax.Array, q_positions: jax.Array, k: jax.Array, v: jax.Array, key_positions: jax.Array,
    key_valid: jax.Array, window,
) -> jax.Array:
    """Queries `q [B, T, Hq, D]` at `q_positions int32[B, T]` over keys `k, v [B, S, H, D]` at
    `key_positions int32[B, S]` where `key_valid bool[B, S]`: a query at p sees valid keys at p - window + 1
    .. p (HF's Mistral / Gemma-2 sliding mask), every valid key at or before p when `window` is 0 (an int
    or an int32 scalar, traced inside a scan over layers): `kvjax.attention.masked_attention` with that mask.
    Returns `[B, T, Hq, D]`."""
    qp = q_positions[:, None, None, :, None]  # [B, 1, 1, T, 1]
    kp = key_positions[:, None, None, None, :]  # [B, 1, 1, 1, S]
    visible = key_valid[:, None, None, None, :] & visible_keys(kp, qp, window)
    # Pages may hold stale bytes of another dtype (NaN as floats): zero what is not read so 0 * NaN
    # cannot reach the output.
    v = jnp.where(key_valid[:, :, None, None], v, 0)
    return masked_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), visible)


def _as_rows(x: jax.Array, dtype, row: int) -> jax.Array:
    """`x [..., H, D]` -> uint8[..., row] (the bytes of each token's heads in `dtype`)."""
    raw = jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint8)
    return raw.reshape(x.shape[:-2] + (row,))


def write_kv_rows(
    pool: jax.Array, geo: StepGeometry, group: int, layer_slot, page: jax.Array, slot: jax.Array, k: jax.Array,
    v: jax.Array, writable: jax.Array,
) -> jax.Array:
    """Writes one layer's keys and values of a chunk into the pool: the layer of `group` (static) whose index
    among the group's layers is `layer_slot` (an int, or traced).

    pool uint8[pool_bytes]; page, slot int32[B, C]: the page id (of the layer's group) and slot in it of
    each token; k, v [B, C, H, D]; writable bool[B, C] (padding and unplaced tokens are dropped). The pool
    is addressed in rows of `row_bytes` (one token's heads of one layer's k or v), every page starting on a
    row: page p of group g starts at row (p // per_large) * large_rows + (p % per_large) * page_rows.
    """
    groups, layout = geo.groups, geo.layout
    spec = groups.specs[group]
    row = geo.row_bytes
    per_large = layout.pages_per_large(group)
    large_rows, page_rows, tpp = layout.large_page_bytes // row, spec.page_bytes // row, spec.tokens_per_page
    first_row = (page // per_large) * large_rows + (page % per_large) * page_rows  # [B, C]
    num_rows = layout.pool_bytes // row
    k_rows = first_row + (layer_slot * 2 + 0) * tpp + slot
    v_rows = first_row + (layer_slot * 2 + 1) * tpp + slot
    index = jnp.stack([k_rows, v_rows], axis=2)  # [B, C, 2]
    index = jnp.where(writable[:, :, None], index, num_rows)  # out of range: dropped
    values = jnp.stack([_as_rows(k, groups.dtype, row), _as_rows(v, groups.dtype, row)], axis=2)  # [B, C, 2, row]
    rows = pool.reshape(num_rows, row).at[index].set(values, mode="drop")
    return rows.reshape(-1)


def read_kv(pool: jax.Array, geo: StepGeometry, group: int, layer_slot, table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gathers one layer's keys and values (the `layer_slot`-th layer of `group`, as in `write_kv_rows`) of
    the pages in `table int32[B, P]` (-1: none) through the group's typed view. Returns k, v
    `[B, P * tokens_per_page, H, D]` in the pool dtype."""
    groups = geo.groups
    view = reinterpret_pages(pool, geo.layout, group, groups.dtype, groups.kv_page_shape(group))  # [N, layers, 2, tpp, H, D]
    safe = jnp.clip(table, 0, view.shape[0] - 1)
    kv = view[safe, layer_slot]  # [B, P, 2, tpp, H, D]
    B, P, _, tpp, H, D = kv.shape
    return kv[:, :, 0].reshape(B, P * tpp, H, D), kv[:, :, 1].reshape(B, P * tpp, H, D)


@partial(jax.jit, static_argnames=("geo", "cfg", "dtype"), donate_argnames=("pool",))
def paged_model_step(params, pool, tokens, starts, num_new, tables, offsets, *, geo: StepGeometry, cfg: ModelConfig, dtype):
    """One engine step for a batch of rows.

    tokens int32[B, C]: row b computes tokens at positions starts[b] .. starts[b] + num_new[b] - 1 (the
    rest is padding; num_new 0 marks a padding row). tables: per group, int32[B, P_g] page ids of blocks
    offsets[g][b] .. offsets[g][b] + P_g - 1 of the row's request (-1: none), covering every block the
    chunk writes or reads. Returns (pool, greedy next token int32[B], logits f32[B, V] at each row's last
    real token).
    """
    B, C = tokens.shape
    groups = geo.groups
    positions = starts[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]  # [B, C]
    real = jnp.arange(C)[None, :] < num_new[:, None]
    ends = starts + num_new  # [B]

    layer_slot = jnp.asarray(groups.layer_slot, jnp.int32)  # [L]
    layer_window = jnp.asarray(groups.layer_window, jnp.int32)  # [L], 0 = full attention

    def attend_for(group: int):
        tpp = groups.specs[group].tokens_per_page
        table, offset = tables[group], offsets[group]  # [B, P], [B]
        P = table.shape[1]

        def attend(layer, inputs, pool):
            block = positions // tpp - offset[:, None]  # [B, C]
            page = jnp.take_along_axis(table, jnp.clip(block, 0, P - 1), axis=1)
            writable = real & (block >= 0) & (block < P) & (page >= 0)
            pool = write_kv_rows(pool, geo, group, layer_slot[layer], page, positions % tpp, inputs.k, inputs.v, writable)
            k, v = read_kv(pool, geo, group, layer_slot[layer], table)
            key_positions = ((offset[:, None] + jnp.arange(P))[:, :, None] * tpp + jnp.arange(tpp)).reshape(B, P * tpp)
            key_valid = jnp.repeat(table >= 0, tpp, axis=1) & (key_positions < ends[:, None])
            out = window_attention(inputs.q, positions, k, v, key_positions, key_valid, layer_window[layer])
            return out, pool

        return attend

    # one segment per run of layers in one group (their tables share a shape)
    segments = [
        Segment(a, b, attend_for(groups.layer_group[a])) for a, b in segments_by(cfg.num_layers, groups.layer_group.__getitem__)
    ]
    module = CausalLM(cfg, dtype)
    hidden, pool = module.apply({"params": params}, tokens, positions, rope_frequencies(cfg, False), segments, pool)
    last = jnp.clip(num_new - 1, 0, C - 1)
    logits = module.apply({"params": params}, hidden[jnp.arange(B), last], method=CausalLM.logits)  # [B, V]
    return pool, jnp.argmax(logits, axis=-1).astype(jnp.int32), logits
