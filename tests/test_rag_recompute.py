"""Selective recomputation over reassembled chunk caches: 100% recompute equals full prefill, partial
recompute overwrites exactly the chosen slots, window grouping, the auxiliary scorer, and the baselines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.attention import dense_causal_attention
from kvjax.models import CausalLM, unrolled
from kvjax.rag import (
    AuxScorer, ChunkStore, assemble, cacheblend_prefill, cacheclip_prefill, direct_reuse, group_windows, rag_prefill,
    recompute,
)
from kvjax.rag.recompute import top_tokens
from kvjax.models.rope import rope_frequencies
from kvjax.cache.state import gather_layer
from rag_helpers import random_model, request, rope_config

TOL = 1e-4


@pytest.fixture(scope="module")
def llama():
    return random_model(rope_config("llama3", num_layers=3))


def _full_tokens(prefix, chunks, query):
    return np.concatenate([prefix, *chunks, query])


def _layer_kv(state, layer):
    """Valid K/V of row 0, head-major `[H, n, D]`, in slot order."""
    k, v, _, valid = gather_layer(state, layer)
    n = int(valid[0, 0].sum())
    return np.asarray(k[0, :, :n]), np.asarray(v[0, :, :n])


def _assert_same_cache(model, result, full_state, full_logits):
    np.testing.assert_allclose(np.asarray(result.logits), np.asarray(full_logits), atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(np.asarray(result.state.next_position), np.asarray(full_state.next_position))
    for layer in range(model.cfg.num_layers):
        for mine, ref in zip(_layer_kv(result.state, layer), _layer_kv(full_state, layer)):
            np.testing.assert_allclose(mine, ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("rope_type", ["llama3", "longrope"])
@pytest.mark.parametrize("form", ["pre_rope", "rotated"])
def test_full_recompute_equals_full_prefill(rope_type, form, llama):
    model = llama if rope_type == "llama3" else random_model(rope_config("longrope"))
    prefix, chunks, query = request(2)
    full_state, full_logits = kvjax.prefill(model, _full_tokens(prefix, chunks, query)[None], max_new_tokens=8)
    long_rope = full_state.long_rope  # the longrope request (5 + 72 + 4 + 8 positions > 32) uses long factors
    assert long_rope == (rope_type == "longrope")
    store = ChunkStore(model, form=form, long_rope=long_rope)
    ctx = assemble(model, store, prefix, chunks, query, max_new_tokens=8)
    result = recompute(model, ctx, ctx.chunk_slots)
    _assert_same_cache(model, result, full_state, full_logits)
    # decoding continues from the reassembled state as from the full one
    token = np.asarray(full_logits).argmax(-1)
    mine, _ = kvjax.decode_step(model, result.state, token)
    ref, _ = kvjax.decode_step(model, full_state, token)
    np.testing.assert_allclose(np.asarray(mine), np.asarray(ref), atol=TOL, rtol=TOL)


def test_cacheblend_at_full_ratio_equals_full_prefill(llama):
    prefix, chunks, query = request(3)
    full_state, full_logits = kvjax.prefill(llama, _full_tokens(prefix, chunks, query)[None], max_new_tokens=8)
    ctx = assemble(llama, ChunkStore(llama), prefix, chunks, query, max_new_tokens=8)
    _assert_same_cache(llama, cacheblend_prefill(llama, ctx, ratio=1.0), full_state, full_logits)


def test_direct_reuse_of_a_single_chunk_is_exact(llama):
    """One chunk after the shared prefix loses no context: reuse must equal full prefill (sinks not repeated,
    positions right)."""
    prefix, chunks, query = request(4, num_chunks=1)
    full_state, full_logits = kvjax.prefill(llama, _full_tokens(prefix, chunks, query)[None], max_new_tokens=8)
    ctx = assemble(llama, ChunkStore(llama, form="rotated"), prefix, chunks, query, max_new_tokens=8)
    _assert_same_cache(llama, direct_reuse(llama, ctx), full_state, full_logits)


def test_partial_recompute_overwrites_only_the_chosen_slots(llama):
    prefix, chunks, query = request(5)
    store = ChunkStore(llama)
    reused = assemble(llama, store, prefix, chunks, query)
    reused_k = [np.asarray(reused.layer_kv(layer)[0][0]) for layer in range(llama.cfg.num_layers)]  # [S, H, D]
    ctx = assemble(llama, store, prefix, chunks, query)
    chosen = ctx.chunk_slots[[3, 4, 5, 30, 31, 60]]
    result = recompute(llama, ctx, chosen)
    kept = np.setdiff1d(reused.chunk_slots, chosen)
    for layer in range(llama.cfg.num_layers):
        k, _ = _layer_kv(result.state, layer)
        k = np.moveaxis(k, 0, 1)  # [S, H, D]
        np.testing.assert_array_equal(k[kept], reused_k[layer][kept])
        np.testing.assert_array_equal(k[: reused.prefix_len], reused_k[layer][: reused.prefix_len])
        if layer == 0:  # layer 0's K/V depend on the token alone: recomputing changes nothing
            np.testing.assert_allclose(k[chosen], reused_k[layer][chosen], atol=TOL)
        else:
            assert np.abs(k[chosen] - reused_k[layer][chosen]).max() > 1e-3
    assert result.recompute_ratio == pytest.approx(len(chosen) / len(reused.chunk_slots))


def test_group_windows_completes_dense_windows_and_spends_the_budget():
    scores = np.zeros(32)
    scores[[0, 1, 2, 3, 4, 5]] = 10  # 6 of window 0: more than 5 -> the whole window
    scores[[8, 9, 10, 11, 12]] = 9  # 5 of window 1: not enough
    scores[20] = 8
    chosen = group_windows(scores, budget=10)
    assert len(chosen) == 10
    assert set(range(8)) <= set(chosen.tolist())
    # two slots left (< one window): the best remaining single tokens
    assert set(chosen.tolist()) - set(range(8)) == {8, 9}
    np.testing.assert_array_equal(top_tokens(scores, 10), np.sort(np.argsort(-scores, kind="stable")[:10]))
    # windows that fit keep coming until the budget is spent; a threshold of 7 needs all 8 selected
    many = group_windows(np.linspace(1, 0, 64), budget=24, window=8, threshold=7)
    np.testing.assert_array_equal(many, np.arange(24))
    with pytest.raises(ValueError, match="threshold"):
        group_windows(scores, 4, window=8, threshold=8)


def _reference_aux_scores(aux_model, tokens, query_len):
    """Head- and query-averaged attention of the auxiliary model's last layer, by a plain dense forward."""
    cfg = aux_model.cfg
    T = tokens.shape[0]

    def attend(layer, inputs, probs):
        if layer == cfg.num_layers - 1:
            q = inputs.q.reshape(1, T, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
            s = jnp.einsum("bthgd,bshd->bhgts", q, inputs.k) * cfg.head_dim**-0.5
            s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
            probs = jax.nn.softmax(s, axis=-1).mean(axis=(1, 2))[0]
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), probs

    def forward(params, tokens):
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        return CausalLM(cfg).apply({"params": params}, tokens[None], positions, rope_frequencies(cfg),
                                   unrolled(attend, cfg.num_layers), None)[1]

    probs = jax.jit(forward)(aux_model.params, jnp.asarray(tokens))
    return np.asarray(probs[-query_len:].mean(axis=0))


