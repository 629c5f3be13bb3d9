"""GGUF loading: tiny random Llama and Qwen2 files written with `gguf.GGUFWriter` in many quant types, against
transformers' own GGUF loading and the source safetensors model; config, tokenizer, clear errors."""

import json
import os
import shutil

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="compares with transformers, which runs on torch (the dev extra)")

gguf = pytest.importorskip("gguf")

import kvjax  # noqa: E402
from conftest import random_tokens  # noqa: E402
from gguf_reference import add_shape_metadata, transformers_gguf  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "Ġ c", "o u", "e n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# (byte offset, typical value) of the float16 scales (d, dmin) in one block of each K-quant, chosen so that
# random blocks give weights of std about 0.1 (gguf.quants has no quantizer for these types)
K_QUANT_SCALES = {
    Q.Q2_K: ((80, 6e-3), (82, 9e-3)), Q.Q3_K: ((108, 2e-3),), Q.Q4_K: ((0, 4e-4), (2, 3e-3)),
    Q.Q5_K: ((0, 2e-4), (2, 3e-3)), Q.Q6_K: ((208, 6e-5),),
}


def vocabulary():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    return SPECIALS + byte_tokens + [m.replace(" ", "") for m in MERGES]


VOCAB = len(vocabulary())  # 272


def llama(seed=0, **overrides):
    """A tiny random Llama whose rows (256, 512) suit K-quants' 256-element blocks."""
    base = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
    return _random(LlamaForCausalLM(LlamaConfig(**{**base, **overrides})), seed)


def qwen2(seed=0):
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=None, tie_word_embeddings=False)
    return _random(Qwen2ForCausalLM(config), seed)


def _random(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    return model.eval()


def llamacpp_permute(w, n_head, n_head_kv):
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (rows of Q and K for its interleaved RoPE)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(values, qtype, rng):
    """(data, raw_dtype) for GGUFWriter.add_tensor: real quantisation, or random K-quant blocks."""
    if qtype == Q.F32 or values.ndim == 1:
        return values.astype(np.float32), None
    if qtype == Q.F16:
        return values.astype(np.float16), None
    if qtype in K_QUANT_SCALES:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
        for offset, typical in K_QUANT_SCALES[qtype]:
            scale = (typical * rng.uniform(0.5, 1.5, size=blocks.shape[0])).astype(np.float16)
            blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1), qtype
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def write_gguf(path, model, arch="llama", qtype=Q.F32, tokenizer=True, seed=0, extra=None, extra_tensors=None,
               replace=None, name="kvjax test model"):
    """Write `model` (a transformers model) as llama.cpp would: GGUF names, Q/K rows permuted for Llama.
    `extra`: more metadata {key: (writer kind, value)}; `extra_tensors`: {gguf name: float32 array};
    `replace`: {gguf name: (raw data, raw dtype)} written instead of that tensor."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    add_shape_metadata(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_file_type(int(qtype))
    for key, (kind, value) in (extra or {}).items():
        getattr(writer, f"add_{kind}")(key, value)
    if tokenizer:
        tokens = vocabulary()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                        cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, tensor in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        values = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and base.endswith("q_proj"):
            values = llamacpp_permute(values, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            values = llamacpp_permute(values, cfg.num_attention_heads, cfg.num_key_value_heads)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        data, raw_dtype = (replace or {}).get(gguf_name) or encode(values, qtype, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    for gguf_name, values in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, np.asarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def logits_of(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


QUANTS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", QUANTS, ids=lambda q: q.name)
def test_llama_logits_match_transformers_gguf(tmp_path, qtype):
    source = llama(tie_word_embeddings=qtype in (Q.F16, Q.Q4_K))
    path = write_gguf(tmp_path / "model.gguf", source, qtype=qtype)
    model = kvjax.load_model(path)
    tokens = random_tokens(1, (2, 24), VOCAB)
    ours = np.asarray(kvjax.forward_logits(model, tokens))
    ref = logits_of(transformers_gguf(path), tokens)
    assert 1.0 < np.abs(ref).max() < 40.0, np.abs(ref).max()  # the weights are neither degenerate nor huge
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    if qtype == Q.F32:  # lossless: the source model itself, not only transformers' reading of the file
        np.testing.assert_allclose(ours, logits_of(source, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_qwen2_logits_match(tmp_path, qtype):
    source = qwen2()
    path = write_gguf(tmp_path / "qwen.gguf", source, arch="qwen2", qtype=qtype)
    model = kvjax.load_model(path)
    assert model.cfg.model_type == "qwen2" and model.cfg.attention_bias
    tokens = random_tokens(2, (1, 20), VOCAB)
    ours = np.asarray(kvjax.forward_logits(model, tokens))
    np.testing.assert_allclose(ours, logits_of(transformers_gguf(path), tokens), atol=1e-4, rtol=0)
    if qtype == Q.F32:
        np.testing.assert_allclose(ours, logits_of(source, tokens), atol=1e-4, rtol=0)


def test_rope_scaling_metadata(tmp_path):
    """Linear scaling (which transformers' GGUF reader drops) and Llama 3's `rope_freqs` tensor, against the
    source models (transformers' llama3 RoPE)."""
    linear = llama(rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = write_gguf(tmp_path / "linear.gguf", linear, extra={"llama.rope.scaling.type": ("string", "linear"),
                                                               "llama.rope.scaling.factor": ("float32", 2.0)})
    model = kvjax.load_model(path)
    assert model.cfg.rope.rope_type == "linear" and model.cfg.rope.factor == 2.0
    tokens = random_tokens(3, (1, 40), VOCAB)
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), logits_of(linear, tokens),
                               atol=1e-4, rtol=0)

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    llama3 = llama(rope_scaling=scaling)
    freqs = llamacpp_rope_freqs(64, 10000.0, scaling)
    path = write_gguf(tmp_path / "llama3.gguf", llama3, extra_tensors={"rope_freqs.weight": freqs})
    model = kvjax.load_model(path)
    assert model.cfg.rope.rope_type == "longrope"
    tokens = random_tokens(4, (1, 200), VOCAB)
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), logits_of(llama3, tokens),
                               atol=1e-4, rtol=0)


