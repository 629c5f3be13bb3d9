"""The ("data", "model") device mesh and the rules that shard a model's parameters over it.

Notes: docs/modules.md (`kvjax/distributed/mesh.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.models.config import ModelConfig
from kvjax.models.loading import Model
from kvjax.models.convert import is_stacked, tree_path

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# parameter name -> (kernel spec, bias spec) when heads / MLP units are split over "model"
_COLUMN = (P(None, MODEL), P(MODEL))  # output features split: whole heads or MLP units per device
_ROW = (P(MODEL, None), P())  # input features split: partial sums, all-reduced by XLA
_HEAD_RULES = {"q_proj": _COLUMN, "k_proj": _COLUMN, "v_proj": _COLUMN, "o_proj": _ROW}
_MLP_RULES = {"gate_proj": _COLUMN, "up_proj": _COLUMN, "down_proj": _ROW}
# Phi-3's fused qkv_proj / gate_up_proj are replicated: a column split would cut across q, k and v.


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A `data x model` mesh with axes ("data", "model") over the first data*model of `devices`
    (default `jax.devices()`, which on a multi-host run lists every host's devices), in that order;
    a `[data, model]` array of devices (e.g. from `mesh_utils.create_hybrid_device_mesh`) is used as is."""
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, model={model}")
    if isinstance(devices, np.ndarray) and devices.shape == (data, model):
        return Mesh(devices, AXES)
    devices = list(jax.devices() if devices is None else np.asarray(devices, dtype=object).reshape(-1))
    if data * model > len(devices):
        raise ValueError(
            f"a {data}x{model} mesh needs {data * model} devices but {len(devices)} are visible "
            "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
        )
    return Mesh(np.asarray(devices[: data * model], dtype=object).reshape(data, model), AXES)


def local_model_mesh(data: int, model: int) -> Mesh:
    """A `data x model` mesh whose "model" axis stays inside each process (a host's fast links carry the
    per-layer all-reduces) and whose "data" axis spans processes: `mesh_utils.create_hybrid_device_mesh`
    with a process as the granule. `model` must divide the devices of one process."""
    from jax.experimental import mesh_utils

    processes, local = jax.process_count(), jax.local_device_count()
    if local % model or data % processes or data * model != processes * local:
        raise ValueError(
            f"a {data}x{model} mesh with the model axis inside a process needs model to divide the {local} devices "
            f"of a process and data * model == all {processes * local} devices, with data a multiple of the "
            f"{processes} processes"
        )
    grid = mesh_utils.create_hybrid_device_mesh(
        (data // processes, model), (processes, 1), jax.devices(), process_is_granule=True
    )
    return Mesh(grid, AXES)


def mesh_from_text(text: str) -> Mesh:
    """The mesh of a command line's `--mesh DATAxMODEL` ("2x4"): over several processes, the model axis
    inside each process when it fits there (`local_model_mesh`), else `make_mesh`'s device order."""
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh takes DATAxMODEL, e.g. 2x4, got {text!r}") from None
    if jax.process_count() > 1 and jax.local_device_count() % model == 0 and data * model == len(jax.devices()):
        return local_model_mesh(data, model)
    return make_mesh(data, model)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """(data, model) sizes of a mesh made by `make_mesh` (or any mesh with those two axis names)."""
    missing = [a for a in AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"the mesh needs axes {AXES}, it has {tuple(mesh.shape)} (missing {missing})")
    return mesh.shape[DATA], mesh.shape[MODEL]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """What a model shards over "model" on a mesh (static, hashable).

    `heads`: query/kv heads (and so the KV state) are split over "model"; False replicates them.
    `mlp`: the MLP's hidden units are split over "model".
    """

    data: int
    model: int
    heads: bool
    mlp: bool

    @property
    def head_shards(self) -> int:
        """Shards the kv heads (and the KV pool) are split into along "model"."""
        return self.model if self.heads else 1


def plan_for(cfg: ModelConfig, mesh: Mesh, on_indivisible: str = "error") -> ShardingPlan:
    """Decide what to shard. Head counts (query and kv) and the MLP width must divide the "model" axis;
    when one does not, `on_indivisible="error"` raises a ValueError naming it and `"replicate"` keeps that
    part whole on every device of the axis (correct, but no memory saved for it)."""
    if on_indivisible not in ("error", "replicate"):
        raise ValueError(f"on_indivisible must be 'error' or 'replicate', got {on_indivisible!r}")
    data, model = mesh_shape(mesh)
    heads = cfg.num_heads % model == 0 and cfg.num_kv_heads % model == 0
    mlp = cfg.intermediate_size % model == 0 and not cfg.fused_gate_up
    if on_indivisible == "error":
        if not heads:
            raise ValueError(
                f"cannot shard attention over a 'model' axis of {model}: num_heads={cfg.num_heads} and "
                f"num_kv_heads={cfg.num_kv_heads} must both divide by it (use a model axis that divides "
                "them, or on_indivisible='replicate' to keep the heads and the KV cache whole on every device)"
            )
        if cfg.intermediate_size % model:
            raise ValueError(
                f"cannot shard the MLP over a 'model' axis of {model}: intermediate_size="
                f"{cfg.intermediate_size} does not divide by it (or pass on_indivisible='replicate')"
            )
    return ShardingPlan(data=data, model=model, heads=heads and model > 1, mlp=mlp and model > 1)


def param_specs(params: Any, plan: ShardingPlan) -> Any:
    """A PartitionSpec for every parameter leaf (same tree as `params`)."""
    rules = {**(_HEAD_RULES if plan.heads else {}), **(_MLP_RULES if plan.mlp else {})}

    def spec(path, leaf):
        names = tree_path(path)
        rule = rules.get(names[-2]) if len(names) >= 2 else None
        split = P() if rule is None else rule[0] if names[-1] == "kernel" else rule[1]
        return P(None, *split) if is_stacked(names) else split

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(model: Model, mesh: Mesh, on_indivisible: str = "error") -> Model:
    """The model with its parameters placed on `mesh` by the rules above (see `plan_for`)."""
    plan = plan_for(model.cfg, mesh, on_indivisible)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(model.params, plan))
    return dataclasses.replace(model, params=jax.device_put(model.params, shardings))
