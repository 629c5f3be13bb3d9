"""Composition: evict with one policy, select pages at decode with another (e.g. SnapKV then Quest).

Notes: docs/modules.md (`kvjax/policies/compose.py`)."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import Policy, register_policy, take_roles

DEEP = 1 << 20  # a layer past every dense prefix: whether a part selects pages anywhere


@register_policy("compose")
@take_roles(evict=("compress", "evict"), select=("select",))
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
