"""PyramidKV (Cai et al., 2024) and Ada-Pyramid: budgets that shrink linearly with depth.

With B' = token_budget - window: min = B' // beta, max = 2 B' - min (beta = 20); layer l keeps
max - l * ((max - min) // (L - 1)) prefix slots plus the window, clamped to the prompt (the authors'
integer arithmetic). Slots are scored as in SnapKV. Ada-Pyramid splits each layer's budget across heads
as Ada-SnapKV does.

Fields (defaults; the paper's in brackets): SnapKV's (`token_budget` 128, `window` 32 [32], `kernel_size`
7 [7], `pooling` "max"), `beta` 20 [20]; Ada-Pyramid adds Ada-KV's `alpha` 0.5 and `form` "paper".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.adakv import _AdaFields, adaptive_budgets
from kvjax.policies.base import LayerView, register_policy
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
        """Every layer's budget (static); the steps index it with a traced layer, as data."""
        return tuple(self.layer_budget(l, num_layers) for l in range(num_layers))

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        return min(prompt_len, self.layer_budget(0, 2))

    def head_budgets(self, view: LayerView, scores: jax.Array) -> jax.Array:
        budget = jnp.asarray(self.layer_budgets(view.num_layers), jnp.int32)[view.layer]
        return jnp.full(view.lengths.shape, budget, jnp.int32)


@register_policy("ada_pyramid")
@dataclasses.dataclass(frozen=True)
class AdaPyramid(_AdaFields, PyramidKV):
    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        self._validate_ada()

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        return min(prompt_len, num_kv_heads * self.layer_budget(0, 2))

    def head_budgets(self, view: LayerView, scores: jax.Array) -> jax.Array:
        return adaptive_budgets(self, view, scores, self.layer_budgets(view.num_layers))
