"""Assemble a RAG context from cached pieces into a paged `KVState`: the shared prefix once, the chunks
after it with their keys moved to their new positions, and zero slots for the query.

Notes: docs/modules.md (`kvjax/rag/assemble.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.state import KVState
from kvjax.models.config import ModelConfig
from kvjax.models.loading import Model
from kvjax.engine.api import as_token_row
from kvjax.engine.generation import bucketed
from kvjax.rag.cache_state import kv_from_state, state_from_kv
from kvjax.rag.rope_shift import check_shiftable, rotate_keys, shift_keys
from kvjax.rag.store import ChunkKV, ChunkStore, check_fingerprint, model_fingerprint
from kvjax.models.rope import uses_long_factors


@dataclasses.dataclass
class AssembledContext:
    """One request's context, B = 1: S = prefix + chunk + query tokens, held as slots 0..S-1 of every layer and
    kv head of `state` (post-RoPE at `positions`; the query's slots zero until a forward computes them).
    A prefill method consumes the state (`state` is None afterwards)."""

    tokens: np.ndarray  # int32[S]
    positions: np.ndarray  # int32[S]
    state: KVState | None
    prefix_len: int
    chunk_spans: list  # (start, end) slots of each chunk
    query_len: int
    long_rope: bool

    @property
    def num_slots(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def query_slots(self) -> np.ndarray:
        return np.arange(self.num_slots - self.query_len, self.num_slots, dtype=np.int32)

    @property
    def chunk_slots(self) -> np.ndarray:
        """Slots of reused chunk tokens (the candidates for recomputation), in order."""
        return np.arange(self.prefix_len, self.num_slots - self.query_len, dtype=np.int32)

    def batch_arrays(self):
        """`(tokens int32[1, S], positions int32[1, S])` as device arrays."""
        return jnp.asarray(self.tokens[None]), jnp.asarray(self.positions[None])

    def layer_kv(self, layer: int):
        """`(k, v)`, each `[1, S, H, D]`: the context's K/V of `layer` in slot order (read from the state)."""
        if self.state is None:
            raise ValueError("this context's state was consumed by a prefill method; assemble the request again")
        return kv_from_state(self.state, self.num_slots, layer)


@functools.partial(jax.jit, static_argnames=("lengths", "cfg", "form", "stored_long_rope", "long_rope", "query_len"))
def _place(states, old_positions, new_positions, *, lengths: tuple, cfg: ModelConfig, form: str,
           stored_long_rope: bool, long_rope: bool, query_len: int):
    """Concatenate the K/V of entries' `states` (`lengths[i]` slots each), move keys to `new_positions`, add
    `query_len` zero slots. Returns `k, v [L, 1, S, H, D]`."""
    kv = [kv_from_state(state, n) for state, n in zip(states, lengths)]  # each [L, 1, T_i, H, D]
    k = jnp.concatenate([k for k, _ in kv], axis=2)[:, 0]
    v = jnp.concatenate([v for _, v in kv], axis=2)[:, 0]
    if form == "pre_rope":
        k = rotate_keys(k, new_positions[None], cfg, long_rope)
    else:
        k = shift_keys(k, (new_positions - old_positions)[None], cfg, stored_long_rope, long_rope)
    pad = ((0, 0), (0, query_len), (0, 0), (0, 0))
    return jnp.pad(k, pad)[:, None], jnp.pad(v, pad)[:, None]


def assemble(
    model: Model,
    store: ChunkStore,
    prefix_tokens,
    chunk_token_lists: Sequence,
    query_tokens,
    *,
    parallel_positions: bool = False,
    max_new_tokens: int = 16,
    long_rope: bool | None = None,
    capacity: int | None = None,
    page_size: int = 16,
) -> AssembledContext:
    """Assemble `prefix + chunks` from `store` (encoding chunks it lacks), followed by `query_tokens`.

    Positions are contiguous (chunk i starts where chunk i - 1 ended); with `parallel_positions` every
    chunk keeps its encoding positions P..P+T_i-1 and the query follows the longest (APE-style parallel
    encoding). `long_rope` defaults to LongRoPE's rule for the assembled length plus `max_new_tokens`. The
    state holds `capacity` tokens per (layer, head) in pages of `page_size` (default: the context plus
    `max_new_tokens`, rounded up as `kvjax.prefill` rounds: `bucketed`).
    Raises `ChunkMismatchError` if the store belongs to another model or tokenizer, `RopeShiftError` if
    rotated keys would cross LongRoPE's factor switch, `NotImplementedError` for a model with sliding
    windows.
    """
    check_fingerprint(store.fingerprint, model_fingerprint(model), "this chunk store")
    if any(model.cfg.windows):
        raise NotImplementedError(
            f"chunk reuse assumes full attention; this model has sliding windows {sorted(set(model.cfg.windows) - {0})} "
            "(use kvjax.generate on the whole prompt)"
        )
    if np.size(query_tokens) < 1:
        raise ValueError("query_tokens is empty: the query is what the forward computes, give at least one token")
    query = as_token_row(np.reshape(query_tokens, -1), model.cfg.vocab_size, "query_tokens")
    query_len = int(query.size)
    if not chunk_token_lists:
        raise ValueError("chunk_token_lists is empty: give at least one chunk")
    prefix = store.prefix(prefix_tokens)
    chunks = store.chunks(prefix_tokens, chunk_token_lists)
    entries: list[ChunkKV] = [prefix, *chunks]
    for entry in entries:
        check_fingerprint(entry.fingerprint, store.fingerprint, f"chunk {entry.key.hex()[:12]}")
    P = prefix.num_tokens
    spans, old, new, cursor = [], [np.arange(P)], [np.arange(P)], P
    for entry in chunks:
        old.append(entry.start + np.arange(entry.num_tokens))
        new.append((P if parallel_positions else cursor) + np.arange(entry.num_tokens))
        spans.append((cursor, cursor + entry.num_tokens))
        cursor += entry.num_tokens
    context_positions = np.concatenate(new).astype(np.int32)
    query_start = int(context_positions.max()) + 1
    positions = np.concatenate([context_positions, query_start + np.arange(query_len)]).astype(np.int32)
    if long_rope is None:
        long_rope = uses_long_factors(model.cfg, int(positions.max()) + 1 + max_new_tokens)
    if store.form == "rotated":
        check_shiftable(model.cfg, store.long_rope, long_rope)
    k, v = _place(
        tuple(e.state for e in entries), jnp.asarray(np.concatenate(old), jnp.int32), jnp.asarray(context_positions),
        lengths=tuple(e.num_tokens for e in entries), cfg=model.cfg, form=store.form,
        stored_long_rope=store.long_rope, long_rope=bool(long_rope), query_len=query_len,
    )
    tokens = np.concatenate([e.tokens for e in entries] + [query])
    capacity = bucketed(len(tokens) + max_new_tokens) if capacity is None else capacity
    state = state_from_kv(model.cfg, k, v, positions[None], capacity=capacity, page_size=page_size,
                          long_rope=bool(long_rope))
    return AssembledContext(tokens, positions, state, P, spans, query_len, bool(long_rope))
