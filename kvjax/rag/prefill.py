"""The common end of every RAG prefill method: recompute some slots over the assembled K/V with the main
model, write the result into a paged `KVState`, and return it with the logits at the query's last token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.loading import Model
from kvjax.rag.assemble import AssembledContext
from kvjax.rag.cache_state import default_capacity, state_from_kv
from kvjax.rag.selective import selective_forward
from kvjax.cache.state import KVState


@dataclasses.dataclass
class RagPrefill:
    """A prefilled request: `state` (decode continues with `kvjax.decode_step`), `logits f32[1, V]` at the
    query's last token, and the chunk slots the main model recomputed (None for a full prefill)."""

    state: KVState
    logits: jax.Array
    recomputed: np.ndarray | None = None
    num_chunk_tokens: int = 0

    @property
    def recompute_ratio(self) -> float:
        if self.recomputed is None:
            return 1.0
        return len(self.recomputed) / max(self.num_chunk_tokens, 1)


def with_query(chunk_slots: np.ndarray, ctx: AssembledContext) -> jax.Array:
    """`int32[1, n]`: the sorted chunk slots to recompute followed by the query's slots."""
    return jnp.asarray(np.concatenate([np.sort(chunk_slots), ctx.query_slots]).astype(np.int32)[None])


def store_result(model: Model, ctx: AssembledContext, k_layers, v_layers, logits, recomputed, *, max_new_tokens: int,
                 capacity: int | None, page_size: int) -> RagPrefill:
    """Write final per-layer K/V `[1, S, H, D]` into a paged state sized for `max_new_tokens` more tokens."""
    capacity = default_capacity(ctx.num_slots, max_new_tokens) if capacity is None else capacity
    state = state_from_kv(model.cfg, k_layers, v_layers, ctx.positions[None], capacity=capacity, page_size=page_size,
                          long_rope=ctx.long_rope)
    return RagPrefill(state, logits, recomputed, len(ctx.chunk_slots))


def recompute(model: Model, ctx: AssembledContext, chunk_slots, *, max_new_tokens: int = 16, capacity: int | None = None,
              page_size: int = 16) -> RagPrefill:
    """Recompute `chunk_slots` (slot indices of chunk tokens) and the query at every layer over the
    assembled K/V (which the call consumes), and return the prefilled request."""
    chunk_slots = np.asarray(chunk_slots, np.int32)
    active = with_query(chunk_slots, ctx)
    tokens, positions, valid = ctx.batch_arrays()
    logits, k, v, _ = selective_forward(
        model.params, ctx.k, ctx.v, tokens, positions, valid, (active,) * model.cfg.num_layers,
        cfg=model.cfg, dtype=model.dtype, long_rope=ctx.long_rope,
    )
    ctx.k = ctx.v = None  # donated
    return store_result(model, ctx, k, v, logits, chunk_slots, max_new_tokens=max_new_tokens, capacity=capacity,
                        page_size=page_size)
