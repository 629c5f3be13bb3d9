"""A 4-bit copy of the keys for scoring pages (the quantised "label cache" of Double Sparsity, Yang et al.,
2024, here over every channel): Quest's metadata bytes spent on per-slot codes instead of per-page bounds.

Notes: docs/modules.md (`kvjax/policies/key_int4.py`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels.sketch_scores import pack_int4
from kvjax.policies.base import register_policy
from kvjax.policies.key_sketch import SketchSelect

LEVELS = 7.0  # |code| <= 7 for keys within the scale's range; -8 only for clipped negatives


@register_policy("key_int4")
@dataclasses.dataclass(frozen=True)
class KeyInt4(SketchSelect):
    codes_kind: ClassVar[str] = "int4"
    clip_quantile: float = 0.999

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if not 0.0 < self.clip_quantile <= 1.0:
            raise ValueError(f"key_int4: clip_quantile must be in (0, 1], got {self.clip_quantile}")

    def fit(self, keys: jax.Array, valid: jax.Array) -> jax.Array:
        """Scales `f32[B, H, D]`: the `clip_quantile` quantile of |k_d| over each head's valid slots, / 7."""
        magnitude = jnp.where(valid[..., None], jnp.abs(keys), jnp.nan)
        top = jnp.nanquantile(magnitude, self.clip_quantile, axis=2)
        return jnp.maximum(jnp.nan_to_num(top, nan=1.0), 1e-6) / LEVELS

    def codes(self, scale: jax.Array, keys: jax.Array) -> jax.Array:
        return pack_int4(jnp.clip(jnp.round(keys / scale[:, :, None, :]), -8, 7))

    def query(self, scale: jax.Array, q: jax.Array) -> jax.Array:
        return q.astype(jnp.float32) * scale[:, :, None, :]
