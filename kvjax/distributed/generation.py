"""Generation over a ("data", "model") mesh: the one step of `kvjax.engine.step`, placed on a stacked state.

Notes: docs/modules.md (`kvjax/distributed/generation.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.cache.state import KVState
from kvjax.distributed.mesh import AXES, DATA, ShardingPlan, plan_for, shard_params
from kvjax.distributed.state import (
    head_axis, init_sharded_state, per_shard, sharded_overflow_error, state_spec, to_host,
)
from kvjax.engine.api import as_token_lists, policy_or_full
from kvjax.engine.generation import (
    DEFAULT_STEPS_PER_DISPATCH,
    generate_rows,
    PrefillPlan,
    prefill_rows,
)
from kvjax.engine.saved_state import SavedState, load_state
from kvjax.engine.decode import OneDevice, append_token
from kvjax.engine.step import StepBackend, append_chunk, compress_step
from kvjax.models.loading import Model
from kvjax.policies import Policy


@dataclasses.dataclass(frozen=True)
class MeshPlacement(OneDevice):
    """The steps' placement on a stacked state (`kvjax.distributed.state`): page work per shard under
    `shard_map`, a layout's b over "data" and h over the plan's head axis (see `kvjax.engine.step`)."""

    mesh: Mesh
    plan: ShardingPlan
    sharded = True

    def spec(self, layout):
        """The PartitionSpec(s) of a layout (a letter string, "state", or a tuple / dict of them)."""
        if isinstance(layout, tuple):
            return tuple(self.spec(item) for item in layout)
        if isinstance(layout, dict):
            return {name: self.spec(item) for name, item in layout.items()}
        if layout == "state":
            return state_spec(self.plan)
        axes = {"b": DATA, "h": head_axis(self.plan)}
        return P(*(axes.get(letter) for letter in layout))

    def per_shard(self, fn, in_layouts, out_layouts):
        return per_shard(fn, self.mesh, self.spec(in_layouts), self.spec(out_layouts))

    def all_shards(self, ok):
        return jax.lax.pmin(ok.astype(jnp.int32), AXES) > 0

    def next_position(self, state: KVState) -> jax.Array:
        Sd, _, b = state.next_position.shape
        return state.next_position[:, 0].reshape(Sd * b)

    def with_next_position(self, state: KVState, next_position: jax.Array) -> KVState:
        Sd, Sm, b = state.next_position.shape
        state = state.replace(next_position=jnp.broadcast_to(next_position.reshape(Sd, 1, b), (Sd, Sm, b)))
        return jax.lax.with_sharding_constraint(state, NamedSharding(self.mesh, state_spec(self.plan)))

    def state_shards(self) -> tuple[int, int]:
        """(data, head) shards a whole state is split into: rows over the first, kv heads over the second."""
        return self.plan.data, self.plan.head_shards

    def place_state(self, shards: list[list[KVState]]) -> KVState:
        """The state the steps hold from each shard's host state (numpy leaves), `shards[d][m]`: stacked
        (leaves `[Sd, Sm, ...]`) and placed with the state's sharding (`kvjax.load_state` on a mesh)."""
        stacked = jax.tree.map(lambda *xs: np.stack(xs).reshape(self.state_shards() + xs[0].shape),
                               *(part for row in shards for part in row))
        return jax.device_put(stacked, NamedSharding(self.mesh, state_spec(self.plan)))


# --------------------------------------------------------------------------------------------- host


def _padded_rows(rows: list[np.ndarray], data: int) -> list[np.ndarray]:
    """Pad the batch to a multiple of the data axis with copies of the first prompt (dropped later)."""
    return rows + [rows[0]] * (-len(rows) % data)


@functools.lru_cache(maxsize=16)
def _backend(mesh: Mesh, plan: ShardingPlan) -> StepBackend:
    """The host loops of `kvjax.engine.generation` with a stacked state on `mesh` and the one step placed there.
    Cached: the step is a static argument of `kvjax.engine.decode_loop.decode_steps`, so one (mesh, plan)
    keeps one program. Host inputs are whole on every process (SPMD); reads gather what no process holds."""
    batch = NamedSharding(mesh, P(DATA))
    placement = MeshPlacement(mesh, plan)

    def new_state(cfg, B, capacity, page_size, num_pages, dtype, long_rope, read_pages):
        return init_sharded_state(cfg, B, capacity, page_size, mesh, plan, num_pages, dtype, long_rope, read_pages)

    return StepBackend(
        new_state,
        functools.partial(append_chunk, placement=placement),
        functools.partial(append_token, placement=placement),
        functools.partial(compress_step, placement=placement),
        sharded_overflow_error,
        lambda x: jax.device_put(np.asarray(x), batch),
        to_host,
        placement,
    )