def llamacpp_rope_freqs(dim, base, scaling):
    """llama.cpp's convert_hf_to_gguf: Llama 3 RoPE as per-frequency divisors (`rope_freqs.weight`)."""
    import math

    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_config_from_metadata(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", llama(tie_word_embeddings=True), qtype=Q.Q8_0)
    cfg = kvjax.load_model(path).cfg
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 2, 256, 512)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 64, VOCAB)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope.theta) == (256, 1e-5, 10000.0)
    assert cfg.tie_word_embeddings and (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    untied = kvjax.load_model(write_gguf(tmp_path / "untied.gguf", llama(), tokenizer=False))
    assert not untied.cfg.tie_word_embeddings and untied.tokenizer is None


def test_tokenizer_and_chat_template(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", llama(), qtype=Q.Q4_0)
    tokenizer = kvjax.load_model(path).tokenizer
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    text = "the cat sat on a mat in the sun, at once. Then: <|im_end|> tea?"
    ids = tokenizer(text)["input_ids"]
    assert ids == reference(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("Ġthe") in ids and 2 in ids  # merges applied, special kept whole
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "hi there"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert chat == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_the_reader_reads_what_the_gguf_package_reads(tmp_path):
    """`open_gguf` parses through a plain view of the memory map (faster): every field and tensor as the
    package's own reader has them."""
    from kvjax.models import gguf as kvjax_gguf

    path = write_gguf(tmp_path / "model.gguf", llama(), qtype=Q.Q4_0)
    ours, theirs = kvjax_gguf.open_gguf(path), gguf.GGUFReader(path)
    assert kvjax_gguf.metadata(ours) == kvjax_gguf.metadata(theirs) and len(ours.fields) == len(theirs.fields)
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    assert type(ours.tensors[0].data) is np.ndarray  # not an np.memmap slice


def test_the_converted_tokenizer_is_kept_beside_the_file(tmp_path, monkeypatch):
    """The second load reads the tokenizer kept in `<file>.tokenizer/` (no GGUF conversion), the same in every
    answer; a file changed since is converted again."""
    from kvjax.models import gguf

    path = write_gguf(tmp_path / "model.gguf", llama(), qtype=Q.Q4_0)
    first = gguf.load_gguf_tokenizer(path)
    kept = str(path) + gguf.TOKENIZER_SUFFIX
    assert os.path.isfile(os.path.join(kept, "tokenizer.json"))
    converted = []
    import transformers

    original = transformers.PreTrainedTokenizerFast.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        converted.append("gguf_file" in kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", classmethod(counting))
    again = gguf.load_gguf_tokenizer(path)
    assert converted == [False], "the kept tokenizer was not used"
    text = "the cat sat on a mat in the sun, at once. Then: <|im_end|> tea?"
    assert again(text)["input_ids"] == first(text)["input_ids"] and again.eos_token_id == first.eos_token_id
    messages = [{"role": "user", "content": "hi there"}]
    assert (again.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == first.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    os.utime(path, ns=(0, 0))  # the file changed since: converted again, and kept anew
    gguf.load_gguf_tokenizer(path)
    assert converted == [False, True]
    gguf.load_gguf_tokenizer(path)
    assert converted == [False, True, False]


def test_unsupported_quant_type_names_tensor_and_type(tmp_path, monkeypatch):
    """Runs on every gguf version: Q8_K is taken away from the gguf package first (0.19 lacks it anyway), so
    the package raises NotImplementedError and kvjax must turn that into an error naming tensor and type."""
    from gguf import quants

    qtype = Q.Q8_K
    monkeypatch.delitem(quants._type_traits, qtype, raising=False)
    monkeypatch.delattr(quants, qtype.name, raising=False)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.zeros((512, 256 // block_elems * block_bytes), np.uint8)  # ffn_up: [512, 256]
    path = write_gguf(tmp_path / "model.gguf", llama(), tokenizer=False,
                      replace={"blk.1.ffn_up.weight": (blocks, qtype)})
    with pytest.raises(kvjax.CheckpointError, match=rf"blk\.1\.ffn_up\.weight is stored as {qtype.name}"):
        kvjax.load_model(path)


def test_unsupported_architecture_and_unknown_tensor(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported; kvjax reads: gemma3, llama, qwen2"):
        kvjax.load_model(tmp_path / "gpt2.gguf")
    path = write_gguf(tmp_path / "odd.gguf", llama(), tokenizer=False,
                      extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4)})
    with pytest.raises(kvjax.CheckpointError, match="cannot map to a llama model: blk.0.attn_sinks.weight"):
        kvjax.load_model(path)


def test_truncated_gguf_raises_checkpoint_error(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", llama(), qtype=Q.Q8_0)
    for keep in (os.path.getsize(path) - 1000, 4000, 10):
        cut = tmp_path / f"cut{keep}.gguf"
        with open(path, "rb") as f:
            cut.write_bytes(f.read(keep))
        with pytest.raises(kvjax.CheckpointError, match=f"cut{keep}.gguf"):
            kvjax.load_model(cut)


def test_truncated_safetensors_raises_checkpoint_error(hf_models, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(hf_models("llama_gqa_llama3")[1], target)
    file = target / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(kvjax.CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        kvjax.load_model(target)
    file.write_bytes(b"not a safetensors file")
    with pytest.raises(kvjax.CheckpointError, match="model.safetensors"):
        kvjax.load_model(target)
    json.loads((target / "config.json").read_text())  # the directory is otherwise intact


def test_cli_generate_chat_on_a_gguf_file(tmp_path):
    import subprocess
    import sys

    path = write_gguf(tmp_path / "model.gguf", llama(), qtype=Q.Q8_0)
    env = {**os.environ, "KVJAX_COMPILATION_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "kvjax.cli", "generate", "--model", path, "--chat", "--prompt", "hi there",
               "--max-new-tokens", "3", "--json"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    chat = tokenizer("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert out["prompt_tokens"] == len(chat) and len(out["token_ids"]) <= 3
