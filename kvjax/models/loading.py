"""Load a model from a local Hugging Face directory: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig
from kvjax.models import CausalLM, is_unstacked, unstack_layers
from kvjax.models.convert import CheckpointError, params_from_hf

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class Model:
    """A loaded model: its config, parameters (a pytree), the Flax module and the tokenizer (or None).
    `params["layers"]` is a tuple of per-layer trees (`unstack_layers`), the one layout every step reads:
    the weights are held once. A stacked tree given here is taken apart and not kept. `dtype` is the
    parameter and compute dtype; `kv_dtype` the KV pages' (None: `dtype`; "int8": int8 pages with one
    float32 scale per slot, see `kvjax.cache.state.init_state`). `model.with_kv_dtype("int8")` gives the
    same weights with int8 pages."""

    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    dtype: Any = jnp.float32
    kv_dtype: Any = None

    def __post_init__(self):
        if self.kv_dtype is not None:
            self.kv_dtype = resolve_kv_dtype(self.kv_dtype)
        if isinstance(self.params, dict) and "layers" in self.params and not is_unstacked(self.params["layers"]):
            self.params = unstack_layers(self.params)

    @property
    def cache_dtype(self) -> Any:
        """The dtype of the KV pages every generation with this model allocates."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    def with_kv_dtype(self, kv_dtype) -> "Model":
        return dataclasses.replace(self, kv_dtype=kv_dtype)

    @property
    def module(self) -> CausalLM:
        return CausalLM(self.cfg, self.dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def resolve_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type if dtype is not None else jnp.float32


KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def resolve_kv_dtype(kv_dtype) -> Any:
    """A KV page dtype from its name or dtype: float32, bfloat16 or int8."""
    name = kv_dtype if isinstance(kv_dtype, str) else jnp.dtype(kv_dtype).name
    if name not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; expected one of {sorted(KV_DTYPES)}")
    return KV_DTYPES[name]


def param_shapes(cfg: ModelConfig, dtype) -> Any:
    """The parameter tree's shapes in `Model`'s per-layer form, without allocating (`jax.eval_shape` of `init`)."""
    module = CausalLM(cfg, dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)

    def attend(layer_index, inputs, carry):
        return jnp.repeat(inputs.v, cfg.group_size, axis=2), carry

    def init():
        return module.init(
            jax.random.PRNGKey(0), tokens, tokens, _dummy_rope(cfg), attend, None, method=CausalLM.hidden_and_logits
        )

    shapes = jax.eval_shape(init)["params"]
    per_layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes["layers"])
    return {**shapes, "layers": (per_layer,) * cfg.num_layers}


def _dummy_rope(cfg: ModelConfig):
    return np.ones(cfg.rotary_dim // 2, np.float32), 1.0


def init_params(cfg: ModelConfig, seed: int = 0, dtype="float32", std: float = 0.02) -> Any:
    """Random parameters (normal, std 0.02; norms at 1) in `Model`'s per-layer form, for tests and benchmarks.

    Each layer's arrays are drawn as when layers were separate subtrees (`layers_0`, `layers_1`, ...,
    one key per leaf in that tree's order), so a seed gives the weights it always gave."""
    dtype = resolve_dtype(dtype)
    shapes = param_shapes(cfg, dtype)
    unstacked = {k: v for k, v in shapes.items() if k != "layers"}
    unstacked.update({f"layers_{l}": layer for l, layer in enumerate(shapes["layers"])})
    leaves = jax.tree_util.tree_flatten_with_path(unstacked)[0]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = []
    for key, (path, spec) in zip(keys, leaves):
        if path[-1].key == "scale":
            out.append(jnp.ones(spec.shape, dtype))
        else:
            out.append((jax.random.normal(key, spec.shape, jnp.float32) * std).astype(dtype))
    drawn = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(unstacked), out)
    params = {k: v for k, v in drawn.items() if not k.startswith("layers_")}
    params["layers"] = tuple(drawn[f"layers_{l}"] for l in range(cfg.num_layers))
    return params


def read_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """All tensors of a local checkpoint directory: `model.safetensors.index.json` shards, or `*.safetensors`."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise CheckpointError(f"shards named in {index} are missing: {', '.join(absent)}")
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path!r}")
    tensors: dict[str, Any] = {}
    for file in files:
        try:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"cannot read safetensors file {file!r} (truncated or corrupt?): {error}") from error
    return tensors


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved beside the weights, or None when there is none."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        # The fast tokenizer class directly: AutoTokenizer's import costs seconds at every CLI start.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    if not any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str | os.PathLike, dtype="float32", kv_dtype=None) -> Model:
    """Load a model: a local HF directory (`config.json`, safetensors, tokenizer), a `.gguf` file, "tiny" (the
    model kvjax ships) or a registered name fetched with `kvjax fetch NAME` (see `kvjax.models.hub`).

    `dtype` ("float32", "bfloat16", "float16") is the parameter and compute dtype; attention softmax and
    logits are float32. `kv_dtype` (None = `dtype`, "float32", "bfloat16" or "int8") is the KV pages' dtype. Raises `CheckpointError` naming missing, unexpected or mis-shaped tensors, or an
    unreadable file; `FileNotFoundError` for a missing path or a registered model not fetched yet.
    """
    from kvjax.models.hub import resolve_model

    path = resolve_model(path)
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        from kvjax.models.gguf import load_gguf

        hf_config, tensors, tokenizer = load_gguf(path)
        cfg = ModelConfig.from_hf_dict(hf_config)
    else:
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"model {path!r} does not exist (kvjax loads a local Hugging Face directory, a .gguf file, 'tiny' "
                "or a name registered in kvjax.models.hub; see `kvjax fetch --list`)"
            )
        cfg = ModelConfig.from_pretrained(path)
        tensors, tokenizer = read_safetensors(path), load_tokenizer(path)
    dtype = resolve_dtype(dtype)
    params = params_from_hf(cfg, tensors, param_shapes(cfg, dtype), dtype)
    return Model(cfg=cfg, params=params, tokenizer=tokenizer, dtype=dtype, kv_dtype=kv_dtype)
