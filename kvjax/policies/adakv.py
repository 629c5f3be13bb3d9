"""Ada-KV (Feng et al., 2024): one layer's budget split across heads by where the top scores fall.

Ada-SnapKV, paper form: with B' = token_budget - window per head, take the top H * B' SnapKV prefix scores
over all heads of the layer; head h's share is cnt_h and its budget round(cnt_h * (1 - alpha) + alpha * B')
(alpha = 0.5). `form="kvpress"` follows kvpress's AdaKVPress instead: each head's top alpha * token_budget
scores are protected (alpha = 0.2 there), then the layer keeps its top H * token_budget scores, window
included.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import LayerView, register_policy
from kvjax.policies.snapkv import SnapKV


def head_counts(scores: jax.Array, total: int) -> jax.Array:
    """int32[B, H]: how many of the layer's top `total` finite scores `[B, H, S]` fall in each head."""
    B, H, S = scores.shape
    total = min(total, H * S)
    top_values, top_index = jax.lax.top_k(scores.reshape(B, H * S), total)
    heads = jnp.where(jnp.isfinite(top_values), top_index // S, H)
    return jax.vmap(lambda h: jnp.bincount(h, length=H + 1)[:H])(heads).astype(jnp.int32)


def adaptive_budgets(policy, view: LayerView, scores: jax.Array, per_head: int) -> jax.Array:
    """Per-head budgets (window included) for a layer whose uniform per-head budget is `per_head`."""
    H = scores.shape[1]
    window = policy.window
    if policy.form == "paper":
        prefix = jnp.where(jnp.isposinf(scores), -jnp.inf, scores)
        base = per_head - window
        count = head_counts(prefix, H * base)
        return jnp.round(count * (1 - policy.alpha) + policy.alpha * base).astype(jnp.int32) + window
    # kvpress: protect each head's top alpha * per_head, then the layer's top H * per_head overall
    safe = int(per_head * policy.alpha)
    if policy.alpha > 0:
        safe = max(1, safe)  # kvpress keeps at least one safeguarded slot per head
        kth = jax.lax.top_k(scores, safe)[0][..., -1:]
        scores = jnp.where(scores >= kth, jnp.finfo(jnp.float32).max, scores)
    scores = jnp.where(jnp.isposinf(scores), jnp.finfo(jnp.float32).max, scores)
    return head_counts(scores, H * per_head)


@dataclasses.dataclass(frozen=True)
class _AdaFields:
    alpha: float = 0.5
    form: str = "paper"

    def _validate_ada(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{self.name}: alpha must be in [0, 1], got {self.alpha}")
        if self.form not in ("paper", "kvpress"):
            raise ValueError(f"{self.name}: form must be 'paper' or 'kvpress', got {self.form!r}")


@register_policy("ada_snapkv")
@dataclasses.dataclass(frozen=True)
class AdaSnapKV(_AdaFields, SnapKV):
    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        self._validate_ada()

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        return min(prompt_len, num_kv_heads * self.token_budget)

    def head_budgets(self, view: LayerView, scores: jax.Array) -> jax.Array:
        return adaptive_budgets(self, view, scores, self.token_budget)
