"""KVzip (Kim et al., 2025): each prompt slot scored by the attention it gets while the model repeats the
prompt, then the budget pooled over all layers and kv heads (kvpress's `KVzipPress`).

Notes: docs/modules.md (`kvjax/policies/kvzip.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import Compressor, Policy, PromptView, ScoringPass, register_policy
from kvjax.policies.eviction import NEG, _check_budget, keep_top

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
INSTRUCTION_ROOM = 128  # slots for a repeat chunk's instruction, overlap and turn end (the engine checks it)
POOLS = ("all", "layer", "head")


def top_members(scores: jax.Array, count: int) -> jax.Array:
    """bool `scores.shape`: the `count` largest entries above -inf along the last axis (lower index first on ties)."""
    count = min(count, scores.shape[-1])
    _, index = jax.lax.top_k(scores, count)
    rows = scores.reshape(-1, scores.shape[-1])
    hit = jax.vmap(lambda i: jnp.zeros(rows.shape[-1], bool).at[i].set(True))(index.reshape(-1, count))
    return hit.reshape(scores.shape) & (scores > NEG)


@register_policy("kvzip")
@dataclasses.dataclass(frozen=True)
class KVzip(Policy, Compressor):
    token_budget: int = 128  # slots kept per kv head and compressed layer, on average over what `pool` spans
    pool: str = "all"  # the budget pooled over all compressed layers and heads, over a layer's heads, or per head
    sink_size: int = 4  # first prompt slots always kept (kvpress's n_sink)
    chunk: int = 2048  # prompt tokens repeated per pass (kvpress's chunk_size)
    overlap: int = 8  # tokens of the previous chunk quoted before the next (kvpress's prev_postfix_size)

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        _check_budget(self, self.sink_size, "sink_size")
        if self.pool not in POOLS:
            raise ValueError(f"kvzip: pool must be one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.chunk <= 0 or not 0 <= self.overlap <= self.chunk:
            raise ValueError(f"kvzip: need chunk > 0 and 0 <= overlap <= chunk, got chunk={self.chunk}, "
                             f"overlap={self.overlap}")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        # the reconstruction appends one repeat chunk (and its instruction) after the prompt, then drops it
        return prompt_len + max(max_new_tokens, min(self.chunk, prompt_len) + INSTRUCTION_ROOM)

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        most = {"head": self.token_budget, "layer": self.token_budget * num_kv_heads}.get(self.pool, prompt_len)
        return min(prompt_len, most)

    @property
    def scoring_pass(self) -> ScoringPass:
        return ScoringPass(self.chunk, self.sink_size, FIRST, LATER, self.overlap, self.pool_scores)

    def pool_scores(self, scores: jax.Array) -> jax.Array:
        """`scores f32[L, B, H, S]` (-inf where no prompt slot) with -inf on every slot to evict: the top
        `token_budget` per head, `token_budget * H` per layer, or `token_budget * H * L'` per sequence over
        the L' compressed layers."""
        L, B, H, S = scores.shape
        compressed = [self.compresses_layer(layer) for layer in range(L)]
        scores = jnp.where(jnp.asarray(compressed)[:, None, None, None], scores, NEG)
        if self.pool == "head":
            keep = top_members(scores, self.token_budget)
        elif self.pool == "layer":
            keep = top_members(scores.reshape(L, B, H * S), self.token_budget * H).reshape(scores.shape)
        else:
            flat = jnp.moveaxis(scores, 1, 0).reshape(B, L * H * S)
            keep = top_members(flat, self.token_budget * H * sum(compressed))
            keep = jnp.moveaxis(keep.reshape(B, L, H, S), 0, 1)
        return jnp.where(keep, scores, NEG)

    def compress_layer(self, view: PromptView, keep_bound: int):
        """Each head keeps its slots the pooled scores left above -inf (`pool_scores`, after the scoring pass)."""
        scores = jnp.where(view.valid, view.slot_score, NEG)
        return keep_top(scores, (scores > NEG).sum(-1).astype(jnp.int32), keep_bound)
