"""Hugging Face checkpoint <-> kvjax parameters: a declarative name map plus per-tensor transforms.

`hf_name(path)` maps a Flax parameter path such as `("layers_3", "self_attn", "q_proj", "kernel")` to the
HF tensor name `model.layers.3.self_attn.q_proj.weight`; Dense kernels are transposed. Every expected
tensor must be present with the expected shape; unexpected tensors are reported by name.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np

from kvjax.config import ModelConfig

# HF tensors that carry no parameters we need (buffers saved by old checkpoints).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config describes."""


def hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Map a Flax parameter path to (HF tensor name, whether to transpose)."""
    *modules, leaf = path
    hf_modules = []
    for m in modules:
        match = re.fullmatch(r"layers_(\d+)", m)
        hf_modules += ["layers", match.group(1)] if match else [m]
    transpose = leaf == "kernel"
    hf_leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}[leaf]
    prefix = [] if modules[0] == "lm_head" else ["model"]
    return ".".join(prefix + hf_modules + [hf_leaf]), transpose


def params_from_hf(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], expected_shapes: Any, dtype
) -> dict:
    """Build the parameter tree from HF tensors. `expected_shapes` is the tree of `jax.ShapeDtypeStruct`."""
    flat = jax.tree_util.tree_flatten_with_path(expected_shapes)[0]
    used, missing, mismatched = set(), [], []
    leaves = []
    for key_path, spec in flat:
        path = tuple(k.key for k in key_path)
        name, transpose = hf_name(path)
        if name not in tensors:
            missing.append(name)
            leaves.append(None)
            continue
        used.add(name)
        array = np.asarray(tensors[name])
        if transpose:
            array = array.T
        if tuple(array.shape) != tuple(spec.shape):
            hf_shape = tuple(reversed(array.shape)) if transpose else tuple(array.shape)
            expected_hf = tuple(reversed(spec.shape)) if transpose else tuple(spec.shape)
            mismatched.append(f"{name}: checkpoint has {hf_shape}, config implies {expected_hf}")
        leaves.append(array)
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
        name, transpose = hf_name(tuple(k.key for k in key_path))
        array = np.asarray(leaf)
        out[name] = np.ascontiguousarray(array.T if transpose else array)
    return out
