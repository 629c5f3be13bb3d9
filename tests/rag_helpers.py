"""Small random models and RAG requests shared by the tests/test_rag_*.py files."""

from __future__ import annotations

import dataclasses

import numpy as np

from conftest import CONFIGS, VOCAB
from kvjax.models.config import ModelConfig
from kvjax.models.loading import Model, init_params

# one conftest config per RoPE type of kvjax.models.rope.ROPE_REGISTRY
CONFIG_FOR_ROPE = {
    "default": "qwen2",
    "linear": "llama_linear_tied",
    "llama3": "llama_gqa_llama3",
    "yarn": "llama_yarn",
    "longrope": "phi3_longrope",
}


def rope_config(rope_type: str, **changes) -> ModelConfig:
    cfg = ModelConfig.from_hf_dict(CONFIGS[CONFIG_FOR_ROPE[rope_type]]().to_dict())
    return dataclasses.replace(cfg, **changes)


def random_model(cfg: ModelConfig, seed: int = 0, tokenizer=None) -> Model:
    """Random weights drawn wide enough (std 0.08) that logits depend on the context."""
    return Model(cfg, init_params(cfg, seed=seed, std=0.08), tokenizer=tokenizer)


def request(seed: int, num_chunks: int = 3, chunk_len: int = 24, prefix_len: int = 5, query_len: int = 4):
    """(prefix, chunks, query) token arrays of a random RAG request."""
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(0, VOCAB, n).astype(np.int32)  # noqa: E731
    return draw(prefix_len), [draw(chunk_len) for _ in range(num_chunks)], draw(query_len)


def word_tokenizer(words):
    """A word-level fast tokenizer over `words` (the first is the unknown token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])
