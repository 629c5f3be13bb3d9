"""Wrappers and variants against plain numpy statements: Ada-KV's allocation over any scorer (`ada`), and
adaptive Quest's top-p page selection (`quest_adaptive`)."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions
from kvjax.policies import AdaKV
from kvjax.policies.options import parse_policy_options
from kvjax.policies.page_reads import PageReads, counting
from kvjax.policies.quest_adaptive import selected_page_counts
from kvjax.engine.decode import page_view
from policy_reference import ada_budgets, assert_top_set, capture_qk, h2o_scores, snapkv_scores, tova_scores
from test_state import check_invariants

T = 96


@pytest.fixture(scope="module")
def setup(hf_models):
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    tokens = random_tokens(77, (1, T))
    return model, tokens, capture_qk(model, tokens)


def _kept(model, tokens, policy, **kwargs):
    state, _ = kvjax.prefill(model, tokens, policy=policy, max_new_tokens=4, chunk_size=32, page_size=8, **kwargs)
    check_invariants(state)
    return kept_positions(state)


def _assert_same(kept, other):
    """Equal kept positions per (layer, sequence, head)."""
    assert len(kept) == len(other)
    for l, (per_l, other_l) in enumerate(zip(kept, other)):
        for b, (per_b, other_b) in enumerate(zip(per_l, other_l)):
            for h, (positions, expected) in enumerate(zip(per_b, other_b)):
                np.testing.assert_array_equal(positions, expected, err_msg=f"layer {l} row {b} head {h}")


def ada_budgets_kvpress(scores: np.ndarray, budget: int, alpha: float) -> np.ndarray:
    """Ada-KV as kvpress's AdaKVPress allocates: scores `[H, S]` (+inf = always kept); each head's top
    max(1, int(alpha * budget)) are protected, then the layer's top H * budget scores are counted per head."""
    H, S = scores.shape
    big = np.finfo(np.float32).max
    s = np.where(np.isposinf(scores), big, scores)
    safe = max(1, int(budget * alpha))
    kth = -np.sort(-s, axis=1)[:, safe - 1 : safe]
    s = np.where(s >= kth, big, s)
    order = np.argsort(-s.reshape(-1), kind="stable")[: H * budget]
    return np.bincount(order // S, minlength=H)


# ------------------------------------------------------------------------------------------------ Ada-KV


def test_ada_snapkv_and_ada_pyramid_are_the_one_ada_wrapper():
    """The registered names build `AdaKV` over their scorer, with the scorer's options given to the scorer
    (their kept positions follow the numpy allocation in test_policies.py and kvpress in the cross-check)."""
    options = dict(token_budget=40, window=8, kernel_size=5, pooling="avg")
    snap = kvjax.make_policy("ada_snapkv", alpha=0.2, form="kvpress", **options)
    assert snap == AdaKV(scorer=kvjax.make_policy("snapkv", **options), alpha=0.2, form="kvpress")
    pyramid = kvjax.make_policy("ada_pyramid", token_budget=40, window=8, beta=10)
    assert pyramid == AdaKV(scorer=kvjax.make_policy("pyramid", token_budget=40, window=8, beta=10))
    # the command line's KEY=VALUE options, typed by the scorer's and Ada's fields; `scorer` is fixed
    assert parse_policy_options("ada_pyramid", ["beta=10", "alpha=0.2", "window=8"]) == {
        "beta": 10, "alpha": 0.2, "window": 8}
    with pytest.raises(ValueError, match="has no option 'scorer'"):
        parse_policy_options("ada_snapkv", ["scorer=h2o"])


@pytest.mark.parametrize("form, alpha", [("paper", 0.5), ("kvpress", 0.5)])
def test_ada_h2o_follows_the_numpy_allocation(setup, form, alpha):
    """Ada-H2O: the layer's budget split across heads by where H2O's accumulated attention is highest."""
    model, tokens, qk = setup
    budget, recent = 40, 8
    policy = AdaKV(scorer=kvjax.make_policy("h2o", token_budget=budget, recent_size=recent), alpha=alpha, form=form)
    kept = _kept(model, tokens, policy)
    prefix = np.arange(T - recent)
    for layer, (q, k) in qk.items():
        ref = h2o_scores(q, k)  # [H, T]
        if form == "paper":
            budgets = ada_budgets(ref[:, prefix], budget - recent, alpha, recent)
        else:
            budgets = ada_budgets_kvpress(np.where(np.arange(T) >= T - recent, np.inf, ref), budget, alpha)
        assert abs(budgets.sum() - k.shape[1] * budget) <= k.shape[1] // 2  # the layer's total (up to rounding)
        for h in range(k.shape[1]):
            positions = kept[layer][0][h]
            assert len(positions) == min(budgets[h], T)
            assert set(range(T - recent, T)) <= set(positions.tolist())
            assert_top_set(positions, ref[h], prefix, budgets[h] - recent, tol=1e-4)


def test_ada_tova_is_tova(setup):
    """TOVA scores every kv head alike, so the layer's top H * B' falls B' to each head: Ada changes nothing."""
    model, tokens, qk = setup
    for layer, (q, k) in qk.items():
        ref = np.broadcast_to(tova_scores(q, k)[: T - 1], (k.shape[1], T - 1))
        np.testing.assert_array_equal(ada_budgets(ref, 23, 0.5, 1), [24] * k.shape[1])
    wrapped = _kept(model, tokens, AdaKV(scorer=kvjax.make_policy("tova", token_budget=24)))
    plain = _kept(model, tokens, kvjax.make_policy("tova", token_budget=24))
    _assert_same(wrapped, plain)


def test_ada_by_name_builds_the_scorer():
    policy = AdaKV.from_options(scorer="h2o", token_budget=48, recent_size=8, alpha=0.3)
    assert policy.scorer == kvjax.make_policy("h2o", token_budget=48, recent_size=8)
    assert (policy.alpha, policy.form, policy.token_budget, policy.window) == (0.3, "paper", 48, 8)
    assert policy.accumulates_attention and not policy.evicts_while_decoding
    assert AdaKV.from_options().scorer == kvjax.make_policy("snapkv")
    with pytest.raises(ValueError, match="belong to the scorer"):
        AdaKV.from_options(scorer=kvjax.make_policy("h2o"), token_budget=3)
    # by name, and as the command line gives options
    assert kvjax.make_policy("ada", scorer="h2o", token_budget=48, recent_size=8, alpha=0.3) == policy
    text = parse_policy_options("ada", ["scorer=tova", "token_budget=40", "form=kvpress", "dense_layers=1"])
    assert text == {"scorer": "tova", "token_budget": 40, "form": "kvpress", "dense_layers": 1}
    assert kvjax.make_policy("ada", **text).scorer == kvjax.make_policy("tova", token_budget=40, dense_layers=1)
    with pytest.raises(ValueError, match="has no option 'recent_size'"):
        parse_policy_options("ada", ["scorer=tova", "recent_size=4"])


@pytest.mark.parametrize(
    "policy, message",
    [
        (AdaKV(scorer=kvjax.make_policy("h2o"), alpha=2.0), "alpha must be in"),
        (AdaKV(form="median"), "form must be 'paper' or 'kvpress'"),
        (AdaKV(scorer=kvjax.make_policy("quest")), "scorer must be a scored eviction"),
        (AdaKV(scorer=kvjax.make_policy("snapkv", token_budget=8, window=8)), "window=8 must be smaller"),
    ],
)
def test_ada_bad_options(setup, policy, message):
    model, tokens, _ = setup
    with pytest.raises((ValueError, TypeError), match=message):
        kvjax.generate(model, tokens, max_new_tokens=2, policy=policy)


# ----------------------------------------------------------------------------------------- adaptive Quest


def numpy_page_bounds(state, layer, q, per_kv_head):
    """Quest's bound sum_d max(q_d min_d, q_d max_d) per (b, row, page), min/max from the raw keys; -inf for
    the current page and pages past the length. `[B, Hq or H, P]`."""
    ps = state.page_size
    table, lengths = np.asarray(state.page_table[layer]), np.asarray(state.lengths[layer])
    k_pages, q = np.asarray(state.k_pages, np.float64), np.asarray(q, np.float64)
    B, H, P = table.shape
    G = q.shape[1] // H
    out = np.full((B, q.shape[1], P), -np.inf)
    for b in range(B):
        for hq in range(q.shape[1]):
            n = int(lengths[b, hq // G])
            for p in range(-(-n // ps) - 1):
                keys = k_pages[table[b, hq // G, p]][: min(ps, n - p * ps)]
                out[b, hq, p] = np.maximum(q[b, hq] * keys.min(0), q[b, hq] * keys.max(0)).sum()
    return out.reshape(B, H, G, P).max(2) if per_kv_head else out


def numpy_top_p(bounds, scale, top_p, min_pages, cap):
    """Per row: pages by descending bound until the mass softmax(bound * scale) of the pages before reaches
    top_p; at least min_pages, at most cap. Returns ({(b, row): set}, {(b, row): closest margin to top_p})."""
    chosen, margin = {}, {}
    for idx in np.ndindex(*bounds.shape[:2]):
        row = bounds[idx]
        finite = np.flatnonzero(np.isfinite(row))
        if not len(finite):
            chosen[idx], margin[idx] = set(), np.inf
            continue
        mass = np.exp((row[finite] - row[finite].max()) * scale)
        mass /= mass.sum()
        order = np.argsort(-row[finite], kind="stable")
        before = np.concatenate([[0.0], np.cumsum(mass[order])[:-1]])
        count = min(cap, max(min_pages, int(np.sum(before < top_p))))
        chosen[idx] = set(finite[order[:count]].tolist())
        margin[idx] = np.min(np.abs(before - top_p))
    return chosen, margin


@pytest.fixture(scope="module")
def quest_state(setup):
    model = setup[0]
    prompts = [random_tokens(3, (230,)).tolist(), random_tokens(4, (150,)).tolist()]
    state, _ = kvjax.prefill(model, prompts, chunk_size=64, page_size=16)
    return model, state


@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("top_p, sharpness", [(0.9, 1.0), (0.5, 4.0), (0.99, 8.0)])
def test_adaptive_quest_selection_matches_numpy(quest_state, per_kv_head, top_p, sharpness):
    model, state = quest_state
    cfg = model.cfg
    budget = 160  # cap: 9 pages of 16
    policy = kvjax.make_policy("quest_adaptive", token_budget=budget, top_p=top_p, min_pages=2, per_kv_head=per_kv_head,
                               dense_layers=1)
    q = sharpness * np.random.default_rng(5).normal(size=(2, cfg.num_heads, cfg.head_dim)).astype(np.float32)
    selected = np.asarray(policy.select_pages(page_view(state, 1, cfg.num_layers, jnp.asarray(q))))
    rows = cfg.num_kv_heads if per_kv_head else cfg.num_heads
    assert selected.shape == (2, rows, budget // 16 - 1)
    bounds = numpy_page_bounds(state, 1, q, per_kv_head)
    reference, margin = numpy_top_p(bounds, cfg.head_dim**-0.5, top_p, 2, budget // 16 - 1)
    counts = np.asarray(selected_page_counts(jnp.asarray(selected)))
    for (b, row), pages in reference.items():
        if margin[(b, row)] < 1e-5:
            continue  # a page's cumulative mass sits on top_p: float32 may round either way
        got = selected[b, row][selected[b, row] >= 0]
        assert set(got.tolist()) == pages and counts[b, row] == len(pages) == len(got)
    if sharpness > 1:  # peaked attention: some heads stop well before the cap
        assert counts.min() < budget // 16 - 1


def test_adaptive_quest_with_top_p_one_is_quest(quest_state):
    model, state = quest_state
    q = jnp.asarray(np.random.default_rng(6).normal(size=(2, model.cfg.num_heads, model.cfg.head_dim)), jnp.float32)
    for per_kv_head in (False, True):
        options = dict(token_budget=96, dense_layers=1, per_kv_head=per_kv_head)
        view = page_view(state, 1, model.cfg.num_layers, q)
        fixed = np.asarray(kvjax.make_policy("quest", **options).select_pages(view))
        adaptive = np.asarray(kvjax.make_policy("quest_adaptive", top_p=1.0, **options).select_pages(view))
        np.testing.assert_array_equal(adaptive, fixed)


def test_pages_read_are_counted_while_decoding(setup):
    """End to end: at top_p = 1 adaptive Quest generates what Quest generates and reads as many pages (its
    cap plus the current page, in each of the 2 rows x 4 heads of the one selecting layer, at 5 decode
    steps); the counts come from the decode steps themselves."""
    model, _, _ = setup
    prompt = random_tokens(8, (2, 150))
    tallies, outputs = [], []
    for name, options in (("quest", {}), ("quest_adaptive", {"top_p": 1.0})):
        tally = PageReads()
        policy = counting(kvjax.make_policy(name, token_budget=48, dense_layers=1, **options), tally)
        outputs.append(kvjax.generate(model, prompt, max_new_tokens=6, policy=policy))
        tallies.append(tally)
    np.testing.assert_array_equal(outputs[0], outputs[1])
    for tally in tallies:
        assert tally.rows == 5 * 2 * model.cfg.num_heads and tally.mean == 48 // 16


@pytest.mark.parametrize(
    "options, message",
    [({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in"),
     ({"min_pages": 9}, "min_pages must be in"), ({"token_budget": 16}, "token_budget must be >= 32")],
)
def test_adaptive_quest_bad_options(setup, options, message):
    model = setup[0]
    with pytest.raises(ValueError, match=message):
        kvjax.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=kvjax.make_policy("quest_adaptive", **options))
