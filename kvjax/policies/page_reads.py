"""Count the pages a page-selecting policy reads while decoding, for comparisons at equal reads.

Notes: docs/modules.md (`kvjax/policies/page_reads.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from kvjax.policies.base import PageView, Policy, Selector
from kvjax.policies.compose import Compose
from kvjax.policies.quest_adaptive import selected_page_counts


class PageReads:
    """Host-side sums: `pages` read (listed pages plus the current one) over `rows` (layer, sequence, head)
    selections; `mean` is their ratio. Compared by identity."""

    def __init__(self):
        self.pages = 0
        self.rows = 0

    def add(self, counts) -> None:
        counts = np.asarray(counts)
        self.pages += int(counts.sum()) + counts.size  # + the current page of every head
        self.rows += counts.size

    @property
    def mean(self) -> float:
        return self.pages / max(self.rows, 1)


@dataclasses.dataclass(frozen=True)
class CountingSelect(Policy, Selector):
    """`inner`'s page selection (a selecting policy's), reporting each selection's page counts to `tally`."""

    inner: Any = None
    tally: Any = None

    def __hash__(self):
        return hash((self.inner, id(self.tally)))

    def __eq__(self, other):
        return isinstance(other, CountingSelect) and self.inner == other.inner and self.tally is other.tally

    def validate(self, page_size: int) -> None:
        self.inner.validate(page_size)

    def selects_pages(self, layer: int) -> bool:
        return self.inner.selector.selects_pages(layer)

    def select_pages(self, view: PageView):
        selected = self.inner.selector.select_pages(view)
        if selected is not None:
            jax.debug.callback(self.tally.add, selected_page_counts(selected))
        return selected


def counting(policy: Policy, tally: PageReads) -> Policy:
    """`policy` with its page selection counted into `tally` (a selecting policy, or a Compose of one)."""
    if isinstance(policy, Compose):
        return dataclasses.replace(policy, select=CountingSelect(inner=policy.select, tally=tally))
    return CountingSelect(inner=policy, tally=tally)
