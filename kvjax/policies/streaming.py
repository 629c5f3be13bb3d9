"""StreamingLLM (Xiao et al., 2024): attention sinks plus a window of the most recent tokens.

Notes: docs/modules.md (`kvjax/policies/streaming.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import DecodeEvictor, DecodeView, PromptView, register_policy
from kvjax.policies.eviction import ScoredEviction, _check_budget


@register_policy("streaming")
@dataclasses.dataclass(frozen=True)
class StreamingLLM(ScoredEviction, DecodeEvictor):
    sink_size: int = 4

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        _check_budget(self, self.sink_size, "sink_size")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        # the cache grows to budget + 1 before a decode step evicts
        return min(prompt_len + max_new_tokens, max(prompt_len, self.token_budget + 1))

    def scores(self, view: PromptView):
        return jnp.where(view.slot_pos < self.sink_size, jnp.inf, view.slot_pos.astype(jnp.float32))

    def decode_scores(self, view: DecodeView):
        return self.scores(view)
