"""Gemma-3 against transformers' Gemma3ForCausalLM on tiny random weights: five sliding-window layers to one
global with their own RoPE bases, Gemma's norms, QK-norm, scaled embeddings and query scale; the dense forward,
chunked prefill and decode through the engine, an HF directory and a GGUF file written as llama.cpp does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="compares with transformers, which runs on torch (the dev extra)")

import transformers  # noqa: E402

import kvjax  # noqa: E402
from conftest import random_tokens  # noqa: E402
from gguf_reference import add_shape_metadata, transformers_gguf  # noqa: E402
from kvjax.models.config import ModelConfig  # noqa: E402
from kvjax.rag.rope_shift import RopeShiftError, shift_keys  # noqa: E402

TOL = 1e-4
VOCAB = 97
WINDOW = 8
# five sliding-window layers to one global, as Gemma-3; query_pre_attn_scalar unlike head_dim, linear scaling on
# the global layers (Gemma-3 4B's), so each of Gemma's pieces changes the logits
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
              query_pre_attn_scalar=24, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
              attn_implementation="eager")


def random_gemma(seed=0, **overrides):
    """A Gemma3ForCausalLM with random weights, norms included (HF initialises Gemma's norm weights at 0)."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**CONFIG, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08 if p.ndim >= 2 else 0.3)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers model, kvjax model loaded from its saved directory)."""
    hf = random_gemma()
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return hf, kvjax.load_model(str(path))


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_config_reads_gemma3(gemma):
    cfg = gemma[1].cfg
    assert cfg.windows == (WINDOW,) * 5 + (0,) and cfg.per_layer_rope and cfg.tie_word_embeddings
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.local_rope.theta) == (1e6, "linear", 10000.0)
    assert cfg.norm_offset == 1.0 and cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.embedding_scale == 8.0 and cfg.query_scale == 24**-0.5


def test_transformers_4_spelling_reads_the_same():
    """transformers 4.x wrote `rope_theta`, `rope_local_base_freq` and `sliding_window_pattern` instead of
    per-type `rope_parameters` and `layer_types`."""
    new = transformers.Gemma3TextConfig(**{**CONFIG, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}).to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window_pattern=6)
    assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(new)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        ModelConfig.from_hf_dict({**new, "attn_logit_softcapping": 50.0})


def test_forward_logits_match_transformers(gemma):
    hf, model = gemma
    tokens = random_tokens(1, (2, 40))  # five times the window
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), ref, atol=TOL, rtol=0)
    # the local layers' own RoPE base matters at these lengths: with the global one the logits differ
    same_rope = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, local_rope=model.cfg.rope))
    assert np.abs(np.asarray(kvjax.forward_logits(same_rope, tokens)) - ref).max() > 1e-2
    # windows switched off: the local layers keep their RoPE, so only positions past the window change
    unwindowed = dataclasses.replace(model, cfg=model.cfg.with_windows([0] * 6))
    gap = np.abs(np.asarray(kvjax.forward_logits(unwindowed, tokens)) - ref).max(axis=(0, 2))
    assert gap[:WINDOW].max() < TOL and gap[WINDOW:].max() > 1e-2
    with pytest.raises(RopeShiftError, match="layers differ in RoPE"):  # RAG's key moves need one RoPE
        shift_keys(np.zeros((1, 4, 2, 16), np.float32), np.ones((1, 4), np.int32), unwindowed.cfg)


def test_prefill_and_decode_match_transformers(gemma):
    """Chunked prefill (chunks of 8, pages of 4: the window moves inside and across chunks), then one
    decode step a token: every logit equals transformers' dense forward over the whole sequence."""
    hf, model = gemma
    tokens = random_tokens(2, (1, 29))
    ref = hf_logits(hf, tokens)
    state, last = kvjax.prefill(model, tokens[:, :21], page_size=4, chunk_size=8, max_new_tokens=8)
    np.testing.assert_allclose(np.asarray(last), ref[:, 20], atol=TOL, rtol=0)
    for t in range(21, 29):
        logits, state = kvjax.decode_step(model, state, tokens[:, t])
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=TOL, rtol=0)


def test_generate_matches_transformers_greedy(gemma):
    hf, model = gemma
    prompts = [random_tokens(3, (30,)).tolist(), random_tokens(4, (13,)).tolist()]
    tokens, logprobs = kvjax.generate(model, prompts, 6, chunk_size=8, page_size=4, return_logprobs=True,
                                      eos_token_id=-1)
    for prompt, row, row_logprobs in zip(prompts, np.asarray(tokens), np.asarray(logprobs)):
        reference = log_softmax(hf_logits(hf, [prompt + row[:-1].tolist()])[0, len(prompt) - 1 :])
        np.testing.assert_array_equal(row, reference.argmax(-1))
        np.testing.assert_allclose(row_logprobs, reference[np.arange(len(row)), row], atol=TOL, rtol=0)


# ------------------------------------------------------------------------------------------------- GGUF


def write_gemma3_gguf(path, model, qtype):
    """`model` as llama.cpp's converter writes a Gemma-3: its tensor names, norm weights stored as 1 + w,
    the global RoPE base only (the local one, 10000, and every sixth layer global are llama.cpp's own)."""
    gguf = pytest.importorskip("gguf")
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    add_shape_metadata(writer, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_file_type(int(qtype))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        base, suffix = hf_name.rsplit(".", 1)
        values = tensor.detach().numpy().astype(np.float32)
        if base.endswith("norm"):
            values = values + 1.0
        if qtype != gguf.GGMLQuantizationType.F32 and values.ndim == 2:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_the_source_and_transformers(tmp_path, qtype):
    """Head dim 256 (the 270M's): transformers' GGUF reader takes query_pre_attn_scalar at its default 256,
    llama.cpp at head_dim. F32 is lossless: kvjax equals the source model; Q8_0 equals transformers' reading."""
    gguf = pytest.importorskip("gguf")
    source = random_gemma(seed=1, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                          query_pre_attn_scalar=256, rope_parameters=None)
    path = write_gemma3_gguf(tmp_path / "gemma3.gguf", source, getattr(gguf.GGMLQuantizationType, qtype))
    model = kvjax.load_model(path)
    assert model.cfg.windows == (WINDOW,) * 5 + (0,) and model.cfg.local_rope.theta == 10000.0
    tokens = random_tokens(5, (1, 30))
    ours = np.asarray(kvjax.forward_logits(model, tokens))
    if qtype == "F32":
        np.testing.assert_allclose(ours, hf_logits(source, tokens), atol=TOL, rtol=0)
    else:
        np.testing.assert_allclose(ours, hf_logits(transformers_gguf(path), tokens), atol=TOL, rtol=0)
