"""Hugging Face checkpoint <-> kvjax parameters: a declarative name map plus per-tensor transforms.

Notes: docs/modules.md (`kvjax/models/convert.py`)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from kvjax.models.config import ModelConfig

# HF tensors that carry no parameters we need (buffers saved by old checkpoints).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config describes."""


def tree_path(key_path) -> tuple:
    """A pytree key path as names and layer indices: `("layers", 3, "mlp", "up_proj", "kernel")`."""
    return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)


def is_stacked(path: tuple) -> bool:
    """Whether a parameter path lies under stacked decoder layers (leaves `[L, ...]`); the per-layer form's
    paths carry the layer index instead (`("layers", 3, ...)`)."""
    return path[0] == "layers" and not isinstance(path[1], int)


def hf_name(path: tuple, layer: int | None = None) -> tuple[str, bool]:
    """Map a Flax parameter path (and, under stacked `layers`, a layer index) to (HF tensor name, whether to
    transpose one layer's array)."""
    *modules, leaf = path
    if is_stacked(path):
        if layer is None:
            raise ValueError(f"{'/'.join(path)} is a stacked layer parameter: give the layer index")
        modules = ["layers", str(layer), *modules[1:]]
    modules = [str(m) for m in modules]
    transpose = leaf == "kernel"
    hf_leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}[leaf]
    prefix = [] if modules[0] == "lm_head" else ["model"]
    return ".".join(prefix + modules + [hf_leaf]), transpose


def params_from_hf(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], expected_shapes: Any, dtype
) -> dict:
    """Build the parameter tree from HF tensors. `expected_shapes` is the tree of `jax.ShapeDtypeStruct`."""
    flat = jax.tree_util.tree_flatten_with_path(expected_shapes)[0]
    used, missing, mismatched = set(), [], []
    leaves = []

    def take(path, layer, shape):
        """One HF tensor as the Flax array of `shape` (one layer's, for a stacked leaf), or None."""
        name, transpose = hf_name(path, layer)
        if name not in tensors:
            missing.append(name)
            return None
        used.add(name)
        array = np.asarray(tensors[name])
        if transpose:
            array = array.T
        if tuple(array.shape) != tuple(shape):
            hf_shape = tuple(reversed(array.shape)) if transpose else tuple(array.shape)
            expected_hf = tuple(reversed(shape)) if transpose else tuple(shape)
            mismatched.append(f"{name}: checkpoint has {hf_shape}, config implies {expected_hf}")
            return None
        return array

    for key_path, spec in flat:
        path = tree_path(key_path)
        if not is_stacked(path):
            leaves.append(take(path, None, spec.shape))
            continue
        rows = [take(path, layer, spec.shape[1:]) for layer in range(spec.shape[0])]
        leaves.append(None if any(r is None for r in rows) else np.stack(rows))
    unexpected = [
        n
        for n in tensors
        if n not in used
        and not n.endswith(_IGNORED_HF_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    ]
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(sorted(missing)))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(sorted(unexpected)))
    if mismatched:
        problems.append("shape mismatches: " + "; ".join(mismatched))
    if problems:
        raise CheckpointError(f"checkpoint does not match its {cfg.model_type} config: " + " | ".join(problems))
    treedef = jax.tree_util.tree_structure(expected_shapes)
    return jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(a, dtype=dtype) for a in leaves])


def params_to_hf(params: Any) -> dict[str, np.ndarray]:
    """Inverse of `params_from_hf`: HF tensor names to numpy arrays (for export and round-trip tests)."""
    out = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tree_path(key_path)
        array = np.asarray(leaf)
        for layer, part in enumerate(array) if is_stacked(path) else [(None, array)]:
            name, transpose = hf_name(path, layer)
            out[name] = np.ascontiguousarray(part.T if transpose else part)
    return out
