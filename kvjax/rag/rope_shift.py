"""Moving cached keys to new positions: rotate pre-RoPE keys, or re-rotate post-RoPE keys by a delta.

Notes: docs/modules.md (`kvjax/rag/rope_shift.py`)."""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.models.config import ModelConfig
from kvjax.models.rope import apply_rope, rope_frequencies


class RopeShiftError(ValueError):
    """A post-RoPE key cannot be moved by a position delta (LongRoPE across its short/long switch)."""


def rotate_keys(k_pre: jnp.ndarray, positions: jnp.ndarray, cfg: ModelConfig, long_rope: bool = False) -> jnp.ndarray:
    """RoPE for pre-RoPE keys `k_pre [..., T, H, D]` at `positions int32[..., T]` (leading axes broadcast
    like a batch), exactly as the model's forward rotates them. Returns the same shape and dtype."""
    inv_freq, factor = _frequencies(cfg, long_rope)
    return _apply(k_pre, positions, inv_freq, factor)


def shift_keys(
    k: jnp.ndarray, delta: jnp.ndarray, cfg: ModelConfig, long_rope: bool = False, target_long_rope: bool | None = None
) -> jnp.ndarray:
    """Re-rotate post-RoPE keys `k [..., T, H, D]` (rotated with the `long_rope` factor set) by
    `delta int32[..., T]` positions, in float32, without applying the attention factor again.

    `target_long_rope` is the factor set the keys will be read with (default: the same). Raises
    `RopeShiftError` when it differs from `long_rope` under LongRoPE, where no delta rotation exists.
    """
    check_shiftable(cfg, long_rope, long_rope if target_long_rope is None else target_long_rope)
    inv_freq, _ = _frequencies(cfg, long_rope)
    return _apply(k, delta, inv_freq, 1.0)


def check_shiftable(cfg: ModelConfig, stored_long_rope: bool, target_long_rope: bool) -> None:
    """Raise `RopeShiftError` if keys rotated with one LongRoPE factor set are to be read with the other."""
    if cfg.rope.rope_type == "longrope" and stored_long_rope != target_long_rope:
        have, want = ("long", "short") if stored_long_rope else ("short", "long")
        where = "passes" if target_long_rope else "stays within"
        raise RopeShiftError(
            f"cannot re-rotate post-RoPE keys across LongRoPE's factor switch: they were rotated with the {have} "
            f"factors, and the assembled context, whose length {where} original_max_position_embeddings="
            f"{cfg.rope.original_max_position_embeddings}, needs the {want} ones; store chunks pre-RoPE "
            "(ChunkStore(form='pre_rope')) or encode them with the final length's factor set (long_rope=...)"
        )


def _frequencies(cfg: ModelConfig, long_rope: bool):
    """The one RoPE every layer shares; `RopeShiftError` where layers differ (Gemma-3's local and global bases)."""
    if cfg.per_layer_rope:
        raise RopeShiftError("this model's layers differ in RoPE (local and global bases, as Gemma-3's): moving "
                             "cached keys needs one RoPE for every layer")
    return rope_frequencies(cfg, long_rope)


def _apply(x, positions, inv_freq, factor):
    """`apply_rope` over any leading axes, computed in float32, cast back to x's dtype."""
    lead = x.shape[:-3]
    T, H, D = x.shape[-3:]
    flat = x.reshape((-1, T, H, D)).astype(jnp.float32)
    pos = jnp.broadcast_to(positions, lead + (T,)).reshape(-1, T)
    return apply_rope(flat, pos, inv_freq, factor).reshape(x.shape).astype(x.dtype)
