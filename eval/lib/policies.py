"""The policy specs a sweep names, and its cells: `build_policy("snapkv+quest", 64)` through
`kvjax.policies.parse_spec`, with the sweeps' defaults."""

from __future__ import annotations

from typing import Sequence

from kvjax.policies import parse_spec

DEFAULT_POLICIES = ("full", "quest", "quest_static", "snapkv", "ada_snapkv", "h2o", "tova", "streaming")
# Layer 0 of the shipped model holds its hand-set previous-token head (docs/default_model.md); retrieval
# happens in layer 1 and up, so compression starts at layer 1 for every method.
DEFAULT_DENSE_LAYERS = 1


def build_policy(spec: str, budget: int | None, dense_layers: int = DEFAULT_DENSE_LAYERS):
    """The policy a sweep names (`kvjax.policies.parse_spec`: `quest`, `quest:dense_layers=0`, `snapkv+quest`),
    each part at `budget` with `dense_layers` unless its spec says otherwise."""
    defaults = {"dense_layers": dense_layers} | ({} if budget is None else {"token_budget": int(budget)})
    return parse_spec(spec, defaults=defaults)


def sweep_cells(policies: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int | None]]:
    """(policy spec, budget) cells of one task and length: `full` once, every other policy at every budget."""
    return [(p, b) for p in policies for b in ((None,) if p == "full" else budgets)]


def cell_key(spec: str, budget) -> str:
    return spec if budget is None else f"{spec}@{budget}"


def parse_cell_key(key: str) -> tuple[str, int | None]:
    """`(policy spec, budget)` of a cell key (`quest:dense_layers=2@64`, or `full`)."""
    spec, at, budget = key.rpartition("@")
    return (spec, int(budget)) if at else (key, None)
