"""Compression policies: each keeps what its definition keeps, evicts for real, and decodes without recompiling."""

import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions, memory_report
from kvjax.util.compile_count import count_compiles
from policy_reference import (
    ada_budgets, assert_top_set, capture_qk, h2o_scores, snapkv_scores, tova_scores,
)
from test_state import check_invariants

T = 96  # prompt length of the cross-checks


@pytest.fixture(scope="module")
def setup(hf_models):
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    tokens = random_tokens(77, (1, T))
    return model, tokens, capture_qk(model, tokens)


def _prefill(model, tokens, name, **options):
    policy = kvjax.make_policy(name, **options)
    state, _ = kvjax.prefill(model, tokens, policy=policy, max_new_tokens=4, chunk_size=32, page_size=8)
    check_invariants(state)
    return state, kept_positions(state)


@pytest.mark.parametrize("pooling, kernel", [("max", 7), ("avg", 5)])
def test_snapkv_keeps_top_pooled_window_votes(setup, pooling, kernel):
    model, tokens, qk = setup
    budget, window = 40, 8
    _, kept = _prefill(model, tokens, "snapkv", token_budget=budget, window=window, kernel_size=kernel, pooling=pooling)
    for layer, (q, k) in qk.items():
        ref = snapkv_scores(q, k, window, kernel, pooling)
        for h in range(k.shape[1]):
            positions = kept[layer][0][h]
            assert set(range(T - window, T)) <= set(positions.tolist()), "the window must be kept"
            assert_top_set(positions, ref[h], np.arange(T - window), budget - window)


def test_ada_snapkv_budgets_follow_the_layer_top(setup):
    model, tokens, qk = setup
    budget, window, alpha = 40, 8, 0.5
    _, kept = _prefill(model, tokens, "ada_snapkv", token_budget=budget, window=window, pooling="avg", kernel_size=5, alpha=alpha)
    for layer, (q, k) in qk.items():
        ref = snapkv_scores(q, k, window, 5, "avg")
        budgets = ada_budgets(ref, budget - window, alpha, window)
        counts = [len(kept[layer][0][h]) for h in range(k.shape[1])]
        np.testing.assert_array_equal(counts, np.minimum(budgets, T))
        for h in range(k.shape[1]):
            assert_top_set(kept[layer][0][h], ref[h], np.arange(T - window), budgets[h] - window)


def test_pyramid_budgets_shrink_with_depth(setup):
    model, tokens, qk = setup
    policy = kvjax.make_policy("pyramid", token_budget=40, window=8)
    _, kept = _prefill(model, tokens, "pyramid", token_budget=40, window=8)
    L = model.cfg.num_layers
    expected = [min(T, policy.layer_budget(l, L)) for l in range(L)]
    # B' = 32: min 1, max 63; layer 0 keeps 71 slots, layer 1 keeps 9
    assert expected == [71, 9]
    for layer, (q, k) in qk.items():
        ref = snapkv_scores(q, k, 8, 7, "max")
        for h in range(k.shape[1]):
            assert len(kept[layer][0][h]) == expected[layer]
            assert_top_set(kept[layer][0][h], ref[h], np.arange(T - 8), expected[layer] - 8)


def test_h2o_keeps_heavy_hitters_and_recent(setup):
    model, tokens, qk = setup
    budget, recent = 32, 8
    _, kept = _prefill(model, tokens, "h2o", token_budget=budget, recent_size=recent)
    for layer, (q, k) in qk.items():
        ref = h2o_scores(q, k)
        for h in range(k.shape[1]):
            positions = kept[layer][0][h]
            assert set(range(T - recent, T)) <= set(positions.tolist())
            assert_top_set(positions, ref[h], np.arange(T - recent), budget - recent, tol=1e-4)


def test_tova_keeps_the_last_querys_favourites(setup):
    model, tokens, qk = setup
    _, kept = _prefill(model, tokens, "tova", token_budget=24)
    for layer, (q, k) in qk.items():
        ref = tova_scores(q, k)
        for h in range(k.shape[1]):
            positions = kept[layer][0][h]
            assert T - 1 in positions
            assert_top_set(positions, ref, np.arange(T - 1), 23)
            np.testing.assert_array_equal(positions, kept[layer][0][0])  # all heads alike


def test_streaming_keeps_sinks_and_recent_while_decoding(setup):
    model, tokens, _ = setup
    policy = kvjax.make_policy("streaming", token_budget=20)
    state, logits = kvjax.prefill(model, tokens, policy=policy, max_new_tokens=8, chunk_size=32, page_size=8)
    for step in range(8):
        logits, state = kvjax.decode_step(model, state, [step], policy=policy)
        check_invariants(state)
    expected = [0, 1, 2, 3] + list(range(T + 8 - 16, T + 8))
    for per_b in kept_positions(state):
        for positions in per_b[0]:
            assert sorted(positions.tolist()) == expected


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_decode_eviction_holds_the_budget(setup, name):
    model, tokens, _ = setup
    policy = kvjax.make_policy(name, token_budget=24)
    state, logits = kvjax.prefill(model, tokens, policy=policy, max_new_tokens=12, chunk_size=32, page_size=8)
    for step in range(12):
        logits, state = kvjax.decode_step(model, state, [int(np.argmax(logits[0]))], policy=policy)
    check_invariants(state)
    assert all(len(p) == 24 for per_l in kept_positions(state) for per_b in per_l for p in per_b)
    assert np.all(np.asarray(state.hole) >= 0)  # the step's eviction left a hole the next token fills
    if name == "h2o":  # the recent half is protected
        for per_b in kept_positions(state):
            assert set(range(T + 12 - 12, T + 12)) <= set(per_b[0][0].tolist())


