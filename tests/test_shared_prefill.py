"""One shared full prefill, every policy derived from it, equals each policy's own prefill.

All derivable matrix cases (tests/policy_cases.py: every registered policy that compresses after prefill
or only selects pages, and the compositions) share one prefill of a ragged batch, which gathers the
largest query window and the accumulated attention. Each derived state must keep exactly the positions
the policy's own `prefill` keeps, and generation from it (the question fed by decode, ragged) must give
the tokens `generate(decode_last=...)` gives.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions
from kvjax.engine.generation import continue_rows
from kvjax.engine.shared_prefill import capture_for, derive, shared_prefill
from policy_cases import case_param, matrix_cases

PAGE, CHUNK = 8, 32
CONTEXT_LENGTHS = (77, 50)
QUESTION, ANSWER = 5, 6


def _model(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


CASES = [c for c in matrix_cases(kvjax.ModelConfig(
    model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256,
), page_size=PAGE) if c.policy.compressor is None or (c.policy.compressor.chunks is None
                                                     and c.policy.compressor.scoring_pass is None)]


@pytest.fixture(scope="module")
def shared(hf_models):
    model = _model(hf_models)
    contexts = [random_tokens(10 + i, (n,)).tolist() for i, n in enumerate(CONTEXT_LENGTHS)]
    questions = [random_tokens(20 + i, (QUESTION,)).tolist() for i in range(len(contexts))]
    policies = [c.policy for c in CASES]
    return model, contexts, questions, shared_prefill(
        model, contexts, policies, reserve_tokens=QUESTION + ANSWER, page_size=PAGE, chunk_size=CHUNK
    )


def test_capture_gathers_for_every_policy():
    capture = capture_for([c.policy for c in CASES])
    assert capture.accumulate
    assert capture.window == max(c.policy.compressor.window_size for c in CASES if c.policy.compresses) > 1


@pytest.mark.parametrize("case", [case_param(c.id, c) for c in CASES])
def test_derived_equals_own_prefill(shared, case):
    model, contexts, questions, prefilled = shared
    policy = case.policy
    state, logits = derive(model, prefilled, policy)
    own, own_logits = kvjax.prefill(
        model, contexts, policy, page_size=PAGE, chunk_size=CHUNK, max_new_tokens=QUESTION + ANSWER
    )
    derived_kept, own_kept = kept_positions(state), kept_positions(own)
    for layer in range(model.cfg.num_layers):
        for b in range(len(contexts)):
            for h in range(model.cfg.num_kv_heads):
                np.testing.assert_array_equal(
                    np.sort(derived_kept[layer][b][h]), np.sort(own_kept[layer][b][h]), err_msg=f"{layer} {b} {h}"
                )
    np.testing.assert_allclose(np.asarray(logits), np.asarray(own_logits), atol=1e-5)
    tokens = continue_rows(model, state, logits, [np.asarray(q) for q in questions], ANSWER, policy)
    expected = kvjax.generate(
        model, [c + q for c, q in zip(contexts, questions)], ANSWER, policy, decode_last=QUESTION, page_size=PAGE,
        chunk_size=CHUNK,
    )
    np.testing.assert_array_equal(tokens, expected)


def test_shared_state_survives_derivation(shared):
    model, _, _, prefilled = shared
    before = np.asarray(prefilled.state.k_pages).copy()
    derive(model, prefilled, kvjax.make_policy("snapkv", token_budget=32, window=8, kernel_size=3))
    np.testing.assert_array_equal(np.asarray(prefilled.state.k_pages), before)


def test_ragged_questions_fed_by_decode(shared):
    """Rows with questions of different lengths: each row equals its own generate."""
    model, contexts, _, prefilled = shared
    questions = [random_tokens(30, (3,)).tolist(), random_tokens(31, (7,)).tolist()]
    policy = kvjax.make_policy("h2o", token_budget=32)
    state, logits = derive(model, prefilled, policy)
    tokens = continue_rows(model, state, logits, [np.asarray(q) for q in questions], ANSWER, policy)
    for b, (context, question) in enumerate(zip(contexts, questions)):
        alone = kvjax.generate(model, [context + question], ANSWER, policy, decode_last=len(question),
                               page_size=PAGE, chunk_size=CHUNK, capacity=prefilled.state.capacity)
        np.testing.assert_array_equal(tokens[b], alone[0], err_msg=f"row {b}")


def test_errors_name_the_policy(shared):
    model, _, _, prefilled = shared
    locret = [c.policy for c in matrix_cases(kvjax.ModelConfig(
        model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    ), page_size=PAGE) if c.id == "locret"][0]
    with pytest.raises(ValueError, match="locret.*chunk schedule"):
        derive(model, prefilled, locret)
    with pytest.raises(ValueError, match="snapkv.*did not gather"):
        derive(model, prefilled, kvjax.make_policy("snapkv", token_budget=32, window=64, kernel_size=3))


def test_fed_tokens_nll_equals_dense_forward(shared):
    """feed_tokens' per-token NLL (the decode perplexity) under the full cache equals the dense forward's."""
    import jax

    from kvjax.engine.generation import feed_tokens

    model, contexts, _, prefilled = shared
    policy = kvjax.make_policy("full")
    continuation = [random_tokens(40, (6,)), random_tokens(41, (4,))]  # ragged: NaN past a row's end
    state, logits = derive(model, prefilled, policy)
    _, _, nll = feed_tokens(model, state, logits, continuation, policy, return_nll=True)
    assert nll.shape == (2, 6) and np.isnan(nll[1, 4:]).all()
    for b, (context, tokens) in enumerate(zip(contexts, continuation)):
        full = np.asarray(context + list(tokens))[None]
        logprobs = jax.nn.log_softmax(kvjax.forward_logits(model, full)[0], axis=-1)
        expected = [-float(logprobs[len(context) - 1 + j, int(t)]) for j, t in enumerate(tokens)]
        np.testing.assert_allclose(nll[b, : len(tokens)], expected, rtol=1e-4, atol=1e-4)


def test_question_in_prefill_equals_generate(hf_models):
    """SnapKV's setting (the question prefilled with the context, then compressed) equals generate without
    decode_last, through the same shared path (empty tails fed by decode)."""
    from kvjax.engine.generation import continue_rows

    model = _model(hf_models)
    prompts = [random_tokens(50 + i, (n,)).tolist() for i, n in enumerate((40, 33))]
    policy = kvjax.make_policy("snapkv", token_budget=16, window=4, kernel_size=3)
    shared = shared_prefill(model, prompts, [policy], reserve_tokens=ANSWER, page_size=PAGE, chunk_size=CHUNK)
    state, logits = derive(model, shared, policy)
    tokens = continue_rows(model, state, logits, [np.zeros(0, np.int32)] * 2, ANSWER, policy)
    expected = kvjax.generate(model, prompts, ANSWER, policy, page_size=PAGE, chunk_size=CHUNK)
    np.testing.assert_array_equal(tokens, expected)
