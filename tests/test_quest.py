"""Quest against a plain numpy statement of its definition, and end to end through generation."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.policies import Compose
from test_state import check_invariants


@pytest.fixture(scope="module")
def model(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


def numpy_quest_selection(state, layer, q, budget, per_kv_head):
    """Per head: the top (budget/ps - 1) pages by sum_d max(q_d min_d, q_d max_d), min/max taken from the
    raw keys of the page (not the state's metadata), the current page excluded. Returns sets of pages."""
    ps = state.page_size
    table, lengths = np.asarray(state.page_table[layer]), np.asarray(state.lengths[layer])
    k_pages = np.asarray(state.k_pages, np.float64)
    q = np.asarray(q, np.float64)
    B, H, _ = table.shape
    Hq = q.shape[1]
    G = Hq // H
    out = {}
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            n = int(lengths[b, h])
            used = -(-n // ps)
            scores = np.full(used, -np.inf)
            for p in range(used - 1):  # the current page is never scored
                keys = k_pages[table[b, h, p]][: min(ps, n - p * ps)]
                scores[p] = np.maximum(q[b, hq] * keys.min(0), q[b, hq] * keys.max(0)).sum()
            out[(b, hq)] = scores
    K = budget // ps - 1
    chosen = {}
    for (b, hq), scores in out.items():
        if per_kv_head:
            h = hq // G
            scores = np.max([out[(b, g)] for g in range(h * G, (h + 1) * G)], axis=0)
            key = (b, h)
        else:
            key = (b, hq)
        finite = np.flatnonzero(np.isfinite(scores))
        chosen[key] = set(finite[np.argsort(-scores[finite], kind="stable")][:K].tolist())
    return chosen


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_quest_selection_matches_numpy(model, per_kv_head):
    prompts = [random_tokens(3, (150,)).tolist(), random_tokens(4, (97,)).tolist()]
    state, _ = kvjax.prefill(model, prompts, chunk_size=64, page_size=16)
    policy = kvjax.make_policy("quest", token_budget=64, dense_layers=1, per_kv_head=per_kv_head)
    q = np.random.default_rng(5).normal(size=(2, model.cfg.num_heads, model.cfg.head_dim)).astype(np.float32)
    assert policy.select_pages(0, jnp.asarray(q), state) is None  # a dense layer
    selected = np.asarray(policy.select_pages(1, jnp.asarray(q), state))
    reference = numpy_quest_selection(state, 1, q, 64, per_kv_head)
    assert selected.shape == (2, model.cfg.num_kv_heads if per_kv_head else model.cfg.num_heads, 3)
    for (b, row), pages in reference.items():
        assert set(selected[b, row][selected[b, row] >= 0].tolist()) == pages


def test_quest_with_every_page_equals_full(model):
    prompt = random_tokens(6, (2, 120))
    full = kvjax.generate(model, prompt, max_new_tokens=8, return_logprobs=True)
    quest = kvjax.generate(model, prompt, max_new_tokens=8, return_logprobs=True,
                           policy=kvjax.make_policy("quest", token_budget=512, dense_layers=0))
    np.testing.assert_array_equal(quest[0], full[0])
    np.testing.assert_allclose(quest[1], full[1], atol=1e-4)


def test_quest_reads_fewer_slots_and_changes_the_output(model):
    prompt = random_tokens(7, (1, 200))
    state, logits = kvjax.prefill(model, prompt, max_new_tokens=4)
    full_logits, _ = kvjax.decode_step(model, state, [5])
    quest = kvjax.make_policy("quest", token_budget=32, dense_layers=0)
    state, _ = kvjax.prefill(model, prompt, max_new_tokens=4)
    quest_logits, state = kvjax.decode_step(model, state, [5], policy=quest)
    assert np.abs(np.asarray(quest_logits) - np.asarray(full_logits)).max() > 1e-3
    check_invariants(state)  # Quest keeps every slot
    assert int(state.lengths.min()) == 201


def test_dense_layers_cover_the_model_then_quest_is_full(model):
    prompt = random_tokens(8, (1, 100))
    full = kvjax.generate(model, prompt, max_new_tokens=6)
    quest = kvjax.generate(model, prompt, max_new_tokens=6, policy=kvjax.make_policy("quest", token_budget=32))
    np.testing.assert_array_equal(quest, full)  # the default dense_layers=2 covers this 2-layer model


def test_compose_evicts_then_selects(model):
    prompt = random_tokens(9, (1, 160))
    policy = Compose(evict=kvjax.make_policy("snapkv", token_budget=96, window=16),
                     select=kvjax.make_policy("quest", token_budget=32, dense_layers=0))
    out = kvjax.generate(model, prompt, max_new_tokens=5, policy=policy)
    assert out.shape == (1, 5) and np.all(out >= 0)
    state, _ = kvjax.prefill(model, prompt, policy=policy)
    assert int(np.asarray(state.lengths).max()) == 96


@pytest.mark.parametrize(
    "options, message",
    [({"token_budget": 16}, "token_budget must be >= 32"), ({"page_size": 32}, "does not match the cache's page_size=16")],
)
def test_quest_bad_options(model, options, message):
    with pytest.raises(ValueError, match=message):
        kvjax.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=kvjax.make_policy("quest", **options))
