"""Locret's retaining heads: one small MLP per layer that predicts each cached token's future importance.

Notes: docs/modules.md (`kvjax/policies/locret_heads.py`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig

META_FILE = "locret_heads.json"
PARAMS_DIR = "params"
DEFAULT_HIDDEN = 1024
SHIPPED_DIR = "locret-heads"  # kvjax/assets/locret-heads/{model name}.safetensors, bfloat16
SHIPPED_SUFFIX = ".safetensors"
# Locret options the heads shipped for a model bring, where the policy is not given them (docs/locret.md, "Defaults
# of the shipped heads"): the SmolLM2 heads learned KVzip's pooled score, and keep the attention sink
SHIPPED_OPTIONS = {"smollm2-135m": {"pool": "all", "sink_size": 4}}


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """The shape a set of heads was built for (must match the model it scores)."""

    num_layers: int
    num_heads: int  # query heads Hq
    num_kv_heads: int  # H
    head_dim: int  # D
    hidden_size: int = DEFAULT_HIDDEN

    @property
    def in_features(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @classmethod
    def for_model(cls, cfg: ModelConfig, hidden_size: int = DEFAULT_HIDDEN) -> "HeadsConfig":
        return cls(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, hidden_size)

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the first field where these heads do not fit `cfg`."""
        model = HeadsConfig.for_model(cfg, self.hidden_size)
        for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) != getattr(model, field):
                raise ValueError(
                    f"retaining heads were built for {field}={getattr(self, field)} but the model has "
                    f"{getattr(model, field)}"
                )


@dataclasses.dataclass(eq=False)
class RetainingHeads:
    """Heads' parameters and their config. Hashes by identity, so a policy holding it stays static under
    `jit`; the arrays themselves reach the jitted step as an argument (`Policy.device_params`)."""

    config: HeadsConfig
    params: Any  # {"layer_{l}": {"w1": [F, hidden], "w2": [hidden, H]}}
    options: dict = dataclasses.field(default_factory=dict)  # Locret options these heads default to (SHIPPED_OPTIONS)

    def layer(self, index: int) -> dict:
        return self.params[f"layer_{index}"]

    @functools.cached_property
    def stacked(self) -> dict:
        """Every layer's head stacked once: `{"w1": [L, F, hidden], "w2": [L, hidden, H]}`, what the steps'
        scan over layers indexes with a traced layer (`stacked_layer`)."""
        layers = [self.params[f"layer_{l}"] for l in range(len(self.params))]  # config may be None (a bare dict)
        return jax.tree.map(lambda *ws: jnp.stack(ws), *layers)


def stacked_layer(stacked: dict, layer) -> dict:
    """Layer `layer`'s head (`{"w1", "w2"}`) from `RetainingHeads.stacked`; `layer` may be traced."""
    return jax.tree.map(lambda w: w[layer], stacked)


def init_heads(config: HeadsConfig, seed: int = 0, dtype=jnp.float32) -> RetainingHeads:
    """Fresh heads: LeCun-normal weights (PyTorch's Linear has the same variance scale up to a constant)."""
    init = jax.nn.initializers.lecun_normal()
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * config.num_layers)
    params = {
        f"layer_{l}": {
            "w1": init(keys[2 * l], (config.in_features, config.hidden_size), dtype),
            "w2": init(keys[2 * l + 1], (config.hidden_size, config.num_kv_heads), dtype),
        }
        for l in range(config.num_layers)
    }
    return RetainingHeads(config, params)


def retaining_scores(layer_params: dict, q_pre: jax.Array, k_pre: jax.Array, v: jax.Array) -> jax.Array:
    """Predicted importance of each token for each kv head: `f32[B, T, H]`.

    `q_pre [B, T, Hq, D]` and `k_pre [B, T, H, D]` are before RoPE, `v [B, T, H, D]`. Computes in the
    inputs' dtype (bfloat16 models score in bfloat16) with float32 accumulation.
    """
    B, T = q_pre.shape[:2]
    x = jnp.concatenate([q_pre.reshape(B, T, -1), k_pre.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
    w1, w2 = layer_params["w1"], layer_params["w2"]
    if x.shape[-1] != w1.shape[0]:
        raise ValueError(
            f"retaining head expects {w1.shape[0]} input features (Hq + 2H) * D, got {x.shape[-1]} from the model"
        )
    h = jnp.einsum("btf,fk->btk", x, w1.astype(x.dtype), preferred_element_type=jnp.float32)
    h = jax.nn.silu(h).astype(x.dtype)
    return jnp.einsum("btk,kh->bth", h, w2.astype(x.dtype), preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------ storage


def _write_meta(path: str, config: HeadsConfig, extra: dict | None = None) -> None:
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"config": dataclasses.asdict(config), **(extra or {})}, f, indent=2)


def _read_config(path: str) -> HeadsConfig:
    meta = os.path.join(path, META_FILE)
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"{path!r} holds no retaining heads ({META_FILE} is missing)")
    with open(meta) as f:
        return HeadsConfig(**json.load(f)["config"])


def abstract_params(config: HeadsConfig, dtype=jnp.float32) -> dict:
    """`jax.ShapeDtypeStruct` tree of the heads' parameters (an orbax restore target)."""
    return jax.eval_shape(lambda: init_heads(config, 0, dtype).params)


