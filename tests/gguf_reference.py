"""The reference for the GGUF tests: transformers' own loading of a GGUF file, and the shape metadata every
llama.cpp architecture writes (tests/test_gguf.py, tests/test_gemma3.py, the real-model tests)."""

from __future__ import annotations

import os


def fetched_or_skip(name: str) -> str:
    """A real model's path, or skip the calling module naming `kvjax fetch NAME` (which KVJAX_TEST_REQUIRE=real
    turns into a failure, conftest.py); called before anything else may skip, so that skip is the one seen."""
    import pytest

    from kvjax.models import hub

    path = hub.cached_path(name)
    if path is None:
        pytest.skip(f"{name} is not fetched; run `kvjax fetch {name}` to run these tests", allow_module_level=True)
    return path


def transformers_gguf(path, threads: int | None = None):
    """transformers' model of the GGUF file at `path`, dequantised to float32, in eval mode (torch on
    `threads` threads where given)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    path = os.fspath(path)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def add_shape_metadata(writer, cfg) -> None:
    """The sizes of a transformers config `cfg` as `GGUFWriter` metadata (llama.cpp's `{arch}.*` keys)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
