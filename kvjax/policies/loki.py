"""Loki-style selection (Singhania et al., 2024): pages scored from a low-rank sketch of the keys.

Notes: docs/modules.md (`kvjax/policies/loki.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels import bfloat16_bits
from kvjax.policies.base import register_policy
from kvjax.policies.key_sketch import SketchSelect


def sketch_dtype_bits(x: jax.Array) -> jax.Array:
    """`x` in bfloat16 as the pool holds it: uint16 bit patterns on CPU (no bfloat16 scatter there)."""
    return bfloat16_bits(x) if jax.default_backend() == "cpu" else x.astype(jnp.bfloat16)


@register_policy("loki")
@dataclasses.dataclass(frozen=True)
class Loki(SketchSelect):
    rank: int = 16

    def validate(self, page_size: int) -> None:
        super().validate(page_size)
        if self.rank <= 0:
            raise ValueError(f"loki: rank must be > 0, got {self.rank}")

    def fit(self, keys: jax.Array, valid: jax.Array) -> jax.Array:
        """Basis `f32[B, H, D, rank]`: the top eigenvectors of each head's key second moment K^T K."""
        moment = jnp.einsum("bhsd,bhse->bhde", keys, keys, precision="highest")
        _, vectors = jnp.linalg.eigh(moment)  # ascending eigenvalues
        return vectors[..., ::-1][..., : self.rank]

    def codes(self, basis: jax.Array, keys: jax.Array) -> jax.Array:
        return sketch_dtype_bits(jnp.einsum("bhsd,bhdr->bhsr", keys.astype(jnp.float32), basis, precision="highest"))

    def query(self, basis: jax.Array, q: jax.Array) -> jax.Array:
        return jnp.einsum("bhgd,bhdr->bhgr", q.astype(jnp.float32), basis, precision="highest")
