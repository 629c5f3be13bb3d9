"""GGUF checkpoints (llama.cpp's format) as Hugging Face ones: dequantised tensors under HF names, an
HF-style config dict from the metadata, and the tokenizer (with its chat template) the metadata describes."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvjax.models.convert import CheckpointError

# llama.cpp architecture -> HF model_type; "llama" files whose general.name says Mistral become "mistral".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
# architectures whose converter permuted the rows of Q and K for llama.cpp's interleaved RoPE
_PERMUTED_QK = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma-3's four norms and QK-norm; its ffn_norm is the MLP's own input norm, not Llama's post-attention one
_ARCH_BLOCK_NAMES = {"gemma3": {
    **_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}}
# architectures whose converter stored Gemma's norm weights w as 1 + w (llama.cpp's RMSNorm multiplies by the weight)
_NORMS_PLUS_ONE = ("gemma3",)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 files: per-frequency divisors of the RoPE frequencies


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (names as llama.cpp's architecture
    `arch` uses them); None for a name with no HF twin."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"
    return None


@functools.cache
def _reader_class():
    """`gguf.GGUFReader` reading the file through a plain ndarray view of its memory map: the reader parses
    the metadata one small slice at a time (a vocabulary of 49K strings is ~250K slices), and a slice of an
    `np.memmap` costs a subclass's bookkeeping each; a plain view of the same mapping parses SmolLM2's
    metadata about 3x faster, same fields and tensors (`tests/test_gguf.py`)."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap here
            self._plain = mapped.view(np.ndarray)  # the mapping stays open through the view's base

    return PlainViewReader


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs interleaved) -> (first halves, second halves).

    `w` is `[n_heads * head_dim, ...]` (a weight `[out, in]` or a bias `[out]`).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over the file; `CheckpointError` naming it when it is unreadable or truncated."""
    path = os.fspath(path)
    try:
        reader = _reader_class()(path)
    except (ValueError, OSError, IndexError, KeyError, EOFError) as error:
        raise CheckpointError(f"cannot read GGUF file {path!r} (not GGUF, or truncated): {error}") from error
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise CheckpointError(
                f"GGUF file {path!r} is truncated: tensor {tensor.name} ends at byte {end}, the file has {size}"
            )
    return reader


def metadata(reader) -> dict[str, Any]:
    """Metadata as plain Python values (`general.architecture`, `llama.block_count`, ...)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def dequantize(tensor, rows_per_call: int = 4096) -> np.ndarray:
    """One GGUF tensor as `float32`, in numpy (row-major) order. Raises `CheckpointError` naming the tensor
    and its quant type when the `gguf` package cannot dequantise that type.

    Calls the quant class's vectorised `dequantize_rows` on blocks of rows (`gguf.quants.dequantize` works
    16 rows at a time, which costs seconds on a 100M-parameter model), falling back to it for other types.
    """
    from gguf import quants

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    kind = getattr(quants, tensor.tensor_type.name, None)
    data = tensor.data
    try:
        if isinstance(kind, type) and hasattr(kind, "dequantize_rows") and data.ndim >= 1 and data.size:
            kind.init_grid()
            rows = data.reshape(-1, data.shape[-1])
            values = np.concatenate(
                [kind.dequantize_rows(rows[i : i + rows_per_call]) for i in range(0, rows.shape[0], rows_per_call)]
            )
        else:
            values = quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError as error:
        raise CheckpointError(
            f"GGUF tensor {tensor.name} is stored as {tensor.tensor_type.name}, which kvjax cannot dequantise "
            f"(gguf package: {error})"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if isinstance(value, list):  # per-layer counts in some files
        if len(set(value)) != 1:
            raise CheckpointError(f"GGUF metadata {key} varies by layer ({value}); kvjax needs one value")
        value = value[0]
    return value


def _f32(value: float) -> float:
    """The shortest decimal of a float32 (metadata stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_config(meta: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """An HF `config.json`-like dict from GGUF metadata and the tensors' (numpy-order) shapes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; kvjax reads: {', '.join(sorted(ARCHITECTURES))}"
        )
    model_type = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"  # as transformers does; llama.cpp files Mistral under "llama"

    def key(name, default=None, required=True):
        value = _scalar(meta, f"{arch}.{name}", default)
        if value is None and required:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{name}")
        return value

    if "token_embd.weight" not in tensor_shapes:
        raise CheckpointError("GGUF file has no token_embd.weight")
    vocab_size, hidden = tensor_shapes["token_embd.weight"]
    heads = int(key("attention.head_count"))
    head_dim = key("attention.key_length", required=False)
    if head_dim is None and arch == "llama":
        head_dim = key("rope.dimension_count", required=False)
    rope = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(key("rope.scaling.factor")))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=_f32(key("rope.scaling.factor")),
                    original_max_position_embeddings=int(key("rope.scaling.original_context_length")))
    elif scaling != "none":
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported (none, linear, yarn)")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    extra = _gemma3_config(meta, key, rope, heads, head_dim, hidden) if arch == "gemma3" else {}
    return extra | {
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": int(key("embedding_length", hidden)),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": None if head_dim is None else int(head_dim),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": extra.get("rope_parameters", rope),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }


def _gemma3_config(meta: dict, key, rope: dict, heads: int, head_dim, hidden: int) -> dict[str, Any]:
    """Gemma-3's config fields as llama.cpp reads them: every sixth layer global unless
    `gemma3.attention.sliding_window_pattern` says otherwise (a period, or a flag per layer, true = sliding),
    local RoPE base 10000 unless `gemma3.rope.freq_base_swa`, query scale from head_dim (27B: hidden / heads)."""
    layers = int(key("block_count"))
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"GGUF gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
                                  f"{layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    local = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base_swa", 10000.0))}
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(key("attention.sliding_window")),
        "rope_parameters": {"full_attention": rope, "sliding_attention": local},
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,  # llama.cpp's rule (62: 27B)
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _rope_freqs_parameters(config: dict, factors: np.ndarray) -> dict:
    """Llama 3's `rope_freqs` (frequency divisors) as LongRoPE factors with no attention scaling: exact."""
    factors = [float(f) for f in np.asarray(factors, np.float32).reshape(-1)]
    return {"rope_type": "longrope", "rope_theta": config["rope_parameters"]["rope_theta"], "short_factor": factors,
            "long_factor": factors, "attention_factor": 1.0,
            "original_max_position_embeddings": config["max_position_embeddings"]}


