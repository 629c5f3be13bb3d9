"""Ada-KV's per-head budget allocation (Feng et al., 2024) over any scored eviction, as kvpress's
`AdaKVPress(press)` wraps any press.

Notes: docs/modules.md (`kvjax/policies/ada.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.policies.base import (
    POLICY_REGISTRY, Compressor, Policy, PromptView, make_policy, register_policy, register_preset,
)
from kvjax.policies.eviction import NEG, ScoredEviction, keep_top
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


def adaptive_budgets(policy, view: PromptView, scores: jax.Array, per_head: tuple[int, ...]) -> jax.Array:
    """int32[B, H] per-head budgets (window included) for the view's layer, whose uniform per-head budget is
    `per_head[layer]` (every layer's, static; taken at the traced `view.layer` as data)."""

    def per_layer(f, dtype=jnp.int32):
        """f(budget) for the view's layer: computed in Python for every layer, then indexed."""
        return jnp.asarray([f(b) for b in per_head], dtype)[view.layer]

    H = scores.shape[1]
    window = policy.window
    most = max(per_head)
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


@register_policy("ada")
@dataclasses.dataclass(frozen=True)
class AdaKV(Policy, Compressor):
    """The compressor: Ada's allocation over `scorer`'s scores, in the scorer's layers, with its inputs."""

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

    @property
    def window(self) -> int:
        """Slots per head kept outside the allocation (`adaptive_budgets` reads it)."""
        return self.scorer.always_kept

    @property
    def token_budget(self) -> int:
        return self.scorer.token_budget

    # what the scorer reads, it reads under Ada too
    @property
    def window_size(self) -> int:
        return self.scorer.window_size

    @property
    def accumulates_attention(self) -> bool:  # type: ignore[override]
        return self.scorer.accumulates_attention

    def compresses_layer(self, layer: int) -> bool:
        return self.scorer.compresses_layer(layer)

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

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        return prompt_len + max_new_tokens  # Ada allocates at compression only: nothing evicts while decoding

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        return min(prompt_len, num_kv_heads * max(self.scorer.layer_budgets(2)))

    def compress_layer(self, view: PromptView, keep_bound: int):
        scores = jnp.where(view.valid, self.scorer.scores(view), NEG)
        budgets = adaptive_budgets(self, view, scores, self.scorer.layer_budgets(view.num_layers))
        return keep_top(scores, jnp.minimum(budgets, view.lengths), keep_bound)


register_preset("ada_snapkv", "ada", scorer="snapkv")
register_preset("ada_pyramid", "ada", scorer="pyramid")
