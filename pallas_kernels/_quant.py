"""int8 KV pages: symmetric quantisation with one float32 scale per stored token (per page slot).

A page holds one kv head, so a slot's scale covers that token's `head_dim` values of one head. Per-token
scales suit an append-only cache: a token is quantised once, when written, and never again; a per-page
scale would have to grow (and requantise the page) whenever a later token exceeds the range. The cost is 4
bytes of scale per `head_dim` bytes of int8 (a 64-wide head stores 68 bytes for K instead of 256 in
float32). Every reader multiplies by the scale on the fly: the kernels and the CPU path see int8 pages
plus `[N, ps]` scales, and the pure-jnp oracle dequantises first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127.0
_TINY = 1e-30  # scale of an all-zero token (its values quantise to 0 whatever the scale)


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [..., D]` -> (int8[..., D], scale f32[...]) with x ~= q * scale[..., None], |q| <= 127 (round to
    nearest: the error per value is at most scale / 2)."""
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / INT8_MAX, _TINY)
    q = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize(pages: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Pages `[..., ps, D]` as float32 values: int8 pages times their `scale [..., ps]`, float pages as
    they are (`scale` None)."""
    values = pages.astype(jnp.float32)
    return values if scale is None else values * scale[..., None]


def is_quantized(pages: jax.Array) -> bool:
    return jnp.dtype(pages.dtype) == jnp.dtype(jnp.int8)
