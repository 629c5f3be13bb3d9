"""Ada-KV (Feng et al., 2024): one layer's budget split across heads by where the top scores fall.

Ada-SnapKV, paper form: with B' = token_budget - window per head, take the top H * B' SnapKV prefix scores
over all heads of the layer; head h's share is cnt_h and its budget round(cnt_h * (1 - alpha) + alpha * B')
(alpha = 0.5). `form="kvpress"` follows kvpress's AdaKVPress instead: each head's top alpha * token_budget
scores are protected (alpha = 0.2 there), then the layer keeps its top H * token_budget scores, window
included.

Fields (defaults; the paper's in brackets): SnapKV's (`token_budget` 128, `window` 32, `kernel_size` 7,
`pooling` "max"), `alpha` 0.5 [0.5; kvpress 0.2], `form` "paper". `ada` (kvjax/policies/ada.py) is the
same allocation over any scorer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import LayerView, register_policy
from kvjax.policies.snapkv import SnapKV


def head_counts(scores: jax.Array, total, most: int | None = None) -> jax.Array:
    """int32[B, H]: how many of the layer's top `total` finite scores `[B, H, S]` fall in each head. `total`
    may be traced (a per-layer budget inside the steps' scan) when the static `most` bounds it."""
    B, H, S = scores.shape
    k = min(total if most is None else most, H * S)
    top_values, top_index = jax.lax.top_k(scores.reshape(B, H * S), k)  # sorted: the first `total` are the top
    real = jnp.isfinite(top_values) & (jnp.arange(k) < total)
    heads = jnp.where(real, top_index // S, H)
    return jax.vmap(lambda h: jnp.bincount(h, length=H + 1)[:H])(heads).astype(jnp.int32)


def adaptive_budgets(policy, view: LayerView, scores: jax.Array, per_head: int | tuple[int, ...]) -> jax.Array:
    """Per-head budgets (window included) for a layer whose uniform per-head budget is `per_head`: an int,
    or a tuple of every layer's (PyramidKV), taken at `view.layer` (traced) as data."""

    def per_layer(f, dtype=jnp.int32):
        """f(budget) for the view's layer: computed in Python per layer, then indexed (exact as before)."""
        if isinstance(per_head, tuple):
            return jnp.asarray([f(b) for b in per_head], dtype)[view.layer]
        return f(per_head)

    H = scores.shape[1]
    window = policy.window
    most = max(per_head) if isinstance(per_head, tuple) else per_head
    if policy.form == "paper":
        prefix = jnp.where(jnp.isposinf(scores), -jnp.inf, scores)
        base = per_layer(lambda b: b - window)
        count = head_counts(prefix, H * base, H * (most - window))
        share = per_layer(lambda b: policy.alpha * (b - window), jnp.float32)
        return jnp.round(count * (1 - policy.alpha) + share).astype(jnp.int32) + window
    # kvpress: protect each head's top alpha * per_head, then the layer's top H * per_head overall
    if policy.alpha > 0:
        safe = per_layer(lambda b: max(1, int(b * policy.alpha)))  # kvpress keeps at least one safeguarded slot
        top = jax.lax.top_k(scores, max(1, int(most * policy.alpha)))[0]
        kth = jnp.take(top, safe - 1, axis=-1)[..., None]
        scores = jnp.where(scores >= kth, jnp.finfo(jnp.float32).max, scores)
    scores = jnp.where(jnp.isposinf(scores), jnp.finfo(jnp.float32).max, scores)
    return head_counts(scores, H * per_layer(lambda b: b), H * most)


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
