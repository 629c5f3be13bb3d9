"""PyramidKV (Cai et al., 2024): budgets that shrink linearly with depth.

Notes: docs/modules.md (`kvjax/policies/pyramid.py`)."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import register_policy
from kvjax.policies.snapkv import SnapKV


@register_policy("pyramid")
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    beta: int = 20

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if self.beta < 1:
            raise ValueError(f"{self.name}: beta must be >= 1, got {self.beta}")

    def layer_budget(self, layer: int, num_layers: int) -> int:
        base = self.token_budget - self.window
        least = base // self.beta
        most = 2 * base - least
        step = (most - least) // max(num_layers - 1, 1)
        return most - layer * step + self.window

    def layer_budgets(self, num_layers: int) -> tuple[int, ...]:
        return tuple(self.layer_budget(l, num_layers) for l in range(num_layers))
