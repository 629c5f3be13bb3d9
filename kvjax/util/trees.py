"""Pytree helpers for the device arrays of states and carries."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def copied(tree):
    """A copy of every array of `tree` in new buffers, by one program per tree structure and shapes
    (`jax.tree.map(jnp.copy, tree)` builds one per leaf shape: ten for a `KVState`). For a step that
    donates its input while the original must stay usable."""
    return jax.tree.map(jnp.copy, tree)


__all__ = ["copied"]
