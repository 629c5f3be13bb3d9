"""Locret (Huang et al., 2024): trained retaining heads score each token; chunked prefill evicts to a budget.

Notes: docs/modules.md (`kvjax/policies/locret.py`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.policies.base import ChunkSchedule, Compressor, Policy, PromptView, register_policy
from kvjax.policies.eviction import NEG, keep_top, recent

POOLS = ("all", "head")
DEFAULTS = {"pool": "head", "sink_size": 0}  # where neither the caller nor the heads (`RetainingHeads.options`) set them

def _as_heads(heads):
    from kvjax.policies.locret_heads import RetainingHeads, load_heads

    if isinstance(heads, RetainingHeads):
        return heads
    if isinstance(heads, (str, os.PathLike)):
        return load_heads(heads)
    if isinstance(heads, dict):
        return RetainingHeads(None, heads)
    raise TypeError(
        "locret: heads= must be RetainingHeads, a path to saved heads, a model name with shipped heads, or a "
        "parameter dict; "
        f"got {type(heads).__name__}"
    )


@register_policy("locret")
@dataclasses.dataclass(frozen=True)
class Locret(Policy, Compressor):
    token_budget: int = 128  # slots a head keeps after prefill, local_tail included
    stabilizers: int = 32  # n_s: the newest slots kept at each non-final chunk
    local_tail: int = 16  # n_loc: last prompt tokens appended without eviction
    # "head": per kv head; "all": pooled over all compressed layers and kv heads (one device). None: the heads'
    # option (`SHIPPED_OPTIONS`: "all" for the SmolLM2 heads), else "head"
    pool: str | None = None
    head_cap: int = 4  # pool="all": a head keeps at most head_cap * (token_budget - local_tail) slots (its memory)
    # first prompt tokens scored +inf, so kept within the budget (StreamingLLM's sinks). None: the heads' option
    # (4 for the SmolLM2 heads), else 0
    sink_size: int | None = None
    heads: Any = dataclasses.field(default=None, compare=False)  # data: never part of the identity

    def __post_init__(self):
        if self.heads is None:
            raise ValueError(
                "locret: heads= is required (RetainingHeads, a path to saved heads, a model name with shipped heads "
                "such as 'tiny', or a parameter dict)"
            )
        heads = _as_heads(self.heads)
        heads.stacked  # stacked once, here on the host, never inside a traced step
        object.__setattr__(self, "heads", heads)
        self.set_defaults(heads.options)

    def set_defaults(self, options: dict) -> None:
        """Each option of `DEFAULTS` left None takes its value from `options` (the heads'), else `DEFAULTS`."""
        for name, fallback in DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, options.get(name, fallback))

    @property
    def evict_budget(self) -> int:
        return self.token_budget - self.local_tail

    @property
    def pooled_budget(self) -> int | None:
        return self.evict_budget if self.pool == "all" else None

    @property
    def head_bound(self) -> int:
        """Most slots a head keeps after a chunk's eviction (stabilizers included)."""
        return self.evict_budget * (self.head_cap if self.pool == "all" else 1)

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if self.local_tail < 0:
            raise ValueError(f"locret: local_tail must be >= 0, got {self.local_tail}")
        if self.evict_budget <= 0:
            raise ValueError(
                f"locret: token_budget={self.token_budget} must exceed local_tail={self.local_tail}"
            )
        if self.pool not in POOLS:
            raise ValueError(f"locret: pool must be one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.head_cap < 1:
            raise ValueError(f"locret: head_cap must be >= 1, got {self.head_cap}")
        if not 0 <= self.stabilizers < self.evict_budget:
            raise ValueError(
                f"locret: stabilizers must be in [0, token_budget - local_tail = {self.evict_budget}), "
                f"got {self.stabilizers}"
            )
        if not 0 <= self.sink_size < self.evict_budget - self.stabilizers:
            raise ValueError(
                f"locret: sink_size must be in [0, token_budget - local_tail - stabilizers = "
                f"{self.evict_budget - self.stabilizers}), got {self.sink_size}"
            )

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        bound = self.head_bound + max(chunk_size, self.local_tail + max_new_tokens)
        return min(prompt_len + max_new_tokens, bound)

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        return min(prompt_len, self.head_bound)

    @property
    def chunks(self) -> ChunkSchedule:
        return ChunkSchedule(tail=self.local_tail, score=with_sinks(_retaining_scores, self.sink_size),
                             params=self.heads.stacked)

    def compress_layer(self, view: PromptView, keep_bound: int):
        stable = recent(view, self.stabilizers) & ~view.final_chunk[:, None, None]
        scores = jnp.where(stable, jnp.inf, view.slot_score)
        scores = jnp.where(view.valid, scores, NEG)
        if view.pool_threshold is None:
            return keep_top(scores, jnp.minimum(self.evict_budget, view.lengths), keep_bound)
        # pooled: every slot at or above the pool's threshold, the stabilizers besides, at most head_bound
        kept = (view.valid & (view.slot_score >= view.pool_threshold[:, None, None])) | (stable & view.valid)
        return keep_top(scores, jnp.minimum(kept.sum(-1), keep_bound), keep_bound)


def with_sinks(score, sink_size: int):
    """`score` (a `ChunkSchedule.score`) with +inf on the prompt's first `sink_size` positions."""
    if not sink_size:
        return score

    def scored(layer, inputs, params):
        return jnp.where(inputs.positions[:, :, None] < sink_size, jnp.inf, score(layer, inputs, params))

    return scored


def _retaining_scores(layer, inputs, params) -> jax.Array:
    """f32[B, C, H]: the layer's retaining head on each appended token's pre-RoPE q, k and v."""
    from kvjax.policies.locret_heads import retaining_scores, stacked_layer

    return retaining_scores(stacked_layer(params, layer), inputs.q_pre, inputs.k_pre, inputs.v)
