"""Sliding-window layers in `generate`'s own step (`kvjax.engine.step.append_and_attend_sliding`): logits equal
transformers' Mistral past the window, in chunked prefill and decode; a windowed layer holds only the
tokens its next query can see (pages freed as the window moves); per-layer windows (Gemma-2's pattern)
equal the dense windowed forward, with policies acting on the full-attention layers only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="compares with transformers, which runs on torch (the dev extra)")

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions
from kvjax.rag import ChunkStore, assemble
from kvjax.jenga import alternating_windows

TOL = 1e-4
WINDOW = 12  # mistral_sw12's


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_forward_logits_match_transformers_past_the_window(mistral):
    hf, model = mistral
    tokens = random_tokens(1, (40,))
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens[None]))[0], hf_logits(hf, tokens),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("decode_last", [0, 5])
def test_generate_matches_transformers_past_the_window(mistral, decode_last):
    """30-token prompts in chunks of 8 (the window moves inside and across chunks), 10 tokens decoded."""
    hf, model = mistral
    prompts = [random_tokens(2, (30,)).tolist(), random_tokens(3, (19,)).tolist()]
    tokens, logprobs = kvjax.generate(model, prompts, 10, decode_last=decode_last, chunk_size=8, page_size=4,
                                      return_logprobs=True, eos_token_id=-1)
    for prompt, row, row_logprobs in zip(prompts, np.asarray(tokens), np.asarray(logprobs)):
        reference = log_softmax(hf_logits(hf, prompt + row[:-1].tolist())[len(prompt) - 1 :])
        np.testing.assert_array_equal(row, reference.argmax(-1))
        np.testing.assert_allclose(row_logprobs, reference[np.arange(len(row)), row], atol=TOL, rtol=0)


def test_window_matters_at_these_lengths(mistral):
    """The same weights with full attention give other logits: the tests above would catch a missing mask."""
    hf, model = mistral
    tokens = random_tokens(1, (40,))
    unwindowed = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, sliding_window=None))
    gap = np.abs(np.asarray(kvjax.forward_logits(unwindowed, tokens[None]))[0] - hf_logits(hf, tokens)).max()
    assert gap > 1e-2


def test_windowed_layers_hold_only_what_the_next_query_sees(mistral):
    _, model = mistral
    n = 30
    state, _ = kvjax.prefill(model, [random_tokens(4, (n,)).tolist()], page_size=4, chunk_size=8, capacity=64)
    expected = list(range(n - WINDOW + 1, n))  # the next query, at n, sees n - 11 .. n
    for layer in kept_positions(state):
        for head in layer[0]:
            assert sorted(head) == expected
    held = (np.asarray(state.page_table) >= 0).sum(-1)  # [L, B, H]
    assert (held == -(-(WINDOW - 1) // 4)).all()  # 3 pages of 4, not the 8 that 30 tokens take
    assert int(state.num_free) == state.num_pages - int(held.sum())  # the rest went back to the pool


@pytest.fixture(scope="module")
def gemma_like(hf_models):
    """The tiny Llama with Gemma-2's pattern: even layers windowed (8 tokens), odd ones full."""
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    return dataclasses.replace(model, cfg=model.cfg.with_windows(alternating_windows(model.cfg.num_layers, 8)))


def test_alternating_windows_match_the_dense_windowed_forward(gemma_like):
    prompts = [random_tokens(5, (37,)).tolist(), random_tokens(6, (21,)).tolist()]
    tokens, logprobs = kvjax.generate(gemma_like, prompts, 6, chunk_size=16, page_size=4, return_logprobs=True,
                                      eos_token_id=-1)
    for prompt, row, row_logprobs in zip(prompts, np.asarray(tokens), np.asarray(logprobs)):
        sequence = np.asarray(prompt + row[:-1].tolist())[None]
        reference = log_softmax(np.asarray(kvjax.forward_logits(gemma_like, sequence))[0, len(prompt) - 1 :])
        np.testing.assert_array_equal(row, reference.argmax(-1))
        np.testing.assert_allclose(row_logprobs, reference[np.arange(len(row)), row], atol=TOL, rtol=0)


def test_policies_compress_only_the_full_attention_layers(gemma_like):
    """SnapKV keeps its budget in the full layers; the windowed layers keep their window, whatever the
    policy, and `with_windows` validates its input."""
    policy = kvjax.make_policy("snapkv", token_budget=16, window=4)
    state, _ = kvjax.prefill(gemma_like, [random_tokens(7, (40,)).tolist()], policy, page_size=4, chunk_size=16)
    lengths = np.asarray(state.lengths)[:, 0]  # [L, H]
    for layer, window in enumerate(gemma_like.cfg.windows):
        assert (lengths[layer] == (window - 1 if window else 16)).all(), layer
    with pytest.raises(ValueError, match=r"windows\[1\]"):
        gemma_like.cfg.with_windows([8, -1])


def test_chunk_reuse_refuses_a_windowed_model(mistral):
    _, model = mistral
    with pytest.raises(NotImplementedError, match="sliding windows"):
        assemble(model, ChunkStore(model), [1, 2], [[3, 4, 5]], [6])


def test_qwen2_slides_only_the_layers_its_config_names(hf_models):
    """Qwen2 with use_sliding_window slides the layers from max_window_layers on (transformers'
    layer_types): kvjax reads the same split and matches transformers past the window."""
    hf, path = hf_models("qwen2_sw8_from1")
    model = kvjax.load_model(path)
    assert model.cfg.windows == (0, 8)
    prompt = random_tokens(8, (26,)).tolist()
    tokens, logprobs = kvjax.generate(model, [prompt], 6, chunk_size=8, page_size=4, return_logprobs=True,
                                      eos_token_id=-1)
    row = np.asarray(tokens)[0]
    reference = log_softmax(hf_logits(hf, prompt + row[:-1].tolist())[len(prompt) - 1 :])
    np.testing.assert_array_equal(row, reference.argmax(-1))
    np.testing.assert_allclose(np.asarray(logprobs)[0], reference[np.arange(len(row)), row], atol=TOL, rtol=0)


def test_phi3_window_matches_transformers(hf_models):
    hf, path = hf_models("phi3_sw8")
    model = kvjax.load_model(path)
    assert model.cfg.windows == (8, 8)
    tokens = random_tokens(9, (30,))
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens[None]))[0], hf_logits(hf, tokens),
                               atol=TOL, rtol=0)
