"""Logits parity with `transformers` (torch, float32) on the same random weights: max abs diff <= 1e-4."""

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="compares with transformers, which runs on torch (the dev extra)")

import kvjax
from conftest import random_tokens

TOL = 1e-4


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "llama_yarn", "llama_linear_tied", "qwen2"])
def test_dense_logits_match_transformers(hf_models, name):
    hf, path = hf_models(name)
    model = kvjax.load_model(path)
    tokens = random_tokens(1, (2, 80))  # longer than the 64-token original context the scalings extend
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), hf_logits(hf, tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("length", [24, 48])
def test_phi3_longrope_short_and_long(hf_models, length):
    """Phi-3: fused qkv/gate_up; LongRoPE's short factors at 24 tokens, long ones past the 32-token original."""
    hf, path = hf_models("phi3_longrope")
    model = kvjax.load_model(path)
    assert model.cfg.fused_qkv and model.cfg.rope.rope_type == "longrope"
    tokens = random_tokens(2, (1, length))
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), hf_logits(hf, tokens), atol=TOL, rtol=0)


def test_phi3_cached_generation_uses_the_prefill_decision(hf_models):
    """A cached run whose declared length passes the original context uses long factors throughout, so its
    logits equal transformers' dense forward over the whole sequence (which also uses long factors)."""
    hf, path = hf_models("phi3_longrope")
    model = kvjax.load_model(path)
    tokens = random_tokens(3, (1, 40))
    state, last = kvjax.prefill(model, tokens[:, :20], max_new_tokens=20)  # declared 40 > 32: long
    assert state.long_rope
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(last), ref[:, 19], atol=TOL, rtol=0)
    for t in range(20, 40):
        logits, state = kvjax.decode_step(model, state, tokens[:, t])
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=TOL, rtol=0)


def test_phi3_short_generation_keeps_short_factors(hf_models):
    """prompt + max_new_tokens within the original context: short factors, whatever the cache's capacity."""
    hf, path = hf_models("phi3_longrope")
    model = kvjax.load_model(path)
    tokens = random_tokens(4, (1, 24))
    state, last = kvjax.prefill(model, tokens[:, :12], max_new_tokens=12)
    assert not state.long_rope and state.capacity > 32
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(last), ref[:, 11], atol=TOL, rtol=0)
    for t in range(12, 24):
        logits, state = kvjax.decode_step(model, state, tokens[:, t])
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=TOL, rtol=0)
