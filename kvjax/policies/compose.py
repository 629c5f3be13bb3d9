"""Composition: evict with one policy, select pages at decode with another (e.g. SnapKV then Quest).

Notes: docs/modules.md (`kvjax/policies/compose.py`)."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import Policy, register_policy


@register_policy("compose")
@dataclasses.dataclass(frozen=True)
class Compose(Policy):
    """`make_policy("compose", evict=make_policy("snapkv", ...), select=make_policy("quest", ...))`: `evict`
    compresses (and evicts while decoding), `select` selects."""

    evict: Policy = dataclasses.field(default_factory=Policy)
    select: Policy = dataclasses.field(default_factory=Policy)

    @property
    def compressor(self):
        return self.evict.compressor

    @property
    def evictor(self):
        return self.evict.evictor

    @property
    def selector(self):
        return self.select.selector

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        return self.evict.slots_needed(prompt_len, max_new_tokens, chunk_size)

    def validate(self, page_size: int) -> None:
        for part in (self.evict, self.select):
            if not isinstance(part, Policy):
                raise TypeError(f"compose: evict and select must be policies, got {type(part).__name__}")
            part.validate(page_size)
        if self.evict.selector is not None:
            raise ValueError(f"compose: evict={self.evict.name} selects pages; give it as select=")
        if self.select.compressor is not None or self.select.evictor is not None:
            raise ValueError(f"compose: select={self.select.name} evicts; give it as evict=")