def on_mesh(model: Model, mesh: Mesh, on_indivisible: str = "error") -> tuple[Model, StepBackend]:
    """`model` with its parameters on `mesh` and the `StepBackend` of the one step there, for code written
    against a backend (`kvjax.serving.batch_engine.BatchEngine(model, backend=...)`). The serving engine's
    rows are not split: the mesh's data axis must be 1 (heads over "model")."""
    model, plan = _placed(model, mesh, on_indivisible)
    if plan.data != 1:
        raise ValueError(f"on_mesh splits heads only: the mesh's data axis must be 1, got {plan.data}")
    return model, _backend(mesh, plan)


def _placed(model: Model, mesh: Mesh, on_indivisible: str) -> tuple[Model, ShardingPlan]:
    if any(model.cfg.windows):
        raise NotImplementedError(
            f"the sharded path has no sliding-window layers yet (this model's windows: {sorted(set(model.cfg.windows))}); "
            "run it with kvjax.generate on one device"
        )
    return shard_params(model, mesh, on_indivisible), plan_for(model.cfg, mesh, on_indivisible)


def prefill_sharded(
    model: Model, prompt_ids, policy: Policy | None = None, *, mesh: Mesh, page_size: int = 16,
    capacity: int | None = None, chunk_size: int = 512, max_new_tokens: int = 256, on_indivisible: str = "error",
) -> tuple[KVState, jax.Array, ShardingPlan]:
    """`kvjax.prefill` on `mesh`. Returns `(stacked state, logits f32[B', V], plan)`; B' is the batch
    padded to a multiple of the data axis (the extra rows copy the first prompt)."""
    policy = policy_or_full(policy)
    model, plan = _placed(model, mesh, on_indivisible)
    rows = _padded_rows(as_token_lists(prompt_ids, model.cfg.vocab_size), plan.data)
    longest = max(len(r) for r in rows)
    prefill_plan = PrefillPlan.for_prompts(policy, longest, max_new_tokens, capacity, page_size, chunk_size,
                                           backend=_backend(mesh, plan))
    state, logits = prefill_rows(model, rows, prefill_plan)
    return state, logits, plan


def load_state_sharded(path, model: Model, *, mesh: Mesh, on_indivisible: str = "error",
                       **options) -> tuple[Model, SavedState]:
    """`kvjax.load_state` onto `mesh` (`options`: its keywords): each shard holds the pages of its sequences
    (split over "data") and kv heads (over "model", see `plan_for`) on its own pool. Returns the model placed
    on `mesh` and the `SavedState`, which `kvjax.generate_from_state(model, saved, ...)` continues there. A
    saved batch the data axis does not divide is refused, or with `pad_rows=True` padded with copies of its
    first sequence (answers of the saved batch only). (`kvjax.save_state` takes a state on a mesh as is.)"""
    model, plan = _placed(model, mesh, on_indivisible)
    return model, load_state(path, model, backend=_backend(mesh, plan), **options)


def generate_sharded(
    model: Model,
    prompt_ids,
    max_new_tokens: int = 8,
    policy: Policy | None = None,
    *,
    mesh: Mesh,
    on_indivisible: str = "error",
    decode_last: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    page_size: int = 16,
    capacity: int | None = None,
    chunk_size: int = 512,
    eos_token_id: int | Sequence[int] | None = None,
    return_logprobs: bool = False,
    steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH,
):
    """`kvjax.generate` over a ("data", "model") mesh (`kvjax.distributed.make_mesh`): same arguments
    and results. Heads and the MLP are split over "model", sequences over "data" (see `plan_for` for
    `on_indivisible`); each device keeps the KV pages of its own sequences and heads."""
    model, plan = _placed(model, mesh, on_indivisible)
    given = as_token_lists(prompt_ids, model.cfg.vocab_size)
    result = generate_rows(
        model, _padded_rows(given, plan.data), max_new_tokens, policy_or_full(policy), decode_last=decode_last,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, page_size=page_size, capacity=capacity,
        chunk_size=chunk_size, eos_token_id=eos_token_id, return_logprobs=return_logprobs,
        backend=_backend(mesh, plan), steps_per_dispatch=steps_per_dispatch,
    )
    n = len(given)
    return (result[0][:n], result[1][:n]) if return_logprobs else result[:n]
