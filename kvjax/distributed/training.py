"""Data-parallel training of small trainable parameters (Locret's retaining heads) beside a frozen model.

Notes: docs/modules.md (`kvjax/distributed/training.py`)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.distributed.mesh import DATA, mesh_shape
from kvjax.distributed.state import shard_map

LossFn = Callable[[Any, Any, Any], jax.Array]


def _batch_size(batch) -> int:
    sizes = {leaf.shape[0] for leaf in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"every leaf of batch needs the same leading (sequence) axis, got sizes {sorted(sizes)}")
    return sizes.pop()


def data_parallel_value_and_grad(loss_fn: LossFn, mesh: Mesh) -> Callable:
    """`f(trainable, frozen, batch) -> (loss, grads)` over `mesh`: the mean over data shards of each shard's
    `loss_fn` on its microbatch, and the gradient of that mean. The batch's leading axis must divide by
    the data axis. Traceable (call it inside `jit`)."""
    data, _ = mesh_shape(mesh)

    def local(trainable, frozen, batch):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, batch)
        return jax.lax.pmean(loss, DATA), jax.lax.pmean(grads, DATA)

    sharded = shard_map(local, mesh, (P(), P(), P(DATA)), (P(), P()))

    def value_and_grad(trainable, frozen, batch):
        n = _batch_size(batch)
        if n % data:
            raise ValueError(f"batch holds {n} sequences; it must divide by the mesh's data axis ({data})")
        return sharded(trainable, frozen, batch)

    return value_and_grad


def accumulated_value_and_grad(loss_fn: LossFn, trainable, frozen, batch, microbatches: int):
    """The single-device equivalent: `loss_fn` and its gradient on `microbatches` equal slices of `batch`,
    accumulated one after another and averaged. Returns `(loss, grads)`."""
    n = _batch_size(batch)
    if microbatches < 1 or n % microbatches:
        raise ValueError(f"microbatches={microbatches} must be >= 1 and divide the batch of {n} sequences")
    size = n // microbatches
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    loss_sum, grad_sum = 0.0, jax.tree.map(jnp.zeros_like, trainable)
    for i in range(microbatches):
        part = jax.tree.map(lambda x: x[i * size : (i + 1) * size], batch)
        loss, grads = grad_fn(trainable, frozen, part)
        loss_sum, grad_sum = loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)
    return loss_sum / microbatches, jax.tree.map(lambda g: g / microbatches, grad_sum)


def make_data_parallel_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """A jitted `step(trainable, opt_state, frozen, batch) -> (trainable, opt_state, loss)` that trains
    data-parallel over `mesh` (see the module docstring); `trainable` and `opt_state` are donated."""
    value_and_grad = data_parallel_value_and_grad(loss_fn, mesh)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, opt_state, frozen, batch):
        loss, grads = value_and_grad(trainable, frozen, batch)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    return step


def _host_side(tree):
    """Arrays held by this process alone as numpy: a mesh over several processes is filled from host data
    every process holds alike (SPMD), not from another process's device."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x, tree)


def place_batch(batch, mesh: Mesh):
    """Put a host batch (the whole global batch, the same on every process) on `mesh`, split over "data"
    along its leading axis."""
    return jax.device_put(_host_side(batch), NamedSharding(mesh, P(DATA)))


def replicate(tree, mesh: Mesh):
    """Put a pytree on every device of `mesh`."""
    return jax.device_put(_host_side(tree), NamedSharding(mesh, P()))
