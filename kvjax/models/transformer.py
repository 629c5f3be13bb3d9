"""A Flax Linen decoder (Llama / Mistral / Qwen2 / Phi-3) whose attention is supplied by the caller.

The module owns projections, norms, RoPE and the MLP. What happens between "q, k, v are ready" and "the
attention output is ready" (dense causal attention, or writing to the paged KV state and reading it back,
with a policy) is an `attend` function passed in, so one forward serves the dense path, chunked prefill,
decode and label generation. The KV state threads through as an ordinary argument and return value.

Parameter names mirror Hugging Face's (`layers_3/self_attn/q_proj/kernel`), so checkpoint conversion is a
name map; Dense kernels are the transposes of HF's `weight`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.rope import apply_rope


class AttentionInputs(NamedTuple):
    """What a layer hands to `attend`. Shapes: q `[B, T, Hq, D]`, k and v `[B, T, KVH, D]`.

    `q`/`k` are after RoPE; `q_pre`/`k_pre` before (Locret's retaining heads read those).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_pre: jax.Array
    k_pre: jax.Array
    positions: jax.Array  # int32[B, T]


# attend(layer_index, inputs, carry) -> (attention output [B, T, Hq, D], carry)
AttendFn = Callable[[int, AttentionInputs, Any], tuple[jax.Array, Any]]

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * normed.astype(x.dtype)


def _dense(features: int, use_bias: bool, name: str, dtype) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, name=name, dtype=dtype, param_dtype=dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    layer_index: int
    dtype: Any

    @nn.compact
    def __call__(self, x, positions, rope: tuple[np.ndarray, float], attend: AttendFn, carry):
        cfg = self.cfg
        B, T, _ = x.shape
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if cfg.fused_qkv:
            qkv = _dense(q_size + 2 * kv_size, cfg.attention_bias, "qkv_proj", self.dtype)(x)
            q, k, v = qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
        else:
            q = _dense(q_size, cfg.attention_bias, "q_proj", self.dtype)(x)
            k = _dense(kv_size, cfg.attention_bias, "k_proj", self.dtype)(x)
            v = _dense(kv_size, cfg.attention_bias, "v_proj", self.dtype)(x)
        q_pre = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k_pre = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        inv_freq, attention_factor = rope
        q = apply_rope(q_pre, positions, inv_freq, attention_factor)
        k = apply_rope(k_pre, positions, inv_freq, attention_factor)
        out, carry = attend(self.layer_index, AttentionInputs(q, k, v, q_pre, k_pre, positions), carry)
        out = out.reshape(B, T, q_size).astype(self.dtype)
        return _dense(cfg.hidden_size, cfg.o_proj_bias, "o_proj", self.dtype)(out), carry


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        act = _ACTIVATIONS.get(cfg.hidden_act)
        if act is None:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")
        if cfg.fused_gate_up:
            gate_up = _dense(2 * cfg.intermediate_size, cfg.mlp_bias, "gate_up_proj", self.dtype)(x)
            gate, up = gate_up[..., : cfg.intermediate_size], gate_up[..., cfg.intermediate_size :]
        else:
            gate = _dense(cfg.intermediate_size, cfg.mlp_bias, "gate_proj", self.dtype)(x)
            up = _dense(cfg.intermediate_size, cfg.mlp_bias, "up_proj", self.dtype)(x)
        return _dense(cfg.hidden_size, cfg.mlp_bias, "down_proj", self.dtype)(act(gate) * up)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer_index: int
    dtype: Any

    @nn.compact
    def __call__(self, x, positions, rope, attend: AttendFn, carry):
        h = RMSNorm(self.cfg.rms_norm_eps, self.dtype, name="input_layernorm")(x)
        h, carry = Attention(self.cfg, self.layer_index, self.dtype, name="self_attn")(h, positions, rope, attend, carry)
        x = x + h
        h = RMSNorm(self.cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
        return x + MLP(self.cfg, self.dtype, name="mlp")(h), carry


class CausalLM(nn.Module):
    """Decoder-only LM. `__call__(tokens [B, T], positions [B, T], rope, attend, carry)`.

    Returns the final normed hidden states `[B, T, H]` and the carry; `logits(h)` maps hidden states to
    vocabulary logits (kept apart so prefill computes logits only where they are needed).
    """

    cfg: ModelConfig
    dtype: Any = jnp.float32

    def setup(self):
        cfg = self.cfg
        # Attribute names become parameter names: embed_tokens, layers_0 ... layers_{L-1}, norm, lm_head.
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = [DecoderLayer(cfg, i, self.dtype) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)

    def __call__(self, tokens, positions, rope, attend: AttendFn, carry):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, carry = layer(x, positions, rope, attend, carry)
        return self.norm(x), carry

    def hidden_and_logits(self, tokens, positions, rope, attend: AttendFn, carry):
        """Hidden states, f32 logits `[B, T, V]` and the carry (also what `init` traces)."""
        hidden, carry = self(tokens, positions, rope, attend, carry)
        return self.logits(hidden), carry

    def logits(self, hidden):
        """`[..., H] -> f32[..., V]`."""
        if self.cfg.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)