@pytest.mark.parametrize(
    "name, options",
    [("streaming", {}), ("snapkv", {"window": 8}), ("ada_snapkv", {"window": 8}), ("pyramid", {"window": 8}),
     ("ada_pyramid", {"window": 8}), ("h2o", {}), ("tova", {})],
)
def test_eviction_frees_pages_for_real(setup, name, options):
    model, tokens, _ = setup
    state, kept = _prefill(model, tokens, name, token_budget=24, **options)
    report = memory_report(state)
    expected_pages = sum(-(-len(p) // 8) for per_b in kept for per_h in per_b for p in per_h)
    assert report["pages_in_use"] == expected_pages == state.num_pages - int(state.num_free)
    assert report["pages_in_use"] < report["pages_full_cache"]
    assert sum(report["pages_per_layer"]) == expected_pages


def test_budget_at_or_above_the_prompt_is_a_no_op(setup):
    model, tokens, _ = setup
    for name in ("snapkv", "h2o"):
        policy = kvjax.make_policy(name, token_budget=T + 10)
        out = kvjax.generate(model, tokens, max_new_tokens=6, policy=policy, chunk_size=32)
        np.testing.assert_array_equal(out, kvjax.generate(model, tokens, max_new_tokens=6, chunk_size=32))
        state, _ = kvjax.prefill(model, tokens, policy=policy, chunk_size=32)
        assert all(sorted(p.tolist()) == list(range(T)) for per_b in kept_positions(state) for p in per_b[0])


def test_dense_layers_stay_whole(setup):
    model, tokens, _ = setup
    _, kept = _prefill(model, tokens, "snapkv", token_budget=24, window=8, dense_layers=1)
    assert all(len(p) == T for p in kept[0][0]) and all(len(p) == 24 for p in kept[1][0])


def test_decode_compiles_once_per_policy(setup):
    model, tokens, _ = setup
    for name, options in (("snapkv", {"window": 8}), ("h2o", {}), ("tova", {})):
        policy = kvjax.make_policy(name, token_budget=24, **options)
        with count_compiles() as first:
            kvjax.generate(model, tokens, max_new_tokens=9, policy=policy, chunk_size=32)
        # one prefill chunk shape and one decode program: a decode step that recompiled would add more
        assert first.of("append_chunk") <= 1 and first.of("decode_steps") <= 1, f"{name}: {first}"
        with count_compiles() as again:
            kvjax.generate(model, tokens, max_new_tokens=5, policy=policy, chunk_size=32)  # same capacity bucket
        assert again.total == 0, f"{name}: a second generation compiled again: {again}"


def test_ragged_batch_compresses_each_sequence(setup):
    model, _, _ = setup
    prompts = [random_tokens(1, (50,)).tolist(), random_tokens(2, (90,)).tolist()]
    policy = kvjax.make_policy("snapkv", token_budget=24, window=8)
    state, _ = kvjax.prefill(model, prompts, policy=policy, chunk_size=32, page_size=8)
    check_invariants(state)
    kept = kept_positions(state)
    assert all(max(p) == 49 for p in kept[0][0]) and all(max(p) == 89 for p in kept[0][1])
    singles = [kept_positions(kvjax.prefill(model, [p], policy=policy, chunk_size=32, page_size=8)[0]) for p in prompts]
    for b in range(2):
        for layer in range(model.cfg.num_layers):
            for h in range(model.cfg.num_kv_heads):
                np.testing.assert_array_equal(kept[layer][b][h], singles[b][layer][0][h])


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("snapkv", {"token_budget": 0}, "token_budget must be > 0"),
        ("snapkv", {"token_budget": 32, "window": 32}, "window=32 must be smaller than token_budget=32"),
        ("h2o", {"token_budget": 16, "recent_size": 20}, "recent_size=20 must be smaller"),
        ("streaming", {"token_budget": 4}, "sink_size=4 must be smaller"),
        ("snapkv", {"pooling": "median"}, "pooling must be 'max' or 'avg'"),
        ("ada_snapkv", {"alpha": 1.5}, "alpha must be in"),
        ("pyramid", {"beta": 0}, "beta must be >= 1"),
        ("full", {"dense_layers": -1}, "dense_layers must be >= 0"),
    ],
)
def test_bad_policy_options_name_the_field(setup, name, options, message):
    model, tokens, _ = setup
    with pytest.raises(ValueError, match=message):
        kvjax.generate(model, tokens, max_new_tokens=2, policy=kvjax.make_policy(name, **options))
