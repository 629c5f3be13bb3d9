"""SnapKV (Li et al., 2024): the last `window` prompt queries vote for prefix keys.

Notes: docs/modules.md (`kvjax/policies/snapkv.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import PromptView, register_policy
from kvjax.policies.eviction import NEG, ScoredEviction, _check_budget, pool_scores, recent, window_attention


@register_policy("snapkv")
@dataclasses.dataclass(frozen=True)
class SnapKV(ScoredEviction):
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    @property
    def window_size(self) -> int:
        return self.window

    @property
    def always_kept(self) -> int:
        return self.window

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        _check_budget(self, self.window, "window")
        if self.kernel_size < 1:
            raise ValueError(f"{self.name}: kernel_size must be >= 1, got {self.kernel_size}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"{self.name}: pooling must be 'max' or 'avg', got {self.pooling!r}")

    def prefix_scores(self, view: PromptView):
        """(pooled prefix scores f32[B, H, S] (-inf outside the prefix), window mask bool[B, H, S])."""
        votes = window_attention(view).mean(axis=2)  # GQA: mean over the group
        in_window = recent(view, self.window)
        prefix = view.valid & ~in_window
        return jnp.where(prefix, pool_scores(votes, self.kernel_size, self.pooling, prefix), NEG), in_window

    def scores(self, view: PromptView):
        pooled, in_window = self.prefix_scores(view)
        return jnp.where(in_window, jnp.inf, pooled)
