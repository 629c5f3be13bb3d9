"""Gemma-3 270M (Q4_K_M GGUF, `kvjax fetch gemma3-270m`) against transformers' GGUF loading of the same file:
logits past the 512-token window, greedy tokens. Skipped unless the model is fetched (marker `real`)."""

import os

import numpy as np
import pytest

import kvjax
from gguf_reference import fetched_or_skip

# heavy: transformers takes about a minute to load the GGUF and kvjax half of that for the 262K-entry tokenizer;
# the quick suite keeps SmolLM2's real-model checks, CI runs these too
pytestmark = [pytest.mark.real, pytest.mark.heavy]
NAME = "gemma3-270m"
PATH = fetched_or_skip(NAME)  # the fetch first: its skip is the one KVJAX_TEST_REQUIRE=real checks
torch = pytest.importorskip("torch", reason="compares with transformers, which runs on torch (the dev extra)")

from gguf_reference import transformers_gguf  # noqa: E402

LICENSE = "/usr/share/common-licenses/GPL-3"
PROSE = (
    "The history of the city begins with a small settlement on the banks of the river, where farmers and "
    "fishermen traded grain, wool and salted fish. Over the following centuries the village grew into a "
    "market town, then into a busy port, and its merchants built warehouses, churches and a stone bridge. "
)


@pytest.fixture(scope="module")
def model():
    return kvjax.load_model(NAME)


@pytest.fixture(scope="module")
def reference():
    return transformers_gguf(PATH, threads=2)


def long_ids(model, count):
    text = open(LICENSE).read() if os.path.isfile(LICENSE) else PROSE * 40
    ids = model.tokenizer(text)["input_ids"][:count]
    assert len(ids) == count
    return ids


def test_config_and_logits_past_the_window_match_transformers(model, reference):
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings and cfg.eos_token_ids == (1,)
    assert cfg.windows == ((512,) * 5 + (0,)) * 3
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 1e4)
    tokens = np.asarray([long_ids(model, 640)], np.int32)  # the sliding layers drop the first 128 keys
    ours = np.asarray(kvjax.forward_logits(model, tokens))
    with torch.no_grad():
        ref = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - ref).max() < 3e-4, np.abs(ours - ref).max()  # the same dequantised weights
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_matches_transformers(model, reference):
    ids = model.tokenizer("The capital of France is")["input_ids"]
    ours = [int(t) for t in kvjax.generate(model, [ids], 12)[0]]
    with torch.no_grad():
        ref = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert ours == ref
    assert "France" in model.tokenizer.decode(ours)


def test_greedy_after_a_prompt_longer_than_the_window(model, reference):
    """Chunked prefill of 600 tokens (the sliding layers' pages freed as the window moves), then decode."""
    ids = long_ids(model, 600)
    ours = [int(t) for t in kvjax.generate(model, [ids], 8, chunk_size=256, eos_token_id=-1)[0]]
    with torch.no_grad():
        ref = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert ours == ref
