"""Quest (Tang et al., 2024): query-aware page selection; every slot is kept.

Notes: docs/modules.md (`kvjax/policies/quest.py`)."""

from __future__ import annotations

import dataclasses

import jax

from kvjax.policies.base import PageView, Policy, Selector, register_policy


@register_policy("quest")
@dataclasses.dataclass(frozen=True)
class Quest(Policy, Selector):
    token_budget: int = 64  # slots a decode step reads per head (selected pages plus the current one)
    page_size: int | None = None  # must equal the cache's; None takes the cache's
    dense_layers: int = 2
    per_kv_head: bool = False

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if self.page_size is not None and self.page_size != page_size:
            raise ValueError(
                f"quest: page_size={self.page_size} does not match the cache's page_size={page_size}; "
                "Quest's metadata is per cache page"
            )
        if self.token_budget <= 0:
            raise ValueError(f"quest: token_budget must be > 0, got {self.token_budget}")
        if self.token_budget // page_size < 2:
            raise ValueError(
                f"quest: token_budget={self.token_budget} with page_size={page_size} selects no page besides "
                f"the current one; token_budget must be >= {2 * page_size}"
            )

    def pages_to_select(self, page_size: int) -> int:
        return self.token_budget // page_size - 1

    def page_bounds(self, view: PageView) -> jax.Array:
        """Quest's bound of q.k per logical page, `f32[B, Hq or H, P]`; -inf for the current page and pages
        past the length."""
        from kvjax import pallas_kernels

        return pallas_kernels.quest_page_scores(
            view.q, view.kmin, view.kmax, view.page_table, view.lengths, page_size=view.page_size,
            per_kv_head=self.per_kv_head,
        )

    def select_pages(self, view: PageView) -> jax.Array:
        """Logical pages `int32[B, Hq or H, K]` (-1 = none): each head's top K = token_budget // ps - 1."""
        from kvjax import pallas_kernels

        return pallas_kernels.select_top_pages(self.page_bounds(view), self.pages_to_select(view.page_size))
