"""CacheClip's selective recomputation: an auxiliary model scores the chunk tokens by its last layer's
attention from the query, the top r% are chosen with window grouping, and the main model recomputes them.

Notes: docs/modules.md (`kvjax/rag/recompute.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.models.loading import Model
from kvjax.models import first_layers
from kvjax.rag.assemble import AssembledContext
from kvjax.cache.state import KVState
from kvjax.rag.cache_state import state_from_kv
from kvjax.rag.prefill import RagPrefill, recompute
from kvjax.rag.selective import selective_forward_keep
from kvjax.rag.store import check_fingerprint, model_fingerprint

CONTEXTS = ("reuse", "full")


def budget_for(ratio: float, num_chunk_tokens: int) -> int:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio}")
    return int(round(ratio * num_chunk_tokens))


def top_tokens(scores: np.ndarray, budget: int) -> np.ndarray:
    """Sorted indices of the `budget` highest scores (ties to the earlier index)."""
    return np.sort(np.argsort(-np.asarray(scores), kind="stable")[:budget])


def group_windows(scores: np.ndarray, budget: int, window: int = 8, threshold: int = 5) -> np.ndarray:
    """Exactly `min(budget, n)` sorted indices of `scores f32[n]`, chosen by whole windows (see module doc)."""
    scores = np.asarray(scores, np.float64)
    n = scores.shape[0]
    budget = min(budget, n)
    if window <= 0 or not 0 <= threshold < window:
        raise ValueError(f"need window > 0 and 0 <= threshold < window, got window={window}, threshold={threshold}")
    order = np.argsort(-scores, kind="stable")
    window_of = np.arange(n) // window
    num_windows = int(window_of[-1]) + 1 if n else 0

    def windows_taken(k: int) -> np.ndarray:
        picked = np.zeros(n, bool)
        picked[order[:k]] = True
        counts = np.bincount(window_of, weights=picked, minlength=num_windows)
        return (counts > threshold)[window_of]

    lo, hi = 0, n  # largest k whose qualifying windows fit the budget (monotone in k)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if windows_taken(mid).sum() <= budget:
            lo = mid
        else:
            hi = mid - 1
    taken = windows_taken(lo)
    rest = order[~taken[order]][: budget - int(taken.sum())]
    taken[rest] = True
    return np.flatnonzero(taken).astype(np.int32)


def truncated_model(model: Model, num_layers: int) -> Model:
    """The model's first `num_layers` layers with its embeddings, final norm and head: a smaller model with
    the same tokenizer, no training needed."""
    if not 1 <= num_layers <= model.cfg.num_layers:
        raise ValueError(f"num_layers must be in 1..{model.cfg.num_layers}, got {num_layers}")
    params = first_layers(model.params, num_layers)
    cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    return dataclasses.replace(model, cfg=cfg, params=params)


@dataclasses.dataclass
class AuxScorer:
    """Scores chunk tokens by the auxiliary model's last-layer attention from the query tokens (averaged over
    heads and query tokens).

    model: the auxiliary model; it must share the main model's tokenizer.
    context: "reuse" runs only the query through the auxiliary model, over the reused chunk K/V of its own
        layers; "full" prefills the whole prompt with it (the paper's setting, costlier).
    shares_main_layers: the auxiliary model is the main model's first layers (`AuxScorer.truncated`), so its
        reused K/V are the main model's first layers of the same assembled context: nothing more to store.
        Otherwise `scores` needs the context assembled from the auxiliary model's own chunk store.
    """

    model: Model
    context: str = "reuse"
    shares_main_layers: bool = False

    def __post_init__(self):
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {self.context!r}")

    @classmethod
    def truncated(cls, main: Model, num_layers: int, context: str = "reuse") -> "AuxScorer":
        return cls(truncated_model(main, num_layers), context, shares_main_layers=True)

    def check_tokenizer(self, main: Model) -> None:
        mine, theirs = model_fingerprint(self.model), model_fingerprint(main)
        check_fingerprint(dataclasses.replace(theirs, tokenizer=mine.tokenizer), theirs, "the auxiliary model")

    def scores(self, ctx: AssembledContext, aux_ctx: AssembledContext | None = None) -> np.ndarray:
        """`f32[n]`: a score per chunk slot of `ctx` (`ctx.chunk_slots` order). `aux_ctx` is the same request
        assembled from the auxiliary model's store (needed with context="reuse" unless shares_main_layers)."""
        L = self.model.cfg.num_layers
        tokens, positions = ctx.batch_arrays()
        if self.context == "full":
            state = blank_context(self.model, ctx)  # every slot is written before it is read
            active = (jnp.arange(ctx.num_slots, dtype=jnp.int32)[None],) * L
        else:
            source = ctx if self.shares_main_layers else aux_ctx
            if source is None:
                raise ValueError("an auxiliary model with its own layers needs aux_ctx, assembled from its chunk store")
            if source.state is None:
                raise ValueError("the context's state was consumed by a prefill method: score before recomputing")
            state = source.state  # read, not consumed: layers 0..L-1 (the main model's first, when shared)
            active = (jnp.asarray(ctx.query_slots[None]),) * L
        _, _, probs = selective_forward_keep(
            self.model.params, state, tokens, positions, active, cfg=self.model.cfg, dtype=self.model.dtype,
            probs_layer=L - 1,
        )
        query_rows = probs[0, -ctx.query_len :]  # [Q, S']
        return np.asarray(jnp.mean(query_rows, axis=0))[ctx.chunk_slots]


def blank_context(model: Model, ctx: AssembledContext) -> KVState:
    """A state of `model`'s layers holding zeros at `ctx`'s slots and positions, for a forward that computes
    every slot (the auxiliary model's full prefill)."""
    cfg = model.cfg
    zeros = jnp.zeros((cfg.num_layers, 1, ctx.num_slots, cfg.num_kv_heads, cfg.head_dim), model.dtype)
    return state_from_kv(cfg, zeros, zeros, ctx.positions[None], capacity=ctx.num_slots, long_rope=ctx.long_rope)


def cacheclip_prefill(
    model: Model,
    ctx: AssembledContext,
    aux: AuxScorer,
    ratio: float = 0.2,
    *,
    window: int = 8,
    threshold: int = 5,
    grouping: bool = True,
    aux_ctx: AssembledContext | None = None,
) -> RagPrefill:
    """Score with `aux`, choose round(ratio x chunk tokens) tokens (window grouping unless `grouping=False`),
    recompute them and the query with the main model over the assembled context (consumed), return the request."""
    scores = aux.scores(ctx, aux_ctx)
    budget = budget_for(ratio, len(scores))
    chosen = group_windows(scores, budget, window, threshold) if grouping else top_tokens(scores, budget)
    return recompute(model, ctx, ctx.chunk_slots[chosen])