def save_heads(path: str | os.PathLike, heads: RetainingHeads, extra: dict | None = None) -> str:
    """Save with orbax into directory `path` (overwritten), beside a JSON file with the config."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(path, PARAMS_DIR), heads.params, force=True)
    checkpointer.wait_until_finished()
    _write_meta(path, heads.config, extra)
    return path


def restore_heads(path: str | os.PathLike) -> RetainingHeads:
    """Restore heads saved by `save_heads` (or `export_safetensors`'s file: see `load_heads`)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    config = _read_config(path)
    params = ocp.StandardCheckpointer().restore(os.path.join(path, PARAMS_DIR), abstract_params(config))
    return RetainingHeads(config, params)


def export_safetensors(heads: RetainingHeads, file: str | os.PathLike, dtype="float32") -> str:
    """Write `layers.{l}.retaining_head.{w1,w2}` tensors in `dtype` ("float32" or "bfloat16", what the
    shipped heads use) with the config in the metadata."""
    from safetensors.numpy import save_file

    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"export dtype must be float32 or bfloat16, got {dtype!r}")
    file = os.fspath(file)
    tensors = {
        f"layers.{l}.retaining_head.{name}": np.asarray(jnp.asarray(heads.layer(l)[name]).astype(dtype))
        for l in range(heads.config.num_layers)
        for name in ("w1", "w2")
    }
    save_file(tensors, file, metadata={"locret_heads_config": json.dumps(dataclasses.asdict(heads.config))})
    return file


def import_safetensors(file: str | os.PathLike) -> RetainingHeads:
    from safetensors import safe_open

    file = os.fspath(file)
    with safe_open(file, framework="numpy") as f:
        meta = f.metadata() or {}
        if "locret_heads_config" not in meta:
            raise ValueError(f"{file!r} is not a retaining-heads export (no locret_heads_config metadata)")
        config = HeadsConfig(**json.loads(meta["locret_heads_config"]))
        params = {
            f"layer_{l}": {name: jnp.asarray(f.get_tensor(f"layers.{l}.retaining_head.{name}")) for name in ("w1", "w2")}
            for l in range(config.num_layers)
        }
    return RetainingHeads(config, params)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float) -> RetainingHeads:
    if not path.endswith(".safetensors"):
        return restore_heads(path)
    heads = import_safetensors(path)
    shipped = [name for name in SHIPPED_OPTIONS if path == shipped_heads_path(name)]
    return dataclasses.replace(heads, options=dict(SHIPPED_OPTIONS[shipped[0]])) if shipped else heads


def shipped_heads_path(name: str) -> str:
    """Where the heads shipped for model `name` live: `kvjax/assets/locret-heads/{name}.safetensors`
    (they may not exist: `load_heads` says how to train them)."""
    from importlib import resources

    return str(resources.files("kvjax") / "assets" / SHIPPED_DIR / f"{name}{SHIPPED_SUFFIX}")


def shipped_heads() -> list[str]:
    """Names of the models whose heads ship with kvjax."""
    directory = os.path.dirname(shipped_heads_path("x"))
    if not os.path.isdir(directory):
        return []
    return sorted(n[: -len(SHIPPED_SUFFIX)] for n in os.listdir(directory) if n.endswith(SHIPPED_SUFFIX))


def _resolve(path_or_name: str) -> str:
    """An existing path as is; a model name with shipped heads -> their file; else FileNotFoundError
    saying how to get heads (`kvjax train locret`)."""
    if os.path.exists(path_or_name):
        return os.path.abspath(path_or_name)
    looks_like_name = os.sep not in path_or_name and not path_or_name.endswith(SHIPPED_SUFFIX)
    if looks_like_name and os.path.isfile(shipped_heads_path(path_or_name)):
        return shipped_heads_path(path_or_name)
    shipped = ", ".join(shipped_heads()) or "none"
    if looks_like_name:
        raise FileNotFoundError(
            f"no retaining heads ship for {path_or_name!r} (shipped: {shipped}) and no such path exists; "
            f"train them with `kvjax train locret --model {path_or_name} --data ... --out runs/locret` and pass "
            f"heads='runs/locret/heads.safetensors' (or copy that file to {shipped_heads_path(path_or_name)})"
        )
    raise FileNotFoundError(
        f"retaining heads {os.path.abspath(path_or_name)!r} do not exist (heads by model name ship for: {shipped}; "
        "`kvjax train locret` trains others)"
    )


def load_heads(path: str | os.PathLike) -> RetainingHeads:
    """Heads from an orbax directory (`save_heads`), a `.safetensors` export, or the name of a model whose
    heads ship with kvjax (`"tiny"`, `"smollm2-135m"`: `shipped_heads()`; shipped heads carry the Locret options
    they default to, `SHIPPED_OPTIONS`). Cached by path and modification time, so policies built from the same
    path share one object (and one compile)."""
    path = _resolve(os.fspath(path))
    meta = path if path.endswith(SHIPPED_SUFFIX) else os.path.join(path, META_FILE)
    return _load_cached(path, os.path.getmtime(meta) if os.path.exists(meta) else 0.0)
