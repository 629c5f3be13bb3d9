"""The policy interface and registry.

A policy is a frozen, hashable dataclass (static under `jit`) with a few hooks that the generation step
calls: `compress` after a prefill chunk, `select_pages` before each decode attention, `evict_decode`
after a decode step. The base class's hooks keep everything, so `FullPolicy` is the base class itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

POLICY_REGISTRY: dict[str, type["Policy"]] = {}


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator registering a policy under `name` for `make_policy` (methods written outside kvjax too)."""

    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"register_policy({name!r}) expects a Policy subclass, got {cls!r}")
        cls.name = name
        POLICY_REGISTRY[name] = cls
        return cls

    return wrap


@dataclasses.dataclass(frozen=True)
class Policy:
    """Keep every slot; read every page. Subclasses override hooks."""

    name: ClassVar[str] = "full"
    dense_layers: int = 0  # the first N layers stay uncompressed

    def validate(self, page_size: int) -> None:
        """Raise ValueError naming a bad field. Called before any work."""
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        """Most slots one (layer, head) holds at once during a request (sizes the cache before work)."""
        return prompt_len + max_new_tokens

    # Hooks (called under jit). The full policy does nothing in each.
    def select_pages(self, layer: int, q: Any, state: Any) -> Any:
        """Logical pages each head reads at a decode step, `int32[B, Hq or H, K]` (-1 = none), or None for all."""
        return None


@register_policy("full")
@dataclasses.dataclass(frozen=True)
class FullPolicy(Policy):
    """The uncompressed cache (the reference every method is compared against)."""


def make_policy(name: str = "full", **options: Any) -> Policy:
    """Build a registered policy by name, e.g. `make_policy("quest", token_budget=64)`."""
    cls = POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICY_REGISTRY))}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"policy {name!r} has no option(s) {', '.join(unknown)}; options: {', '.join(sorted(fields))}")
    return cls(**options)
