"""Generation over a ("data", "model") mesh: the single-device step, with the paged KV work per shard.

The model's dense parts (projections, MLP, norms, logits) run under `jit` on parameters sharded by
`kvjax.distributed.mesh`; XLA's SPMD partitioner places them and adds the all-reduces. Everything that
touches the paged KV state (allocation, appends, attention over pages, compaction, decode-time eviction)
runs per shard under `shard_map`, on the unmodified single-device functions, over the shard's own pool:
no K/V page ever crosses devices. A policy's *decisions* (`compress_layer`, `decode_scores`) are taken on
the global `LayerView` (shard outputs seen as one `[B, H, ...]` array), so methods that look across heads
(TOVA's head average, Ada-KV's per-layer split) choose exactly what they choose on one device; only
their small score arrays move. Page selection (`select_pages`, Quest) is per head and runs per shard.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.cache.compaction import compact_layer, evict_one_slot
from kvjax.models.config import ModelConfig
from kvjax.distributed.mesh import AXES, DATA, ShardingPlan, plan_for, shard_params
from kvjax.distributed.state import head_axis, init_sharded_state, per_shard, sharded_overflow_error, state_spec
from kvjax.engine.generation import (
    DEFAULT_STEPS_PER_DISPATCH,
    as_token_lists,
    bucketed,
    generate_rows,
    policy_or_full,
    prefill_rows,
)
from kvjax.models.loading import Model
from kvjax.policies import LayerView, Policy
from kvjax.cache.state import KVState, allocate_for_append
from kvjax.engine.step import (
    StepBackend,
    append_and_attend,
    compress_segments,
    decode_victim,
    forward_chunk,
    layer_roles,
    layer_view,
    over_decode_budget,
    scan_layers,
)

# KVState fields allocate_for_append changes besides `overflow` (restored when another shard failed)
_ALLOCATION_FIELDS = ("page_table", "num_free", "refcount", "kmin", "kmax", "slot_pos", "slot_score")
_SLOT_FIELDS = ("k", "slot_pos", "valid", "slot_score", "lengths")  # a view's [B, H, ...] slot arrays


def _view_specs(heads, fields) -> dict:
    """Specs of a LayerView's arrays `fields`, batch over "data" and heads (kv, or query) over `heads`."""
    specs = {"k": P(DATA, heads, None, None), "slot_pos": P(DATA, heads, None), "valid": P(DATA, heads, None),
             "slot_score": P(DATA, heads, None), "lengths": P(DATA, heads), "q": P(DATA, heads, None),
             "row_max": P(DATA, heads), "row_sum": P(DATA, heads), "read": P(DATA, heads, None, None)}
    return {name: specs[name] for name in fields}


def _view_parts(state: KVState, layer, num_layers: int, next_position, **extra) -> dict:
    view = layer_view(state, layer, num_layers, next_position, **extra)
    return {name: getattr(view, name) for name in _SLOT_FIELDS + tuple(extra)}


def _with_next_position(state: KVState, seen: jax.Array) -> KVState:
    Sd, Sm, b = state.next_position.shape
    return state.replace(next_position=jnp.broadcast_to(seen.reshape(Sd, 1, b), (Sd, Sm, b)))


@functools.partial(
    jax.jit, static_argnames=("cfg", "dtype", "policy", "mesh", "plan"), donate_argnames=("state", "window")
)
def _sharded_append_step(
    params, state: KVState, window, tokens, num_new, last_logits, policy_params=None, *, cfg: ModelConfig, dtype,
    policy: Policy, mesh: Mesh, plan: ShardingPlan,
):
    """`kvjax.engine.step.append_step` on a stacked state (see kvjax.distributed.state): same arguments and
    results, `tokens int32[B, C]` with B a multiple of the data axis."""
    B, C = tokens.shape
    decoding = C == 1
    S, H = state_spec(plan), head_axis(plan)
    rows, heads4, scalar = P(DATA), P(DATA, None, H, None), P()
    positions = state.next_position[:, 0].reshape(B)[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]

    def allocate(st, n):
        new, ok = allocate_for_append(st, n, C)
        # one step appends everywhere or nowhere, as on one device: a shard that got its pages gives them
        # back when any other shard could not
        ok_all = jax.lax.pmin(ok.astype(jnp.int32), AXES) > 0
        restored = {f: jnp.where(ok_all, getattr(new, f), getattr(st, f)) for f in _ALLOCATION_FIELDS}
        return new.replace(**restored), jnp.where(ok_all, n, 0)

    state, num_new = per_shard(allocate, mesh, (S, rows), (S, rows))(state, num_new)
    seen = state.next_position[:, 0].reshape(B) + num_new

    def attend_for(start: int, stop: int):
        roles = layer_roles(policy, start, decoding)
        # the view a decode-time eviction decides on: slots, and the step's attention statistics
        fields = (_SLOT_FIELDS + ("q", "row_max", "row_sum") + (("read",) if roles.selects else ())) if roles.evict else ()

        def attend(layer, inputs, state):
            # a per-token score (Locret's heads read every head's features): computed globally, stored per shard
            score = roles.chunks.score(layer, inputs, policy_params) if roles.chunks is not None else None

            # the traced layer index enters each shard as an argument (replicated), not by closure
            def local(st, layer, q, k, v, pos, n, next_position, *score):
                st, out, view = append_and_attend(
                    st, layer, q, k, v, pos, n, policy=policy, decoding=decoding, selects=roles.selects,
                    accumulate=roles.accumulate, evict=roles.evict, score=score[0] if score else None,
                    num_layers=cfg.num_layers, next_position=next_position,
                )
                return st, out, {name: getattr(view, name) for name in fields}

            args = (state, layer, inputs.q, inputs.k, inputs.v, inputs.positions, num_new, seen)
            in_specs = (S, scalar, heads4, heads4, heads4, P(DATA, None), rows, rows)
            if score is not None:
                args, in_specs = args + (score,), in_specs + (P(DATA, None, H),)
            out_specs = (S, heads4, _view_specs(H, fields))
            state, out, parts = per_shard(local, mesh, in_specs, out_specs)(*args)
            if roles.evict:
                view = LayerView(layer=layer, num_layers=cfg.num_layers, next_position=seen, **parts)

                def evict(st, layer, victim, keys):
                    return evict_one_slot(st, layer, victim, over_decode_budget(st, layer, policy), keys)

                state = per_shard(evict, mesh, (S, scalar, P(DATA, H), P(DATA, H, None, None)), S)(
                    state, layer, decode_victim(policy, view), view.k
                )
            return out, state

        return attend

    state, window, logits = forward_chunk(
        params, cfg, dtype, policy, tokens, positions, num_new, last_logits, state, window, attend_for
    )
    state = jax.lax.with_sharding_constraint(_with_next_position(state, seen), NamedSharding(mesh, S))
    return state, window, logits


