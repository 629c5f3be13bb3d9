"""Adaptive Quest (the idea of Twilight, Lin et al., 2025, from Quest's authors): per head, read the fewest
pages whose estimated attention mass reaches `top_p`, instead of a fixed number of pages.

Notes: docs/modules.md (`kvjax/policies/quest_adaptive.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import PageView, register_policy
from kvjax.policies.quest import Quest


def top_p_pages(scores: jax.Array, scale: float, top_p: float, min_pages: int, cap: int) -> jax.Array:
    """Pages `int32[B, R, cap]` (-1 = none) from page bounds `scores f32[B, R, P]` (-inf = not a candidate):
    per row the highest-scoring pages whose mass softmax(scores * scale) reaches `top_p`, at least
    `min_pages`, at most `cap`, best first. `top_p >= 1` takes every candidate up to the cap (Quest)."""
    candidate = jnp.isfinite(scores)
    width = min(cap, scores.shape[-1])
    values, pages = jax.lax.top_k(scores, width)  # [B, R, width] best first (ties: lower page)
    top = jnp.max(jnp.where(candidate, scores, -jnp.inf), axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows without a candidate
    weights = jnp.where(candidate, jnp.exp((scores - top) * scale), 0.0)
    total = jnp.maximum(weights.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    mass = jnp.where(jnp.isfinite(values), jnp.exp((values - top) * scale), 0.0) / total
    before = jnp.cumsum(mass, axis=-1) - mass  # mass of the better pages; non-decreasing, so a prefix is taken
    rank = jnp.arange(width)
    take = ((before < top_p) | (top_p >= 1.0) | (rank < min_pages)) & jnp.isfinite(values)
    chosen = jnp.where(take, pages, -1).astype(jnp.int32)
    return jnp.pad(chosen, ((0, 0), (0, 0), (0, cap - width)), constant_values=-1)


def selected_page_counts(selected: jax.Array) -> jax.Array:
    """int32[B, R]: pages a selection `int32[B, R, K]` lists (-1 = none), the current page not counted.
    Averaged over rows, it is the "pages read per head" of a decode step beyond the current page."""
    return jnp.sum(selected >= 0, axis=-1).astype(jnp.int32)


@register_policy("quest_adaptive")
@dataclasses.dataclass(frozen=True)
class QuestAdaptive(Quest):
    top_p: float = 0.9
    min_pages: int = 1

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"quest_adaptive: top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_pages <= self.pages_to_select(page_size):
            raise ValueError(
                f"quest_adaptive: min_pages must be in [0, token_budget // page_size - 1 = "
                f"{self.pages_to_select(page_size)}], got {self.min_pages}"
            )

    def select_pages(self, view: PageView) -> jax.Array:
        """Logical pages `int32[B, Hq or H, K]` (-1 = none), K = token_budget // ps - 1."""
        cap = self.pages_to_select(view.page_size)
        return top_p_pages(self.page_bounds(view), view.q.shape[-1] ** -0.5, self.top_p, self.min_pages, cap)
