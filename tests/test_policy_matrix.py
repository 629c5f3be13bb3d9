"""Every registered policy through the same invariants (kvpress's shared test matrix, for kvjax's policies).

Each case (tests/policy_cases.py: every registered method, and evict x select compositions) runs a ragged
batch of two prompts through chunked prefill and 64 decode steps, and must:

- hold only real positions: every kept position of a sequence is one of its tokens, none twice, and the
  state's pages, free stack and key min/max are consistent (`check_invariants`);
- free what it evicts: pages in use equal the pages of the kept slots, and the pool's free count agrees;
- hold its budget at every decode step when it evicts while decoding (each compressed head holds
  exactly min(budget, slots after prefill + steps)), and keep every new token otherwise;
- build one decode program for all 64 steps;
- equal the full cache, logits and all, on a short run its budget covers;
- as a composition, keep after prefill exactly what its evicting part keeps alone.

The same shapes serve every case (capacity, chunk, page size), so a case compiles only its own steps. The
2-device mesh runs the same cases in tests/test_sharding.py (`--matrix`). `python -m pytest` runs
`policy_cases.QUICK_CASES`; the others are marked `heavy` (KVJAX_TEST_HEAVY=1 runs them, as CI does).
"""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions, memory_report
from kvjax.util.compile_count import count_compiles
from kvjax.policies import POLICY_REGISTRY, layer_roles
from policy_cases import BUDGET, QUICK_CASES, case_param, matrix_cases
from test_state import check_invariants

PAGE, CHUNK, STEPS = 8, 32, 64
PROMPT_LENGTHS = (77, 50)  # ragged; three and two prefill chunks
COVER_LENGTHS, COVER_STEPS = (22, 13), 8  # 30 tokens at most: every case's budget covers them


