"""One entry point for every RAG prefill method, and greedy generation from its state."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvjax.engine.generation import continue_rows
from kvjax.models.loading import Model
from kvjax.policies import FullPolicy
from kvjax.rag.assemble import assemble
from kvjax.rag.baselines import cacheblend_prefill, direct_reuse, full_prefill
from kvjax.rag.prefill import RagPrefill, recompute
from kvjax.rag.recompute import AuxScorer, cacheclip_prefill
from kvjax.rag.store import ChunkStore

METHODS = ("full", "recompute_all", "reuse", "ape", "cacheblend", "cacheclip")


def rag_prefill(
    model: Model,
    store: ChunkStore,
    prefix_tokens,
    chunk_token_lists: Sequence,
    query_tokens,
    method: str = "cacheclip",
    *,
    ratio: float | None = None,
    aux: AuxScorer | None = None,
    aux_store: ChunkStore | None = None,
    grouping: bool = True,
    max_new_tokens: int = 16,
    page_size: int = 16,
) -> RagPrefill:
    """Prefill `prefix + chunks + query` with `method`:

    full: `kvjax.prefill` of the whole prompt; recompute_all: assembled from the store, every chunk token
    recomputed (equals full); reuse: no recomputation; ape: parallel positions, no recomputation;
    cacheblend: `ratio` (default 0.15) by K/V deviation at layer 1; cacheclip: `ratio` (default 0.2) by
    `aux`'s attention (default: the main model's first half of layers), window grouping unless
    `grouping=False`. `aux_store` holds the auxiliary model's chunk caches when it has its own layers.
    """
    if method not in METHODS:
        raise ValueError(f"unknown RAG method {method!r}; expected one of {METHODS}")
    common = dict(max_new_tokens=max_new_tokens, page_size=page_size)
    if method == "full":
        tokens = np.concatenate([np.asarray(prefix_tokens), *map(np.asarray, chunk_token_lists), np.asarray(query_tokens)])
        return full_prefill(model, tokens, **common)
    ctx = assemble(model, store, prefix_tokens, chunk_token_lists, query_tokens, parallel_positions=method == "ape",
                   **common)
    if method == "recompute_all":
        return recompute(model, ctx, ctx.chunk_slots)
    if method in ("reuse", "ape"):
        return direct_reuse(model, ctx)
    if method == "cacheblend":
        return cacheblend_prefill(model, ctx, 0.15 if ratio is None else ratio)
    aux = AuxScorer.truncated(model, max(1, model.cfg.num_layers // 2)) if aux is None else aux
    aux_ctx = None
    if not aux.shares_main_layers and aux.context == "reuse":
        if aux_store is None:
            raise ValueError("an auxiliary model with its own layers needs aux_store (its chunk caches)")
        aux.check_tokenizer(model)
        aux_ctx = assemble(aux.model, aux_store, prefix_tokens, chunk_token_lists, query_tokens,
                           max_new_tokens=max_new_tokens, long_rope=ctx.long_rope)
    return cacheclip_prefill(model, ctx, aux, 0.2 if ratio is None else ratio, grouping=grouping, aux_ctx=aux_ctx)


def greedy_continue(model: Model, prefilled: RagPrefill, max_new_tokens: int) -> np.ndarray:
    """Greedy tokens `int32[max_new_tokens]` decoded from a prefilled request by `generate`'s decode loop
    (`kvjax.engine.generation.continue_rows`, full cache, no stop token). To serve it among other requests, hand
    `prefilled.state` and `prefilled.logits` to `kvjax.serving.BatchEngine.submit_prefilled`."""
    tokens = continue_rows(model, prefilled.state, prefilled.logits, [np.zeros(0, np.int32)], max_new_tokens,
                           FullPolicy(), eos_token_id=-1)
    return tokens[0]
