"""TOVA (Oren et al., 2024): keep the tokens the newest query attends to most, averaged over all heads.

Notes: docs/modules.md (`kvjax/policies/tova.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import DecodeEvictor, DecodeView, PromptView, register_policy
from kvjax.policies.eviction import ScoredEviction, window_attention


def _head_average(probs):  # [B, H, G, S] -> [B, H, S], the same row for every kv head
    mean = probs.mean(axis=(1, 2))
    return jnp.broadcast_to(mean[:, None, :], (probs.shape[0], probs.shape[1], probs.shape[3]))


@register_policy("tova")
@dataclasses.dataclass(frozen=True)
class TOVA(ScoredEviction, DecodeEvictor):
    @property
    def window_size(self) -> int:
        return 1

    @property
    def always_kept(self) -> int:
        return 1  # the newest token: the last query's own

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        # the cache grows to budget + 1 before a decode step evicts
        return min(prompt_len + max_new_tokens, max(prompt_len, self.token_budget + 1))

    def scores(self, view: PromptView):
        newest = view.slot_pos == view.next_position[:, None, None] - 1
        return jnp.where(newest, jnp.inf, _head_average(window_attention(view)))

    def decode_scores(self, view: DecodeView):
        return _head_average(view.probs)
