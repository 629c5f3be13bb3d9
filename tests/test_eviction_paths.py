"""Attention probabilities for eviction, rebuilt from the kernels' row statistics, against a full softmax.

H2O and TOVA need the attention each slot receives. The steps attend through the blocked prefill loop and
the decode kernels only, and rebuild what the policy reads from the row max and sum: H2O's prefill column
sums with one more blocked pass over the keys (`attention_column_sums`), a decode step's probabilities with
one pass over the layer's keys (`DecodeView.probs`). Here they are checked against `paged_attention`'s plain
softmax, and end to end: with the full-softmax path put back in, 64 decode steps keep the same positions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
import kvjax.engine.step
from conftest import random_tokens
from kvjax.cache.attention import attention_column_sums, blocked_paged_attention, decode_attention, paged_attention, read_slots
from kvjax.cache.compaction import kept_positions
from kvjax.policies import DecodeView
from kvjax.engine.decode import slot_fields


@pytest.fixture(scope="module")
def model(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


@pytest.fixture(scope="module")
def state(model):
    prompts = [random_tokens(3, (150,)).tolist(), random_tokens(4, (97,)).tolist()]
    state, _ = kvjax.prefill(model, prompts, chunk_size=64, page_size=16, max_new_tokens=8)
    return state


def test_column_sums_equal_the_softmax(model, state):
    """A chunk of 5 queries (the last row padding) over layer 1: blocked statistics, then column sums."""
    cfg = model.cfg
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 5, cfg.num_heads, cfg.head_dim)), jnp.float32)
    positions = jnp.asarray(state.next_position)[:, None] - 5 + jnp.arange(5)[None]
    rows = jnp.arange(5)[None, :] < jnp.asarray([[5], [4]])
    out, row_max, row_sum = blocked_paged_attention(q, positions, state, 1, block_pages=3, return_stats=True)
    sums = attention_column_sums(q, positions, state, 1, row_max, row_sum, rows, block_pages=3)
    ref_out, probs = paged_attention(q, positions, state, 1, return_probs=True)  # [B, H, G, T, S]
    expected = jnp.where(rows[:, None, None, :, None], probs, 0.0).sum(axis=(2, 3))
    np.testing.assert_allclose(np.asarray(sums), np.asarray(expected), atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)


@pytest.mark.parametrize("selection", ["dense", "per_query_head", "per_kv_head"])
def test_decode_probabilities_equal_the_softmax(model, state, selection):
    """The probabilities rebuilt from the decode kernel's statistics equal a softmax over the slots read."""
    cfg = model.cfg
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)
    P = state.max_pages
    selected = None
    if selection != "dense":
        rows = cfg.num_heads if selection == "per_query_head" else cfg.num_kv_heads
        selected = jnp.asarray(rng.integers(-1, 10, size=(2, rows, 3)), jnp.int32)  # repeats, -1, the current page
    _, row_max, row_sum = decode_attention(q, state, 1, selected, return_stats=True)
    read = None if selected is None else read_slots(selected, state.lengths[1], state.page_size, P)
    view = DecodeView(layer=1, num_layers=cfg.num_layers, next_position=state.next_position, **slot_fields(state, 1),
                      q=q[:, 0], row_max=row_max, row_sum=row_sum, read=read)
    B, H, S, D = view.k.shape
    logits = jnp.einsum("bhgd,bhsd->bhgs", q[:, 0].reshape(B, H, -1, D), view.k) * D**-0.5
    mask = view.valid[:, :, None] if read is None else read & view.valid[:, :, None]
    expected = jnp.where(mask, jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1), 0.0)
    np.testing.assert_allclose(np.asarray(view.probs), np.asarray(expected), atol=1e-6)
    assert np.allclose(np.asarray(view.probs).sum(-1), 1.0, atol=1e-5)
    if selected is not None:  # some slot below the length was not read
        assert (~np.asarray(mask) & np.asarray(view.valid)[:, :, None]).any()


def softmax_probs(view: DecodeView) -> jax.Array:
    """The full-softmax path the steps used before: softmax of q.k / sqrt(D) over the slots read."""
    B, H, S, D = view.k.shape
    logits = jnp.einsum("bhgd,bhsd->bhgs", view.q.reshape(B, H, -1, D), view.k.astype(view.q.dtype)) * D**-0.5
    read = view.valid[:, :, None] if view.read is None else view.read & view.valid[:, :, None]
    return jnp.where(read, jax.nn.softmax(jnp.where(read, logits, -1e30), axis=-1), 0.0)


def softmax_column_sums(q, positions, state, layer, row_max, row_sum, rows, **_):
    probs = paged_attention(q, positions, state, layer, return_probs=True)[1]
    return jnp.where(rows[:, None, None, :, None], probs, 0.0).sum(axis=(2, 3))


def _kept_after_decoding(model, policy, steps=64):
    prompts = [random_tokens(21, (77,)).tolist(), random_tokens(22, (50,)).tolist()]
    state, logits = kvjax.prefill(model, prompts, policy, chunk_size=32, page_size=8, max_new_tokens=steps)
    tokens = random_tokens(23, (steps, 2))
    for t in range(steps):
        logits, state = kvjax.decode_step(model, state, tokens[t], policy)
    return kept_positions(state), np.asarray(logits)


@pytest.mark.parametrize(
    "name", ["h2o", "tova", "compose-h2o-quest"],
)
def test_kernel_path_keeps_what_the_softmax_path_keeps(model, monkeypatch, name):
    budget = 32
    if name.startswith("compose"):
        policy = kvjax.make_policy("compose", evict=kvjax.make_policy("h2o", token_budget=budget),
                                   select=kvjax.make_policy("quest", token_budget=24, dense_layers=0))
    else:
        policy = kvjax.make_policy(name, token_budget=budget)
    kept, logits = _kept_after_decoding(model, policy)
    monkeypatch.setattr(DecodeView, "probs", property(softmax_probs))
    monkeypatch.setattr(kvjax.engine.step, "attention_column_sums", softmax_column_sums)
    jax.clear_caches()  # the steps are traced again, through the softmax path
    try:
        reference, reference_logits = _kept_after_decoding(model, policy)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    np.testing.assert_allclose(logits, reference_logits, atol=1e-4)
    for l, (per_l, ref_l) in enumerate(zip(kept, reference)):
        for b, (per_b, ref_b) in enumerate(zip(per_l, ref_l)):
            for h, (positions, expected) in enumerate(zip(per_b, ref_b)):
                assert sorted(positions.tolist()) == sorted(expected.tolist()), f"layer {l} row {b} head {h}"
