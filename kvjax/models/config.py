"""Model configuration: one frozen, hashable dataclass read from a Hugging Face `config.json`.

Reads both spellings of the RoPE settings: `rope_scaling` + `rope_theta` (transformers 4.x) and
`rope_parameters` (what transformers 5's `save_pretrained` writes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3", "gemma3_text")
_GEMMA = ("gemma3_text",)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE settings, normalised from either HF spelling. Tuples keep the dataclass hashable."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model. Static under `jit` (hashable)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False  # Phi-3's qkv_proj
    fused_gate_up: bool = False  # Phi-3's gate_up_proj
    sliding_window: int | None = None  # as the checkpoint declares it: every layer (Mistral, Phi-3)
    # Per-layer windows (0 = full attention) where layers differ (Gemma-2 alternates); None: every layer
    # uses `sliding_window`. `with_windows` sets it.
    layer_windows: tuple[int, ...] | None = None
    rope: RopeConfig = RopeConfig()
    # RoPE of the local layers where it differs from `rope` (Gemma-3: base 10000 local, 1e6 global), and which
    # layers are local: the checkpoint's sliding-window layers, kept whatever `with_windows` sets later
    local_rope: RopeConfig | None = None
    local_rope_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma's pieces (Llama's where unset)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's norms use 1 + weight
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Gemma-3)
    sandwich_norms: bool = False  # attention and MLP outputs normed too, the MLP's input by its own norm
    embedding_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # q.k scale where not head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma-2)

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens (a query at p sees keys p - w + 1 .. p, HF's Mistral mask),
        0 for full attention."""
        if self.layer_windows is not None:
            return self.layer_windows
        return (self.sliding_window or 0,) * self.num_layers

    def with_windows(self, windows) -> "ModelConfig":
        """This config with per-layer windows `windows` (a sequence of num_layers ints or None, None / 0 =
        full attention), e.g. `kvjax.serving.alternating_windows` for Gemma-2's pattern."""
        windows = list(windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"windows has {len(windows)} entries but the model has {self.num_layers} layers")
        out = []
        for layer, w in enumerate(windows):
            w = 0 if w is None else w
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
                raise ValueError(f"windows[{layer}] must be a non-negative int or None (full attention), got {w!r}")
            out.append(int(w))
        return dataclasses.replace(self, layer_windows=tuple(out))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def per_layer_rope(self) -> bool:
        """Whether layers differ in RoPE (`local_rope` on `local_rope_layers`): `rope_frequencies` then gives a
        table with a row per layer."""
        return self.local_rope is not None and self.local_rope != self.rope and any(self.local_rope_layers)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from the parsed `config.json` of a Llama, Mistral, Qwen2, Phi-3 or Gemma-3 (text) checkpoint."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json of a {model_type} model lacks the required field {key!r}")
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        is_phi3 = model_type == "phi3"
        sliding_window = hf.get("sliding_window") if model_type in ("mistral", "phi3", "qwen2", *_GEMMA) else None
        if model_type == "qwen2" and not hf.get("use_sliding_window", False):
            sliding_window = None
        layer_windows = _layer_windows(hf, model_type, sliding_window)
        gemma = _gemma_fields(hf, head_dim) if model_type in _GEMMA else {}
        if gemma:
            gemma["local_rope_layers"] = tuple(bool(w) for w in layer_windows or ())
        rope = gemma.pop("rope") if gemma else _rope_config(hf, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in _GEMMA)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            fused_qkv=is_phi3,
            fused_gate_up=is_phi3,
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            rope=rope,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **gemma,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in {os.fspath(path)!r}")
        with open(config_path) as f:
            return cls.from_hf_dict(json.load(f))


def _layer_windows(hf: dict[str, Any], model_type: str, sliding_window: int | None) -> tuple[int, ...] | None:
    """Per-layer windows where the config says which layers slide: `layer_types` (transformers 5), or
    Qwen2's `max_window_layers` (the layers from that index on slide). None: `sliding_window` on every
    layer (Mistral, Phi-3) or none."""
    if not sliding_window:
        return None
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
    if types is None and model_type in _GEMMA and pattern:  # transformers 4.x: every pattern-th layer is global
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if types is None and model_type == "qwen2":
        first = hf.get("max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None:
        return None
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types holds {unknown}; kvjax knows sliding_attention and full_attention")
    return tuple(sliding_window if t == "sliding_attention" else 0 for t in types)


def _gemma_fields(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma-3's fields of `ModelConfig`: RoPE per layer type (`rope_parameters` keyed by
    full_attention / sliding_attention in transformers 5; `rope_theta`, `rope_scaling` and
    `rope_local_base_freq` in 4.x), its norms, scales and soft-cap."""
    params = hf.get("rope_parameters") or {}
    length = {"max_position_embeddings": hf.get("max_position_embeddings")}
    if "full_attention" in params:
        full = {"rope_parameters": params["full_attention"], **length}
        local = {"rope_parameters": params.get("sliding_attention") or params["full_attention"], **length}
    else:
        full = {k: hf[k] for k in ("rope_parameters", "rope_scaling", "rope_theta") if k in hf} | length
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0), **length}
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping={hf['attn_logit_softcapping']} in config.json: kvjax's attention "
                         "does not soft-cap its logits")
    hidden, scalar = hf["hidden_size"], hf.get("query_pre_attn_scalar") or head_dim
    cap = hf.get("final_logit_softcapping")
    return dict(rope=_rope_config(full, head_dim), local_rope=_rope_config(local, head_dim), norm_offset=1.0,
                qk_norm=True, sandwich_norms=True, embedding_scale=float(hidden) ** 0.5,
                query_scale=float(scalar) ** -0.5, final_logit_softcap=None if cap is None else float(cap))


def _rope_config(hf: dict[str, Any], head_dim: int) -> RopeConfig:
    """Normalise `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4.x)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # early Phi-3 configs
        rope_type = "longrope"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0
    original = params.get("original_max_position_embeddings")
    if rope_type == "longrope" and hf.get("original_max_position_embeddings") is not None:
        # Phi-3 keeps the pretraining length outside the rope dict, and transformers gives it priority.
        original = hf["original_max_position_embeddings"]
    if rope_type in ("llama3", "yarn", "longrope") and original is None:
        original = hf.get("max_position_embeddings")

    def tup(x):
        return None if x is None else tuple(float(v) for v in x)

    rope = RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        partial_rotary_factor=float(partial),
        factor=None if params.get("factor") is None else float(params["factor"]),
        original_max_position_embeddings=None if original is None else int(original),
        attention_factor=params.get("attention_factor"),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tup(params.get("short_factor")),
        long_factor=tup(params.get("long_factor")),
    )
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    for name in ("short_factor", "long_factor"):
        factors = getattr(rope, name)
        if factors is not None and len(factors) != rotary_dim // 2:
            raise ValueError(f"rope {name} has {len(factors)} entries; expected rotary_dim/2 = {rotary_dim // 2}")
    return rope
