"""eval.locret_oracle: Locret scored by given labels evicts exactly by them, chunk by chunk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions
from kvjax.eval.lib.locret_labels import LabelScoredLocret

CHUNK, BUDGET, TAIL, STABLE = 32, 24, 8, 6  # evict budget b = BUDGET - TAIL = 16


def test_label_scored_locret_keeps_its_labels_top_per_chunk(hf_models):
    """Two chunks and a tail. Chunk one (not the last) keeps its STABLE newest slots and the labels' top of
    the rest; chunk two (the last) keeps the labels' top of what survived and its own tokens; the tail is
    appended without eviction. Rows are padded to different lengths, so labels are read by position."""
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    T = 2 * CHUNK + TAIL
    labels = np.random.default_rng(0).normal(size=(L, 2, T, H)).astype(np.float32)
    policy = LabelScoredLocret(token_budget=BUDGET, stabilizers=STABLE, local_tail=TAIL, labels=jnp.asarray(labels))
    tokens = random_tokens(3, (2, T))
    rows = [tokens[0], tokens[1, : T - 5]]  # the second row: its last chunk is short
    state, _ = kvjax.prefill(model, rows, policy=policy, chunk_size=CHUNK, page_size=8, max_new_tokens=4)
    kept = kept_positions(state)
    b = BUDGET - TAIL
    for row, n in enumerate(len(r) for r in rows):
        evicted = n - TAIL  # the prompt before its tail: two chunks
        for layer in range(L):
            for h in range(H):
                score = labels[layer, row, :, h]
                first = {int(i) for i in np.argsort(-score[: CHUNK - STABLE])[: b - STABLE]} | set(range(CHUNK - STABLE, CHUNK))
                candidates = np.array(sorted(first | set(range(CHUNK, evicted))))
                final = {int(i) for i in candidates[np.argsort(-score[candidates])[:b]]}
                assert set(kept[layer][row][h].tolist()) == final | set(range(evicted, n)), (row, layer, h)


def test_label_table_labels_are_compute_targets_labels():
    """The label table's one pass over a prefilled state (`answer_labels`) gives Locret's labels
    (`compute_targets`) of the context tokens for question + answer and for the answer alone."""
    import kvjax
    from kvjax.eval.locret_label_table import answer_labels
    from kvjax.eval.lib.locret_labels import batch_labels

    model = kvjax.load_model("tiny")
    rng = np.random.default_rng(0)
    contexts = [rng.integers(3, 120, 70).tolist(), rng.integers(3, 120, 45).tolist()]
    questions, answers = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    state, _ = kvjax.prefill(model, contexts, None, max_new_tokens=8)
    both, answer = (np.asarray(x) for x in answer_labels(model, state, contexts, questions, answers))
    # the answer's queries follow the question: its reference reads context + question as the prefix
    references = (([c for c in contexts], [q + a for q, a in zip(questions, answers)]),
                  ([c + q for c, q in zip(contexts, questions)], answers))
    for got, (prefixes, fed) in zip((both, answer), references):
        want = batch_labels(model, prefixes, fed, chunk=64)  # [L, B, Tp, H] by position
        for b, n in enumerate(map(len, contexts)):
            np.testing.assert_allclose(got[:, b, :, :n], np.moveaxis(want[:, b, :n], -1, 1), rtol=1e-4, atol=1e-4)
            assert np.all(np.isneginf(got[:, b, :, n:]))


@pytest.mark.heavy  # two tiny-model Locret prefills, about 10 s
def test_recorded_locret_reports_scores_and_kept_slots_as_evicted():
    """`recorded_prefill` (the chunk trace's Locret) reports a score for every token and, after each chunk, the
    slots kept, the last of them the state's; one eviction of a single chunk's scores (`one_eviction`, the
    trace's ranking) keeps exactly what the engine's pooled eviction kept."""
    from kvjax.eval.lib.locret_labels import recorded_prefill
    from kvjax.eval.trace_needle import one_eviction

    model = kvjax.load_model("tiny")
    context = np.random.default_rng(4).integers(3, 120, 90).tolist()
    evicted = len(context) - TAIL
    policy = kvjax.make_policy("locret", heads="tiny", token_budget=BUDGET, stabilizers=STABLE, local_tail=TAIL,
                               pool="all", head_cap=2, sink_size=2)
    for chunk, seen in ((32, [32, 64, evicted]), (96, [evicted])):
        state, _, scores, after = recorded_prefill(model, policy, context, 4, chunk)
        assert list(after) == seen and not np.isnan(scores).any()
        kept = kept_positions(state)
        last = after[evicted]
        for layer in range(model.cfg.num_layers):
            for h in range(model.cfg.num_kv_heads):
                assert set(last[layer][h].tolist()) == set(kept[layer][0][h].tolist()) - set(range(evicted, len(context)))
    keep = one_eviction(scores[:, :evicted], policy)  # the single chunk's
    for layer in range(model.cfg.num_layers):
        for h in range(model.cfg.num_kv_heads):
            assert set(np.flatnonzero(keep[layer, :, h]).tolist()) == set(last[layer][h].tolist()), (layer, h)
