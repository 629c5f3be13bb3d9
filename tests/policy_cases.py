"""The policy matrix's cases: every registered policy, small options, and the compositions worth checking.

Shared by tests/test_policy_matrix.py (one device) and tests/_sharding_worker.py (a 2-device mesh). A
registered policy without an entry below still gets a case, built with `token_budget` when it has one,
so a new method is in the matrix as soon as it registers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import kvjax
from kvjax.policies import POLICY_REGISTRY

BUDGET = 32  # slots per kv head (and layer) a compressed head keeps; Quest's reads
# The quick suite's representatives: the full cache (every cover compares with it), an evictor while decoding,
# and a composition of a prefill compressor with a selector (the roles' paths once each; Quest and SnapKV alone
# run in their own modules' tests). Every module that runs the matrix's cases marks the others `heavy`
# (`case_param`): `python -m pytest` skips them, KVJAX_TEST_HEAVY=1 (CI) runs them.
QUICK_CASES = ("full", "h2o", "compose-snapkv-quest")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    policy: Any
    cover: Any = None  # the policy with a budget covering a short run (default: `policy` itself covers it)
    part: str | None = None  # a composition: the case id of its evicting part


def matrix_cases(cfg, page_size: int = 8) -> list[Case]:
    """Every registered policy with small options for `cfg`'s model, plus compositions (evict x select)."""
    from kvjax.locret import HeadsConfig, init_heads

    heads = init_heads(HeadsConfig.for_model(cfg, hidden_size=16), seed=1)
    snap = {"token_budget": BUDGET, "window": 8, "kernel_size": 3}
    big = {"token_budget": 2048, "window": 8, "kernel_size": 3}  # PyramidKV's last layer keeps B'/20
    make = kvjax.make_policy
    single = [
        Case("full", make("full")),
        Case("quest", make("quest", token_budget=BUDGET, dense_layers=1)),
        Case("quest_adaptive", make("quest_adaptive", token_budget=BUDGET, dense_layers=1, top_p=0.9),
             cover=make("quest_adaptive", token_budget=BUDGET, dense_layers=1, top_p=1.0)),
        Case("quest_static", make("quest_static", token_budget=BUDGET, page_size=page_size)),
        Case("streaming", make("streaming", token_budget=BUDGET)),
        Case("h2o", make("h2o", token_budget=BUDGET)),
        Case("tova", make("tova", token_budget=BUDGET)),
        Case("snapkv", make("snapkv", **snap)),
        Case("ada_snapkv", make("ada_snapkv", **snap)),
        Case("pyramid", make("pyramid", **snap), cover=make("pyramid", **big)),
        Case("ada_pyramid", make("ada_pyramid", **snap), cover=make("ada_pyramid", **big)),
        Case("locret", make("locret", token_budget=BUDGET, stabilizers=4, local_tail=8, heads=heads)),
        Case("ada-h2o", make("ada", scorer=make("h2o", token_budget=BUDGET))),
        Case("kvzip", make("kvzip", token_budget=BUDGET, chunk=32)),  # three and two repeat passes
    ]
    by_id = {case.id: case for case in single}
    composed = []
    for evict, select in [("snapkv", "quest"), ("h2o", "quest"), ("tova", "quest"), ("streaming", "quest"),
                          ("locret", "quest"), ("pyramid", "quest_adaptive")]:
        part, chooser = by_id[evict], by_id[select]
        cover = None
        if part.cover is not None or chooser.cover is not None:
            cover = make("compose", evict=part.cover or part.policy, select=chooser.cover or chooser.policy)
        composed.append(Case(
            f"compose-{evict}-{select}", make("compose", evict=part.policy, select=chooser.policy), cover, part=evict
        ))
    named = {case.policy.name for case in single + composed} | {case.id for case in single}
    extra = []
    for name, entry in sorted(POLICY_REGISTRY.items()):  # registered elsewhere: built with a budget when it takes one
        if name not in named:
            takes_budget = "token_budget" in entry.option_types({})
            extra.append(Case(name, make(name, **({"token_budget": BUDGET} if takes_budget else {}))))
    return single + composed + extra


def case_param(case_id: str, value=None):
    """`value` (default: the case id) as a pytest parameter with the case's id, marked `heavy` unless the case
    is one of `QUICK_CASES`."""
    import pytest

    return pytest.param(case_id if value is None else value, id=case_id,
                        marks=() if case_id in QUICK_CASES else pytest.mark.heavy)


def quick_params(values, quick, ids=None) -> list:
    """`values` as pytest parameters (ids from `ids`, a function of the value, else pytest's), each marked `heavy`
    unless it is in `quick`: the quick suite keeps one representative per path, CI's whole set runs them all."""
    import pytest

    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=ids(v) if ids else None,
                         marks=() if v in quick else pytest.mark.heavy) for v in values]

