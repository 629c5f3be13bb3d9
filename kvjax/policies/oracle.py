"""Evaluation-only oracles of query-aware selection: what any page (or token) selection could reach.

Notes: docs/modules.md (`kvjax/policies/oracle.py`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies.base import PageView, register_policy
from kvjax.policies.quest import Quest


def exact_page_scores(view: PageView, page_table, page_size: int, per_kv_head: bool) -> jax.Array:
    """f32[B, Hq or H, P]: max over each logical page's slots of q.k (-inf at the current page and past the
    used pages), pages of `view.k_pages` (reshaped to `page_size` slots) listed by `page_table`."""
    from kvjax.pallas_kernels.sketch_scores import sketch_page_scores

    k_pages = view.k_pages
    if k_pages.dtype == jnp.int8:
        raise NotImplementedError("the oracle selectors score float key pages, not int8 ones")
    k_pages = k_pages.reshape(-1, page_size, k_pages.shape[-1])
    return sketch_page_scores(view.q, k_pages, page_table, view.lengths, page_size=page_size,
                              per_kv_head=per_kv_head)


@register_policy("oracle_page")
@dataclasses.dataclass(frozen=True)
class OraclePage(Quest):
    def page_bounds(self, view: PageView) -> jax.Array:
        return exact_page_scores(view, view.page_table, view.page_size, self.per_kv_head)


@register_policy("oracle_token")
@dataclasses.dataclass(frozen=True)
class OracleToken(Quest):
    unit: ClassVar[str] = "slot"  # lists single slots: decode reads them, not pages

    def select_pages(self, view: PageView) -> jax.Array:
        """Slots `int32[B, Hq or H, token_budget - 1]` (-1 = none) in the layer's logical slot order."""
        from kvjax import pallas_kernels
        from kvjax.cache.attention import slot_table

        scores = exact_page_scores(view, slot_table(view.page_table, view.page_size), 1, self.per_kv_head)
        return pallas_kernels.select_top_pages(scores, self.token_budget - 1)