def test_aux_scores_are_the_last_layer_attention_from_the_query(llama):
    prefix, chunks, query = request(6)
    ctx = assemble(llama, ChunkStore(llama), prefix, chunks, query)
    aux = AuxScorer.truncated(llama, 2, context="full")
    expected = _reference_aux_scores(aux.model, ctx.tokens, len(query))[ctx.chunk_slots]
    np.testing.assert_allclose(aux.scores(ctx), expected, atol=1e-5)
    # over the reused caches of a single chunk nothing is lost, so both contexts agree there
    prefix1, chunks1, query1 = request(6, num_chunks=1)
    one = assemble(llama, ChunkStore(llama), prefix1, chunks1, query1)
    np.testing.assert_allclose(AuxScorer.truncated(llama, 2).scores(one), aux.scores(one), atol=1e-5)


def test_cacheclip_recomputes_the_budget_with_any_aux(llama):
    """CacheClip recomputes exactly the round(ratio x chunk tokens) chunk slots its auxiliary model scores
    highest (top tokens, or whole windows with grouping), whichever auxiliary model it is given: the main
    model's first layer, or a separately made model (other weights, same tokenizer) with its own chunk store,
    whose choice differs."""
    prefix, chunks, query = request(7)
    store = ChunkStore(llama)
    other = random_model(rope_config("llama3", num_layers=1), seed=9)
    aux_store = ChunkStore(other)
    ctx = assemble(llama, store, prefix, chunks, query)
    aux_ctx = assemble(other, aux_store, prefix, chunks, query, long_rope=ctx.long_rope)
    own, separate = AuxScorer.truncated(llama, 1), AuxScorer(other)
    scores = {"own": own.scores(ctx), "separate": separate.scores(ctx, aux_ctx)}
    budget, slots = round(0.25 * 72), ctx.chunk_slots
    for name, aux, extra in (("own", own, {}), ("separate", separate, {"aux_store": aux_store})):
        for grouping, choose in ((False, top_tokens), (True, group_windows)):
            result = rag_prefill(llama, store, prefix, chunks, query, "cacheclip", ratio=0.25, aux=aux,
                                 grouping=grouping, **extra)
            np.testing.assert_array_equal(np.sort(result.recomputed), slots[choose(scores[name], budget)],
                                          err_msg=f"aux={name}, grouping={grouping}")
    assert set(slots[top_tokens(scores["own"], budget)]) != set(slots[top_tokens(scores["separate"], budget)])
    assert kvjax.decode_step(llama, result.state, [1])[0].shape == (1, llama.cfg.vocab_size)


def test_an_assembled_rag_request_is_served_by_the_batch_engine(llama):
    """CacheClip's assembled state continues as an ordinary request of the serving engine, beside a prompt
    request: the same greedy tokens as `greedy_continue` (generate's decode loop) on that state."""
    from kvjax.rag import greedy_continue
    from kvjax.serving import BatchEngine

    prefix, chunks, query = request(8)
    expected = greedy_continue(llama, rag_prefill(llama, ChunkStore(llama), prefix, chunks, query, "cacheclip"), 6)
    result = rag_prefill(llama, ChunkStore(llama), prefix, chunks, query, "cacheclip")
    engine = BatchEngine(llama, max_rows=2, capacity=512, steps_per_dispatch=2)
    other = engine.submit(np.concatenate([prefix, query]), 5, eos_token_id=-1)
    rag = engine.submit_prefilled(result.state, result.logits, 6, eos_token_id=-1)
    out = engine.run()
    assert out[rag].tokens == expected.tolist() and len(out[other].tokens) == 5
    assert engine.leaked_pages == 0
