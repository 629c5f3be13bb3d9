"""Quest against a plain numpy statement of its definition, and end to end through generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.policies import Compose
from kvjax.engine.decode import page_view
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
    assert not policy.selects_pages(0) and policy.selects_pages(1)  # layer 0 is dense: the step reads it whole
    selected = np.asarray(policy.select_pages(page_view(state, 1, model.cfg.num_layers, jnp.asarray(q))))
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


def quest_masked_logits(model, tokens: np.ndarray, budget: int, dense_layers: int, ps: int = 16) -> np.ndarray:
    """Logits at the last token of `tokens [B, T]`, Quest written independently as an attention mask: every
    row attends densely except the last (the decode step), which in layers >= dense_layers reads only the
    top (budget/ps - 1) pages of the earlier rows by sum_d max(q_d min_d, q_d max_d) (per query head, min and
    max over the page's keys) plus the current page. Pages are the consecutive ps-token blocks of a prompt
    prefilled from position 0, as in the paged cache."""
    from kvjax.cache.attention import dense_causal_attention
    from kvjax.models import CausalLM
    from kvjax.models.rope import rope_frequencies

    def attend(layer, inputs, carry):
        q, k, v = inputs.q, inputs.k, inputs.v  # [B, T, Hq, D], [B, T, H, D]
        dense = dense_causal_attention(q, k, v)
        B, T, Hq, D = q.shape
        G = Hq // k.shape[2]
        kq, vq = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # [B, T, Hq, D]
        scored = (T - 1) // ps  # whole pages before the current one
        pages = kq[:, : scored * ps].reshape(B, scored, ps, Hq, D)
        last = q[:, -1]  # [B, Hq, D]
        score = jnp.maximum(last[:, None] * pages.min(2), last[:, None] * pages.max(2)).sum(-1)  # [B, n, Hq]
        top = jnp.argsort(-score, axis=1)[:, : budget // ps - 1]  # [B, K, Hq]
        page_of = jnp.arange(T) // ps
        read = (page_of[None, :, None, None] == top[:, None]).any(2) | (page_of >= scored)[None, :, None]  # [B, T, Hq]
        s = jnp.einsum("bhd,bthd->bht", last, kq) * D**-0.5
        p = jax.nn.softmax(jnp.where(jnp.moveaxis(read, 1, 2), s, -jnp.inf), axis=-1)
        sparse = dense.at[:, -1].set(jnp.einsum("bht,bthd->bhd", p, vq))
        return jnp.where(jnp.asarray(layer) < dense_layers, dense, sparse), carry

    T = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)
    logits, _ = CausalLM(model.cfg, model.dtype).apply(
        {"params": model.params}, jnp.asarray(tokens), positions, rope_frequencies(model.cfg), attend, None,
        method=CausalLM.hidden_and_logits,
    )
    return np.asarray(logits[:, -1])


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_quest_decode_reads_only_the_selected_pages(model, dense_layers):
    """A decode step under Quest gives the logits of attention restricted to Quest's pages: 48 slots' worth
    (two scored pages and the current one, 41 slots) of 201, in every layer from `dense_layers` on."""
    prompt = random_tokens(7, (2, 200))
    token = np.array([5, 9])
    quest = kvjax.make_policy("quest", token_budget=48, dense_layers=dense_layers)
    state, _ = kvjax.prefill(model, prompt, max_new_tokens=4)
    logits, state = kvjax.decode_step(model, state, token, policy=quest)
    expected = quest_masked_logits(model, np.concatenate([prompt, token[:, None]], 1), 48, dense_layers)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4)
    full_state, _ = kvjax.prefill(model, prompt, max_new_tokens=4)
    full_logits, _ = kvjax.decode_step(model, full_state, token)
    assert np.abs(np.asarray(full_logits) - expected).max() > 1e-3  # the restriction matters on this prompt
    check_invariants(state)  # Quest keeps every slot
    assert int(state.lengths.min()) == 201


def test_compose_evicts_then_selects(model):
    """Compose(evict=SnapKV, select=Quest) keeps what SnapKV alone keeps, and its decode step reads what Quest
    selects from that evicted cache: the logits of Quest decoding SnapKV's state, not SnapKV's dense read."""
    from kvjax.cache.compaction import kept_positions

    prompt = random_tokens(9, (1, 160))
    snapkv = kvjax.make_policy("snapkv", token_budget=96, window=16)
    quest = kvjax.make_policy("quest", token_budget=32, dense_layers=0)
    policy = Compose(evict=snapkv, select=quest)
    out = kvjax.generate(model, prompt, max_new_tokens=5, policy=policy)
    assert out.shape == (1, 5) and np.all(out >= 0)
    state, _ = kvjax.prefill(model, prompt, policy=policy)
    evicted, _ = kvjax.prefill(model, prompt, policy=snapkv)
    assert int(np.asarray(state.lengths).max()) == 96
    np.testing.assert_array_equal(kept_positions(state), kept_positions(evicted))
    token = np.array([5])  # decode_step consumes its state: each read gets its own prefill
    composed, _ = kvjax.decode_step(model, state, token, policy=policy)
    selected, _ = kvjax.decode_step(model, evicted, token, policy=quest)
    dense, _ = kvjax.decode_step(model, kvjax.prefill(model, prompt, policy=snapkv)[0], token, policy=snapkv)
    np.testing.assert_allclose(np.asarray(composed), np.asarray(selected), atol=1e-5)
    assert np.abs(np.asarray(composed) - np.asarray(dense)).max() > 1e-3  # the selection matters here


def test_compose_refuses_parts_in_the_wrong_role(model):
    quest, snapkv = kvjax.make_policy("quest", token_budget=32), kvjax.make_policy("snapkv", token_budget=64)
    for policy, message in ((Compose(evict=quest, select=quest), "evict=quest selects pages"),
                            (Compose(evict=snapkv, select=snapkv), "select=snapkv evicts")):
        with pytest.raises(ValueError, match=message):
            kvjax.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=policy)


@pytest.mark.parametrize(
    "options, message",
    [({"token_budget": 16}, "token_budget must be >= 32"), ({"page_size": 32}, "does not match the cache's page_size=16")],
)
def test_quest_bad_options(model, options, message):
    with pytest.raises(ValueError, match=message):
        kvjax.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=kvjax.make_policy("quest", **options))
