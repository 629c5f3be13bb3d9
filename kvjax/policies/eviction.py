"""Shared machinery of the eviction methods: a budget, per-slot scores, top-k keep sets, window attention.

`ScoredEviction` turns a method's `scores` (higher = keep) and `head_budgets` into the keep set of each
(sequence, kv-head). Subclasses (SnapKV, H2O, TOVA, StreamingLLM, Ada-*, Pyramid*) are a few lines each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.attention import masked_attention
from kvjax.policies.base import Compressor, DecodeView, Policy, PromptView

NEG = -jnp.inf


def _check_budget(policy, window: int = 0, window_name: str = "window_size") -> None:
    if policy.token_budget <= 0:
        raise ValueError(f"{policy.name}: token_budget must be > 0, got {policy.token_budget}")
    if window < 0:
        raise ValueError(f"{policy.name}: {window_name} must be >= 0, got {window}")
    if window >= policy.token_budget:
        raise ValueError(
            f"{policy.name}: {window_name}={window} must be smaller than token_budget={policy.token_budget}"
        )


@dataclasses.dataclass(frozen=True)
class ScoredEviction(Policy, Compressor):
    """Keep, per (sequence, kv-head), the `head_budgets` highest-`scores` slots of the prompt."""

    token_budget: int = 128

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        _check_budget(self)

    @property
    def always_kept(self) -> int:
        """Slots per head `scores` marks +inf, kept outside any budget split (Ada-KV): SnapKV's window, H2O's
        recent tokens, TOVA's newest token."""
        return 0

    def layer_budgets(self, num_layers: int) -> tuple[int, ...]:
        """Each layer's per-head budget (static): `token_budget` in every layer, or PyramidKV's pyramid. The
        steps index it with their traced layer, as data."""
        return (self.token_budget,) * num_layers

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        return min(prompt_len, max(self.layer_budgets(2)))

    def scores(self, view: PromptView | DecodeView) -> jax.Array:
        """f32[B, H, S], higher = keep; -inf where a slot is invalid. A decode-time evictor may score its
        `DecodeView` with it too (the slot fields are the same)."""
        raise NotImplementedError

    def head_budgets(self, view: PromptView, scores: jax.Array) -> jax.Array:
        """int32[B, H] slots to keep per head (before clamping to the length): the layer's budget."""
        budget = jnp.asarray(self.layer_budgets(view.num_layers), jnp.int32)[view.layer]
        return jnp.full(view.lengths.shape, budget, jnp.int32)

    def compress_layer(self, view: PromptView, keep_bound: int):
        scores = jnp.where(view.valid, self.scores(view), NEG)
        budgets = jnp.minimum(self.head_budgets(view, scores), view.lengths)
        return keep_top(scores, budgets, keep_bound)


def keep_top(scores: jax.Array, budgets: jax.Array, keep_bound: int):
    """The `budgets[b, h]` best slots of `scores [B, H, S]`, in slot order, padded to `keep_bound`."""
    S = scores.shape[-1]
    _, top = jax.lax.top_k(scores, min(keep_bound, S))  # [B, H, K] best first
    rank = jnp.arange(top.shape[-1])[None, None, :]
    keep = jnp.where(rank < budgets[:, :, None], top, S)  # S sorts after every real slot
    keep = jnp.sort(keep, axis=-1)
    return jnp.where(keep < S, keep, -1).astype(jnp.int32), budgets.astype(jnp.int32)


def window_attention(view: PromptView) -> jax.Array:
    """Softmax attention of the window queries over the layer's slots, averaged over the window:
    f32[B, H, G, S]. Causal by original position; rows before the prompt start are ignored."""
    q, qpos = view.window_q, view.window_pos  # [B, w, Hq, D], [B, w]
    visible = view.valid[:, :, None, None, :] & (view.slot_pos[:, :, None, None, :] <= qpos[:, None, None, :, None])
    # the one masked-attention reference; its output is unused (and dropped by XLA), the values are the keys
    _, probs = masked_attention(q, view.k, view.k, visible, return_probs=True)  # [B, H, G, w, S], 0 where not visible
    probs = jnp.where((qpos >= 0)[:, None, None, :, None], probs, 0.0)
    return probs.sum(axis=3) / jnp.maximum((qpos >= 0).sum(-1), 1)[:, None, None, None]


def pool_scores(scores: jax.Array, kernel: int, pooling: str, region: jax.Array) -> jax.Array:
    """1-D pooling along slots of `scores [B, H, S]` restricted to `region bool[B, H, S]` ('same' size;
    outside the region counts as padding: -inf for max, 0 for avg with the full kernel as divisor)."""
    if kernel <= 1:
        return scores
    pad = kernel // 2
    if pooling == "max":
        x = jnp.where(region, scores, NEG)
        x = jnp.pad(x, ((0, 0), (0, 0), (pad, pad)), constant_values=NEG)
        return jax.lax.reduce_window(x, NEG, jax.lax.max, (1, 1, kernel), (1, 1, 1), "VALID")
    if pooling == "avg":
        x = jnp.where(region, scores, 0.0)
        x = jnp.pad(x, ((0, 0), (0, 0), (pad, pad)))
        return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, kernel), (1, 1, 1), "VALID") / kernel
    raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")


def recent(view: PromptView | DecodeView, count) -> jax.Array:
    """bool[B, H, S]: slots among the newest `count` positions of each sequence."""
    return view.valid & (view.slot_pos >= view.next_position[:, None, None] - count)
