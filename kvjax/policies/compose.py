"""Composition: evict with one policy, select pages at decode with another (e.g. SnapKV then Quest).

`Compose(evict=..., select=...)` takes every role of its `evict` part (compression after prefill or per
chunk with its schedule, its inputs and sizes, eviction while decoding and its budget) and the page
selection of its `select` part, so it behaves as the evicting part alone except for which pages a decode
step reads. A part with a role the composition does not take from it is refused.

Fields (defaults): `evict` (the full cache), `select` (reads every page).
"""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import LayerView, Policy, register_policy

DEEP = 1 << 20  # a layer past every dense prefix: whether a part selects pages anywhere


@register_policy("compose")
@dataclasses.dataclass(frozen=True)
class Compose(Policy):
    """`make_policy("compose", evict=make_policy("snapkv", ...), select=make_policy("quest", ...))`."""

    evict: Policy = dataclasses.field(default_factory=Policy)
    select: Policy = dataclasses.field(default_factory=Policy)

    def validate(self, page_size: int) -> None:
        for part in (self.evict, self.select):
            if not isinstance(part, Policy):
                raise TypeError(f"compose: evict and select must be policies, got {type(part).__name__}")
            part.validate(page_size)
        if self.evict.selects_pages(DEEP):
            raise ValueError(f"compose: evict={self.evict.name} selects pages; give it as select=")
        if self.select.compresses or self.select.evicts_while_decoding:
            raise ValueError(f"compose: select={self.select.name} evicts; give it as evict=")

    # ---- the evicting part's roles
    @property
    def compresses(self) -> bool:
        return self.evict.compresses

    @property
    def accumulates_attention(self) -> bool:  # type: ignore[override]
        return self.evict.accumulates_attention

    @property
    def window_size(self) -> int:
        return self.evict.window_size

    @property
    def chunks(self):
        return self.evict.chunks

    @property
    def evicts_while_decoding(self) -> bool:
        return self.evict.evicts_while_decoding

    @property
    def decode_budget(self) -> int:
        return self.evict.decode_budget

    def slots_needed(self, prompt_len, max_new_tokens, chunk_size):
        return self.evict.slots_needed(prompt_len, max_new_tokens, chunk_size)

    def kept_bound(self, prompt_len, num_kv_heads):
        return self.evict.kept_bound(prompt_len, num_kv_heads)

    def compresses_layer(self, layer: int) -> bool:
        return self.evict.compresses_layer(layer)

    def compress_layer(self, view: LayerView, keep_bound: int):
        return self.evict.compress_layer(view, keep_bound)

    def decode_scores(self, view: LayerView):
        return self.evict.decode_scores(view)

    # ---- the selecting part's role
    def selects_pages(self, layer: int) -> bool:
        return self.select.selects_pages(layer)

    def select_pages(self, view: LayerView):
        return self.select.select_pages(view)
