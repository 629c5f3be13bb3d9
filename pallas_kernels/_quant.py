"""int8 KV pages: symmetric quantisation with one float32 scale per stored token (per page slot).

Notes: docs/modules.md (`pallas_kernels/_quant.py`)."""

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


# bfloat16 pages may be held as their uint16 bit patterns: kvjax's layout for them on CPU, where XLA has no
# bfloat16 scatter and converted the whole pool to float32 and back around every write (kvjax.cache.state). Every
# reader takes them: the XLA path bitcasts each gathered block, the other backends the pool up front.
BFLOAT16_BITS = jnp.uint16


def is_bfloat16_bits(pages) -> bool:
    return jnp.dtype(pages.dtype) == jnp.dtype(BFLOAT16_BITS)


def page_values(pages: jax.Array) -> jax.Array:
    """Pages as values: bfloat16 pages held as uint16 bit patterns bitcast back, other pages as they are."""
    return jax.lax.bitcast_convert_type(pages, jnp.bfloat16) if is_bfloat16_bits(pages) else pages


def bfloat16_bits(x: jax.Array) -> jax.Array:
    """`x` rounded to bfloat16, as uint16 bit patterns (what a `BFLOAT16_BITS` pool stores)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BFLOAT16_BITS)


def dequantize(pages: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Pages `[..., ps, D]` as float32 values: int8 pages times their `scale [..., ps]`, float pages (or
    bfloat16 bit patterns) as they are (`scale` None)."""
    values = page_values(pages).astype(jnp.float32)
    return values if scale is None else values * scale[..., None]


def is_quantized(pages: jax.Array) -> bool:
    return jnp.dtype(pages.dtype) == jnp.dtype(jnp.int8)
