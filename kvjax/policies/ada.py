"""Ada-KV's per-head budget allocation (Feng et al., 2024) over any scored eviction, as kvpress's
`AdaKVPress(press)` wraps any press: `AdaKV(scorer=H2O(...))` is Ada-H2O, `AdaKV(scorer=SnapKV(...))` is
Ada-SnapKV (the same keep sets as `ada_snapkv`), `AdaKV(scorer=PyramidKV(...))` Ada-Pyramid.

The scorer says how slots score (`scores`, +inf for the slots it always keeps: SnapKV's window, H2O's
recent tokens, TOVA's newest) and what one head keeps on average (`token_budget`, or PyramidKV's
per-layer budgets). Ada-KV only decides how a layer's total is split across its heads:

- paper form (alpha = 0.5): with w the scorer's always-kept slots and B' = budget - w, take the layer's
  top H * B' scores outside those slots over all heads; head h's share is cnt_h and its budget
  round(cnt_h * (1 - alpha) + alpha * B') + w.
- kvpress form (alpha = 0.2 there): each head's top max(1, int(alpha * budget)) scores are protected,
  then the layer keeps its top H * budget scores, protected and always-kept slots first.

Fields (defaults): `scorer` the wrapped `ScoredEviction` (SnapKV()); `alpha` 0.5 (the paper's; kvpress's
0.2 with `form="kvpress"`); `form` "paper". `make_policy("ada", scorer="h2o", token_budget=64)` builds the
scorer by name from the options that are not Ada's. Ada-KV allocates at compression only, as in the paper
and kvpress: the wrapper does not evict while decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvjax.policies.adakv import adaptive_budgets
from kvjax.policies.base import POLICY_REGISTRY, LayerView, Policy, make_policy, register_policy
from kvjax.policies.eviction import NEG, ScoredEviction, keep_top
from kvjax.policies.snapkv import SnapKV


def always_kept(scorer: ScoredEviction) -> int:
    """Slots per head the scorer scores +inf (kept outside the allocation): SnapKV's `window`, H2O's
    `recent`, TOVA's newest token; 0 for scorers without such slots."""
    for name in ("window", "recent"):
        if hasattr(scorer, name):
            return int(getattr(scorer, name))
    return scorer.window_size  # TOVA: the last query's own token


@register_policy("ada")
@dataclasses.dataclass(frozen=True)
class AdaKV(Policy):
    scorer: Any = dataclasses.field(default_factory=SnapKV)
    alpha: float = 0.5
    form: str = "paper"

    @classmethod
    def from_options(cls, scorer: Any = "snapkv", alpha: float = 0.5, form: str = "paper", **scorer_options) -> "AdaKV":
        """`make_policy("ada", scorer="h2o", token_budget=64, ...)`: a scorer given by name is built with the
        options that are not Ada's own (token_budget, window, dense_layers, ...)."""
        if isinstance(scorer, str):
            scorer = make_policy(scorer, **scorer_options)
        elif scorer_options:
            raise ValueError(f"ada: options {sorted(scorer_options)} belong to the scorer; give them to it")
        return cls(scorer=scorer, alpha=alpha, form=form)

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        scorer = POLICY_REGISTRY.get(options.get("scorer", "snapkv"))
        parts = {} if scorer is None else scorer.option_types(options)
        return {**parts, "scorer": str, "alpha": float, "form": str}

    # the scorer's inputs and sizes
    @property
    def accumulates_attention(self) -> bool:  # type: ignore[override]
        return self.scorer.accumulates_attention

    @property
    def window_size(self) -> int:
        return self.scorer.window_size

    @property
    def window(self) -> int:
        """Slots per head kept outside the allocation (`adaptive_budgets` reads it)."""
        return always_kept(self.scorer)

    @property
    def token_budget(self) -> int:
        return self.scorer.token_budget

    def validate(self, page_size: int) -> None:
        if not isinstance(self.scorer, ScoredEviction):
            raise TypeError(f"ada: scorer must be a scored eviction policy (snapkv, h2o, tova, ...), got {self.scorer!r}")
        if self.dense_layers:
            raise ValueError("ada: give dense_layers to the scorer")
        self.scorer.validate(page_size)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"ada: alpha must be in [0, 1], got {self.alpha}")
        if self.form not in ("paper", "kvpress"):
            raise ValueError(f"ada: form must be 'paper' or 'kvpress', got {self.form!r}")

    def compresses_layer(self, layer: int) -> bool:
        return self.scorer.compresses_layer(layer)

    def per_head(self, num_layers: int):
        """The uniform per-head budget the allocation splits: an int, or every layer's (PyramidKV)."""
        if hasattr(self.scorer, "layer_budgets"):
            return self.scorer.layer_budgets(num_layers)
        return self.token_budget

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        most = self.scorer.layer_budget(0, 2) if hasattr(self.scorer, "layer_budget") else self.token_budget
        return min(prompt_len, num_kv_heads * most)

    def compress_layer(self, view: LayerView, keep_bound: int):
        scores = jnp.where(view.valid, self.scorer.scores(view), NEG)
        budgets = adaptive_budgets(self, view, scores, self.per_head(view.num_layers))
        return keep_top(scores, jnp.minimum(budgets, view.lengths), keep_bound)
