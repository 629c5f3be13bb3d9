"""Rotary position embeddings: a registry keyed by HF's `rope_type` (default, linear, llama3, yarn, longrope).

Notes: docs/modules.md (`kvjax/models/rope.py`)."""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig, RopeConfig

RopeInit = Callable[[RopeConfig, int, int, bool], tuple[np.ndarray, float]]
ROPE_REGISTRY: dict[str, RopeInit] = {}


def register_rope(name: str):
    def wrap(fn: RopeInit) -> RopeInit:
        ROPE_REGISTRY[name] = fn
        return fn

    return wrap


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    # transformers computes this in float32: match it bit for bit.
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


@register_rope("default")
def _default(rope: RopeConfig, dim: int, max_pos: int, use_long: bool):
    return _base_inv_freq(rope.theta, dim), 1.0


@register_rope("linear")
def _linear(rope: RopeConfig, dim: int, max_pos: int, use_long: bool):
    return (_base_inv_freq(rope.theta, dim) / np.float32(rope.factor)).astype(np.float32), 1.0


@register_rope("llama3")
def _llama3(rope: RopeConfig, dim: int, max_pos: int, use_long: bool):
    inv_freq = _base_inv_freq(rope.theta, dim)
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


@register_rope("yarn")
def _yarn(rope: RopeConfig, dim: int, max_pos: int, use_long: bool):
    original = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_pos / original

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (np.float32(rope.theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(
        np.float32
    )
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


@register_rope("longrope")
def _longrope(rope: RopeConfig, dim: int, max_pos: int, use_long: bool):
    original = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_pos / original
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rope.long_factor if use_long else rope.short_factor, dtype=np.float32)
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (1.0 / (ext * np.float32(rope.theta) ** shape)).astype(np.float32), float(attention_factor)


def uses_long_factors(cfg: ModelConfig, seq_len: int) -> bool:
    """Whether LongRoPE's long factors apply to a sequence of `seq_len` positions (transformers' rule).

    transformers re-decides this at every forward call from the largest position id; a cached generation
    decides once, from the length known at prefill (prompt plus the declared number of new tokens).
    """
    return cfg.rope.rope_type == "longrope" and seq_len > cfg.rope.original_max_position_embeddings


def rope_frequencies(cfg: ModelConfig, use_long: bool = False) -> tuple[np.ndarray, float | np.ndarray]:
    """Inverse frequencies `f32[rotary_dim // 2]` and the attention factor applied to cos and sin; where layers
    differ (`cfg.per_layer_rope`: Gemma-3's local and global bases) a row per layer, `f32[L, rotary_dim // 2]`
    and `f32[L]`, which `layer_rope` picks from."""
    if not cfg.per_layer_rope:
        return _frequencies(cfg, cfg.rope, use_long)
    rows = [_frequencies(cfg, cfg.local_rope if local else cfg.rope, use_long) for local in cfg.local_rope_layers]
    return np.stack([f for f, _ in rows]), np.asarray([a for _, a in rows], np.float32)


def _frequencies(cfg: ModelConfig, rope: RopeConfig, use_long: bool) -> tuple[np.ndarray, float]:
    init = ROPE_REGISTRY.get(rope.rope_type)
    if init is None:
        raise ValueError(f"unsupported rope_type {rope.rope_type!r}; supported: {', '.join(sorted(ROPE_REGISTRY))}")
    return init(rope, cfg.rotary_dim, cfg.max_position_embeddings, use_long)


def layer_rope(rope: tuple, layer) -> tuple:
    """Layer `layer`'s `(inv_freq f32[R/2], attention_factor)` from what `rope_frequencies` gave: the row of a
    per-layer table (`layer` a Python int or a traced int32 scalar), or the one pair every layer shares."""
    inv_freq, factor = rope
    if np.ndim(inv_freq) == 1:
        return rope
    if layer is None:
        raise ValueError("this model's layers differ in RoPE (a per-layer table): give the layer index")
    if isinstance(layer, (int, np.integer)):
        return inv_freq[layer], float(factor[layer])
    return jnp.asarray(inv_freq)[layer], jnp.asarray(factor)[layer]


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float) -> jnp.ndarray:
    """Rotate `x [B, T, H, D]` at `positions int32[B, T]` (rotate-half convention, first `rotary_dim` dims)."""
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, R/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * attention_factor).astype(x.dtype)[:, :, None, :]  # [B, T, 1, R]
    sin = (jnp.sin(emb) * attention_factor).astype(x.dtype)[:, :, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out
