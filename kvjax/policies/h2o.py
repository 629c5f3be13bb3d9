"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus the most recent tokens.

Notes: docs/modules.md (`kvjax/policies/h2o.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import DecodeEvictor, DecodeView, PromptView, register_policy
from kvjax.policies.eviction import ScoredEviction, _check_budget, recent


@register_policy("h2o")
@dataclasses.dataclass(frozen=True)
class H2O(ScoredEviction, DecodeEvictor):
    recent_size: int | None = None
    accumulates_attention = True

    @property
    def recent(self) -> int:
        return self.token_budget // 2 if self.recent_size is None else self.recent_size

    @property
    def always_kept(self) -> int:
        return self.recent

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        _check_budget(self, self.recent, "recent_size")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        # the cache grows to budget + 1 before a decode step evicts
        return min(prompt_len + max_new_tokens, max(prompt_len, self.token_budget + 1))

    def scores(self, view: PromptView):
        return jnp.where(recent(view, self.recent), jnp.inf, view.slot_score)

    def decode_scores(self, view: DecodeView):
        return self.scores(view)
