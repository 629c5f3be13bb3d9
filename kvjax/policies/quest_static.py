"""A query-agnostic control for Quest: the same page score, but pages chosen once, before the question.

Notes: docs/modules.md (`kvjax/policies/quest_static.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import PromptView, register_policy
from kvjax.policies.eviction import ScoredEviction


@register_policy("quest_static")
@dataclasses.dataclass(frozen=True)
class QuestStatic(ScoredEviction):
    token_budget: int = 64
    page_size: int = 16  # pages are `page_size` consecutive kept slots, as in the cache

    @property
    def window_size(self) -> int:
        return 1

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if self.page_size != page_size:
            raise ValueError(f"quest_static: page_size={self.page_size} does not match the cache's {page_size}")
        if self.token_budget < 2 * page_size:
            raise ValueError(f"quest_static: token_budget must be >= 2 * page_size = {2 * page_size}")

    def head_budgets(self, view: PromptView, scores: jax.Array) -> jax.Array:
        return jnp.full(view.lengths.shape, (self.token_budget // self.page_size) * self.page_size, jnp.int32)

    def scores(self, view: PromptView) -> jax.Array:
        B, H, S, D = view.k.shape
        ps = self.page_size
        P = -(-S // ps)
        pad = P * ps - S
        k = jnp.pad(view.k.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
        valid = jnp.pad(view.valid, ((0, 0), (0, 0), (0, pad)))[..., None]
        kmin = jnp.where(valid, k, jnp.inf).reshape(B, H, P, ps, D).min(axis=3)  # [B, H, P, D]
        kmax = jnp.where(valid, k, -jnp.inf).reshape(B, H, P, ps, D).max(axis=3)
        q = view.window_q[:, -1].astype(jnp.float32)  # [B, Hq, D]: the last prompt query
        qg = q.reshape(B, H, q.shape[1] // H, 1, D)
        page = jnp.maximum(qg * kmin[:, :, None], qg * kmax[:, :, None]).sum(-1).max(axis=2)  # [B, H, P]
        page = jnp.where(jnp.isfinite(page), page, -jnp.inf)
        current = (view.lengths - 1) // ps  # [B, H]
        page = jnp.where(jnp.arange(P)[None, None, :] == current[..., None], jnp.inf, page)
        slot_page = jnp.arange(S) // ps
        # every slot of a page gets the page's score; ties within a page resolve to the page's slots
        return jnp.take_along_axis(page, jnp.broadcast_to(slot_page, (B, H, S)), axis=-1)
