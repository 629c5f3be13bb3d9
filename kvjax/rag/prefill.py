"""The common end of every RAG prefill method: recompute some slots of the assembled context's state with the
main model, and return that state with the logits at the query's last token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.loading import Model
from kvjax.rag.assemble import AssembledContext
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


def take_state(ctx: AssembledContext) -> KVState:
    """The context's state, which the caller consumes (donates): the context no longer holds it."""
    state, ctx.state = ctx.state, None
    if state is None:
        raise ValueError("this context's state was consumed by an earlier prefill method; assemble the request again")
    return state


def recompute(model: Model, ctx: AssembledContext, chunk_slots) -> RagPrefill:
    """Recompute `chunk_slots` (slot indices of chunk tokens) and the query at every layer over the
    assembled context (whose state the call consumes), and return the prefilled request."""
    chunk_slots = np.asarray(chunk_slots, np.int32)
    active = with_query(chunk_slots, ctx)
    tokens, positions = ctx.batch_arrays()
    logits, state, _ = selective_forward(
        model.params, take_state(ctx), tokens, positions, (active,) * model.cfg.num_layers,
        cfg=model.cfg, dtype=model.dtype,
    )
    return RagPrefill(state, logits, chunk_slots, len(ctx.chunk_slots))