def _model(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


CASES = matrix_cases(kvjax.ModelConfig(  # the shape of conftest's tiny Llama (the Locret heads fit it)
    model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256,
), page_size=PAGE)
BY_ID = {case.id: case for case in CASES}


def _params():
    return [case_param(case.id, case) for case in CASES]


def _prompts(lengths, seed):
    return [random_tokens(seed + i, (n,)).tolist() for i, n in enumerate(lengths)]


def _held(state) -> np.ndarray:
    """int[L, B, H]: slots each head holds (a pending eviction hole not counted)."""
    return np.asarray(state.lengths) - (np.asarray(state.hole) >= 0)


def _run(model, policy, lengths, steps, seed=0):
    """Prefill `lengths` prompts, then `steps` decode steps on fixed tokens. Returns the prefill state's kept
    positions, logits per step, slots held per step, the decode compiles and the final state."""
    prompts = _prompts(lengths, seed)
    state, logits = kvjax.prefill(model, prompts, policy, chunk_size=CHUNK, page_size=PAGE, max_new_tokens=steps)
    check_invariants(state)
    _check_pages(state)
    kept = kept_positions(state)
    tokens = random_tokens(seed + 99, (steps, len(lengths)))
    out, held = [np.asarray(logits)], [_held(state)]
    with count_compiles() as compiles:
        for t in range(steps):
            logits, state = kvjax.decode_step(model, state, tokens[t], policy)
            out.append(np.asarray(logits))
            held.append(_held(state))
    return {"kept": kept, "logits": out, "held": np.stack(held), "compiles": compiles, "state": state}


def _check_pages(state):
    """Pages in use are exactly the kept slots' pages, and the pool's free count agrees."""
    lengths = np.asarray(state.lengths)
    report = memory_report(state)
    pages = int(np.sum(-(-lengths // state.page_size)))
    assert report["pages_in_use"] == pages == state.num_pages - int(state.num_free)
    assert sum(len(p) for per_l in kept_positions(state) for per_b in per_l for p in per_b) == int(_held(state).sum())


def _check_positions(kept, seen):
    """Every kept position of row b is one of its `seen[b]` tokens, none twice."""
    for l, per_l in enumerate(kept):
        for b, per_b in enumerate(per_l):
            for h, positions in enumerate(per_b):
                assert len(set(positions.tolist())) == len(positions), f"layer {l} row {b} head {h}: a position twice"
                assert np.all((positions >= 0) & (positions < seen[b])), f"layer {l} row {b} head {h}: {positions}"


def decode_budget(policy):
    """Slots a compressed head holds at most while decoding, or None when it keeps every new token."""
    return policy.evictor.decode_budget if policy.evictor is not None else None


@pytest.fixture(scope="module")
def runs(hf_models):
    model = _model(hf_models)
    cache = {}

    def get(case_id, cover=False):
        key = (case_id, cover)
        if key not in cache:
            case = BY_ID[case_id]
            if cover:
                policy = case.cover if case.cover is not None else case.policy
                cache[key] = _run(model, policy, COVER_LENGTHS, COVER_STEPS, seed=10)
            else:
                cache[key] = _run(model, case.policy, PROMPT_LENGTHS, STEPS)
        return cache[key]

    return get


@pytest.mark.parametrize("case", _params())
def test_policy_matrix(runs, case):
    policy = case.policy
    run = runs(case.id)
    state = run["state"]
    L = state.page_table.shape[0]

    # real positions only, and the pages of the kept slots are the pages in use, after decoding too
    check_invariants(state)
    _check_pages(state)
    _check_positions(run["kept"], PROMPT_LENGTHS)  # after prefill
    _check_positions(kept_positions(state), np.asarray(state.next_position))  # after decoding
    assert list(np.asarray(state.next_position)) == [n + STEPS for n in PROMPT_LENGTHS]

    # decode: held slots per step
    held = run["held"]  # [STEPS + 1, L, B, H]
    budget = decode_budget(policy)
    grown = held[0][None] + np.arange(STEPS + 1)[:, None, None, None]
    for l in range(L):
        if layer_roles(policy, l).evict:
            np.testing.assert_array_equal(
                held[:, l], np.minimum(grown[:, l], budget), err_msg=f"layer {l}: decode-time eviction off budget"
            )
        else:
            np.testing.assert_array_equal(held[:, l], grown[:, l], err_msg=f"layer {l}: a decode step lost a token")
    if policy.compresses:  # eviction is real: fewer pages than the full cache
        report = memory_report(state)
        assert report["pages_in_use"] < report["pages_full_cache"]

    # one decode program for all steps (none when an earlier test built the same one)
    assert run["compiles"].of("append_token") <= 1, f"64 decode steps built {run['compiles']}"

    # a budget covering the run gives the full cache's results
    cover, full = runs(case.id, cover=True), runs("full", cover=True)
    for t, (got, want) in enumerate(zip(cover["logits"], full["logits"])):
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"step {t}: differs from the full cache")
    for per_l in cover["kept"]:
        for b, per_b in enumerate(per_l):
            for positions in per_b:
                assert sorted(positions.tolist()) == list(range(COVER_LENGTHS[b]))

    # a composition keeps what its evicting part keeps alone
    if case.part is not None:
        alone = runs(case.part)["kept"]
        for l, (got_l, want_l) in enumerate(zip(run["kept"], alone)):
            for got, want in zip((p for per_b in got_l for p in per_b), (p for per_b in want_l for p in per_b)):
                np.testing.assert_array_equal(np.sort(got), np.sort(want), err_msg=f"layer {l}")


def test_every_registered_policy_is_in_the_matrix():
    assert set(QUICK_CASES) <= set(BY_ID)
    assert set(POLICY_REGISTRY) <= {case.policy.name for case in CASES} | {case.id for case in CASES}
    assert {"compose-locret-quest", "compose-h2o-quest", "compose-tova-quest", "compose-streaming-quest"} <= set(BY_ID)
    assert all(case.policy.name == "compose" for case in CASES if case.part is not None)
    assert BUDGET < min(PROMPT_LENGTHS)  # the main run compresses every sequence
