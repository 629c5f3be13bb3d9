"""The sharded KV state: one complete paged `KVState` per (data shard, head shard), stacked.

Notes: docs/modules.md (`kvjax/distributed/state.py`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.models.config import ModelConfig
from kvjax.distributed.mesh import DATA, MODEL, ShardingPlan
from kvjax.cache.state import KVState, init_state, overflow_error

try:  # JAX >= 0.6 exports shard_map at the top level; older releases only in jax.experimental
    from jax import shard_map as _jax_shard_map

    _NO_CHECK = {"check_vma": False}
except ImportError:  # pragma: no cover - depends on the installed JAX
    from jax.experimental.shard_map import shard_map as _jax_shard_map

    _NO_CHECK = {"check_rep": False}


def head_axis(plan: ShardingPlan):
    """The mesh axis kv heads are split over: "model", or None when they are replicated."""
    return MODEL if plan.heads else None


def state_spec(plan: ShardingPlan) -> P:
    """Spec of every leaf of a stacked state: leading axes (data shard, head shard)."""
    return P(DATA, head_axis(plan))


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` (or, on older JAX, `jax.experimental.shard_map.shard_map`) without the replication
    check, which rejects loops the single-device code starts from unsharded constants."""
    return _jax_shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)


def per_shard(fn, mesh: Mesh, in_specs, out_specs):
    """`shard_map` over both mesh axes. Stacked-state arguments (spec `state_spec`) reach `fn` as a plain
    local `KVState` (the two leading unit axes squeezed) and are re-stacked on the way out."""

    def squeeze(tree):
        return jax.tree.map(lambda x: x[0, 0], tree) if isinstance(tree, KVState) else tree

    def expand(tree):
        return jax.tree.map(lambda x: x[None, None], tree) if isinstance(tree, KVState) else tree

    def local(*args):
        out = fn(*(squeeze(a) for a in args))
        return tuple(expand(o) for o in out) if isinstance(out, tuple) else expand(out)

    return shard_map(local, mesh, in_specs, out_specs)


def local_config(cfg: ModelConfig, plan: ShardingPlan) -> ModelConfig:
    """The config one head shard sees: its share of the query and kv heads."""
    m = plan.head_shards
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // m, num_kv_heads=cfg.num_kv_heads // m)


def init_sharded_state(
    cfg: ModelConfig, batch: int, capacity: int, page_size: int, mesh: Mesh, plan: ShardingPlan,
    num_pages: int | None = None, dtype=jnp.float32, long_rope: bool = False, read_pages: tuple | None = None,
) -> KVState:
    """An empty stacked state for `batch` sequences (a multiple of the data axis) on `mesh`.

    `num_pages` is the whole pool (as `kvjax.cache.state.init_state` takes it), split evenly over the shards;
    by default each shard's pool holds a full cache of its rows and heads. Returns a `KVState` whose
    leaves have leading axes `[Sd, Sm]`.
    """
    if batch % plan.data:
        raise ValueError(f"batch={batch} must be a multiple of the mesh's data axis ({plan.data})")
    shards = plan.data * plan.head_shards
    local_pages = None if num_pages is None else -(-num_pages // shards)
    local = init_state(
        local_config(cfg, plan), batch // plan.data, capacity, page_size, num_pages=local_pages, dtype=dtype,
        long_rope=long_rope,
    ).replace(read_pages=read_pages)
    shape = (plan.data, plan.head_shards)
    sharding = NamedSharding(mesh, state_spec(plan))

    @functools.partial(jax.jit, out_shardings=sharding)
    def stacked():
        return jax.tree.map(lambda x: jnp.broadcast_to(x, shape + x.shape), local)

    return stacked()


def shard_of(state: KVState, d: int, m: int) -> KVState:
    """Shard (d, m) of a stacked state as a plain `KVState` (for inspection and error messages)."""
    return jax.tree.map(lambda x: x[d, m], state)


def to_host(tree):
    """numpy copies of a pytree's arrays. An array no single process can address (a multi-process mesh,
    sharded) is gathered from every process (`multihost_utils.process_allgather`, a collective: every
    process must call this at the same point, as SPMD code does)."""

    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def sharded_overflow_error(state: KVState):
    """The `CacheCapacityError` of the first shard whose step overflowed, or None (one small device read).
    Its page counts are that shard's pool: each shard allocates from its own pages."""
    codes = to_host(state.overflow)  # [Sd, Sm, 3]
    failed = np.argwhere(codes[..., 0] != 0)
    if failed.size == 0:
        return None
    d, m = (int(i) for i in failed[0])
    error = overflow_error(shard_of(to_host(state), d, m))
    error.args = (f"{error.args[0]} (in shard data={d}, model={m} of its own pool)",)
    return error
