"""PyramidKV (Cai et al., 2024): budgets that shrink linearly with depth.

With B' = token_budget - window: min = B' // beta, max = 2 B' - min (beta = 20); layer l keeps
max - l * ((max - min) // (L - 1)) prefix slots plus the window, clamped to the prompt (the authors'
integer arithmetic). Slots are scored as in SnapKV. Ada-Pyramid (`ada_pyramid`) is `ada` over it.

Fields (defaults; the paper's in brackets): SnapKV's (`token_budget` 128, `window` 32 [32], `kernel_size`
7 [7], `pooling` "max"), `beta` 20 [20].
"""

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