def read_gguf(path: str | os.PathLike, threads: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a GGUF checkpoint: (HF config dict, HF-named `float32` numpy tensors, Q/K rows un-permuted).

    Dequantises every type the `gguf` package supports (F32, F16, BF16, Q4_0 ... Q8_0, K-quants, ...), on
    `threads` threads. Raises `CheckpointError` for unreadable files, unknown tensors or unsupported quant
    types, and `ValueError` for unsupported architectures.
    """
    config, tensors, _ = _read(path, threads)
    return config, tensors


def _read(path, threads=None):
    path = os.fspath(path)
    reader = open_gguf(path)
    meta = metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = hf_config(meta, shapes)
    arch = meta["general.architecture"]
    unknown = [t.name for t in reader.tensors if t.name != _ROPE_FREQS and hf_tensor_name(t.name, arch) is None]
    if unknown:
        raise CheckpointError(f"GGUF file {path!r} has tensors kvjax cannot map to a {config['model_type']} "
                              f"model: {', '.join(unknown)}")
    permute = arch in _PERMUTED_QK
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def convert(tensor):
        values = dequantize(tensor)
        match = _BLOCK_RE.fullmatch(tensor.name)
        if permute and match and match.group(2) in heads:
            values = unpermute_rows(values, heads[match.group(2)])
        if arch in _NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        return tensor.name, values

    with ThreadPoolExecutor(threads or min(4, os.cpu_count() or 1)) as pool:
        converted = dict(pool.map(convert, reader.tensors))
    if _ROPE_FREQS in converted:
        config["rope_parameters"] = _rope_freqs_parameters(config, converted.pop(_ROPE_FREQS))
    return config, {hf_tensor_name(name, arch): values for name, values in converted.items()}, meta


TOKENIZER_SUFFIX = ".tokenizer"  # `<file>.gguf.tokenizer/`: the file's tokenizer, converted once


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer the file's metadata describes (transformers' GGUF conversion, chat template included).

    The conversion imports torch and parses the file's metadata a second time (seconds, at every start of a
    real model), so its result is kept beside the file as a fast tokenizer's files (`<file>.tokenizer/`,
    written when the folder is writable) and read from there while the file's size and modification time
    and transformers' version are those it was converted from."""
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(os.fspath(path))
    kept, source = path + TOKENIZER_SUFFIX, _tokenizer_source(path)
    try:
        with open(os.path.join(kept, "kvjax-source.json")) as f:
            if json.load(f) == source:
                return PreTrainedTokenizerFast.from_pretrained(kept)
    except (OSError, ValueError):
        pass  # none kept, or kept from another file or version: convert again
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _keep_tokenizer(tokenizer, kept, source)
    return tokenizer


def _tokenizer_source(path: str) -> dict:
    import transformers

    info = os.stat(path)
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "transformers": transformers.__version__}


def _keep_tokenizer(tokenizer, kept: str, source: dict) -> None:
    """Write the converted tokenizer to `kept` whole or not at all (a temporary folder renamed into place);
    a folder that cannot be written leaves the next start to convert again."""
    temporary = f"{kept}.{os.getpid()}.tmp"
    try:
        tokenizer.save_pretrained(temporary)
        with open(os.path.join(temporary, "kvjax-source.json"), "w") as f:
            json.dump(source, f)
        shutil.rmtree(kept, ignore_errors=True)
        os.replace(temporary, kept)
    except OSError:
        shutil.rmtree(temporary, ignore_errors=True)


def load_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray], Any]:
    """`read_gguf` plus the tokenizer: (HF config dict, HF-named float32 tensors, tokenizer or None)."""
    config, tensors, meta = _read(path)
    tokenizer = load_gguf_tokenizer(path) if "tokenizer.ggml.model" in meta else None
    return config, tensors, tokenizer