@functools.partial(
    jax.jit, static_argnames=("num_layers", "policy", "keep_bound", "read_pages", "mesh", "plan", "windows"),
    donate_argnames=("state",),
)
def _sharded_compress_step(
    state: KVState, window, final=None, *, num_layers: int, policy: Policy, keep_bound: int, read_pages: tuple,
    mesh: Mesh, plan: ShardingPlan, windows: tuple = (),
):
    """`kvjax.engine.step.compress_step` on a stacked state: the policy sees the global view of each layer;
    compaction runs per shard. `final bool[B]` as there (per-chunk compression). Models with sliding
    windows are refused before (`_placed`), so `windows` holds only zeros here."""
    S, H = state_spec(plan), head_axis(plan)
    B = state.next_position.shape[0] * state.next_position.shape[2]
    next_position = state.next_position[:, 0].reshape(B)
    for start, stop in compress_segments(policy, state, num_layers):

        def body(state, layer, start=start, stop=stop):
            local = state.for_layers(start, stop)
            parts = per_shard(
                lambda st, layer, nxt: _view_parts(st, layer, num_layers, nxt), mesh, (S, P(), P(DATA)),
                _view_specs(H, _SLOT_FIELDS),
            )(local, layer, next_position)
            extra = {} if window is None else {"window_q": window["q"][layer], "window_pos": window["pos"]}
            view = LayerView(
                layer=layer, num_layers=num_layers, next_position=next_position, final_chunk=final, **parts, **extra
            )
            keep_slots, keep_count = policy.compress_layer(view, keep_bound)
            local = per_shard(
                lambda st, layer, slots, count: compact_layer(st, layer, slots, count), mesh,
                (S, P(), P(DATA, H, None), P(DATA, H)), S,
            )(local, layer, keep_slots, keep_count)
            return local.replace(read_pages=state.read_pages)

        state = scan_layers(body, state, start, stop)
    return state.replace(read_pages=read_pages)


# --------------------------------------------------------------------------------------------- host


def _padded_rows(rows: list[np.ndarray], data: int) -> list[np.ndarray]:
    """Pad the batch to a multiple of the data axis with copies of the first prompt (dropped later)."""
    return rows + [rows[0]] * (-len(rows) % data)


@functools.lru_cache(maxsize=16)
def _backend(mesh: Mesh, plan: ShardingPlan) -> StepBackend:
    """The host loops of `kvjax.engine.generation` with a stacked state on `mesh` and the sharded steps. Cached: the
    step is a static argument of `kvjax.engine.decode_loop.decode_steps`, so one (mesh, plan) keeps one program."""
    batch = NamedSharding(mesh, P(DATA))

    def new_state(cfg, B, capacity, page_size, num_pages, dtype, long_rope, read_pages):
        return init_sharded_state(cfg, B, capacity, page_size, mesh, plan, num_pages, dtype, long_rope, read_pages)

    return StepBackend(
        new_state,
        functools.partial(_sharded_append_step, mesh=mesh, plan=plan),
        functools.partial(_sharded_compress_step, mesh=mesh, plan=plan),
        sharded_overflow_error,
        lambda x: jax.device_put(x, batch),
    )


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
    if capacity is None:
        declared, reserve, capacity = longest + max_new_tokens, max_new_tokens, bucketed(longest + max_new_tokens)
    else:
        declared, reserve = capacity, 0
    state, logits = prefill_rows(
        model, rows, policy, page_size, capacity, chunk_size, declared, reserve, _backend(mesh, plan)
    )
    return state, logits, plan


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
        model, _padded_rows(given, plan.data), max_new_tokens, policy, decode_last=decode_last,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, page_size=page_size, capacity=capacity,
        chunk_size=chunk_size, eos_token_id=eos_token_id, return_logprobs=return_logprobs,
        backend=_backend(mesh, plan), steps_per_dispatch=steps_per_dispatch,
    )
    n = len(given)
    return (result[0][:n], result[1][:n]) if return_logprobs else result[:n]
