"""Composition: evict with one policy, then select pages at decode with another (e.g. SnapKV then Quest)."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import LayerView, Policy, register_policy


@register_policy("compose")
@dataclasses.dataclass(frozen=True)
class Compose(Policy):
    """`make_policy("compose", evict=make_policy("snapkv", ...), select=make_policy("quest", ...))`."""

    evict: Policy = dataclasses.field(default_factory=Policy)
    select: Policy = dataclasses.field(default_factory=Policy)

    @property
    def compresses(self) -> bool:  # type: ignore[override]
        return self.evict.compresses

    @property
    def evicts_while_decoding(self) -> bool:  # type: ignore[override]
        return self.evict.evicts_while_decoding

    @property
    def accumulates_attention(self) -> bool:  # type: ignore[override]
        return self.evict.accumulates_attention

    @property
    def window_size(self) -> int:
        return self.evict.window_size

    def validate(self, page_size: int) -> None:
        for part in (self.evict, self.select):
            if not isinstance(part, Policy):
                raise TypeError(f"compose: evict and select must be policies, got {type(part).__name__}")
            part.validate(page_size)

    def slots_needed(self, prompt_len, max_new_tokens, chunk_size):
        return self.evict.slots_needed(prompt_len, max_new_tokens, chunk_size)

    def kept_bound(self, prompt_len, num_kv_heads):
        return self.evict.kept_bound(prompt_len, num_kv_heads)

    def decode_budget(self, prompt_len):
        return self.evict.decode_budget(prompt_len)

    def compresses_layer(self, layer: int) -> bool:
        return self.evict.compresses_layer(layer)

    def compress_layer(self, view: LayerView, keep_bound: int):
        return self.evict.compress_layer(view, keep_bound)

    def decode_scores(self, view: LayerView):
        return self.evict.decode_scores(view)

    def selects_pages(self, layer: int) -> bool:
        return self.select.selects_pages(layer)

    def select_pages(self, layer, q, state):
        return self.select.select_pages(layer, q, state)
