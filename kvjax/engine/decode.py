"""The decode step (`append_token`): a loop over layers, each read top to bottom (write, select, attend,
score/evict) between the model's two halves; and what prefill shares with it (`OneDevice`, `layer_segments`).

Notes: docs/modules.md (`kvjax/engine/decode.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.cache.attention import decode_attention, read_slots
from kvjax.cache.compaction import evict_one_slot
from kvjax.cache.state import KVState, add_slot_scores, allocate_for_append, append_to_layer, gather_layer
from kvjax.models.config import ModelConfig
from kvjax.models.rope import rope_frequencies
from kvjax.models.transformer import embed, final_logits, layer_inputs, layer_output
from kvjax.policies import DecodeView, PageView, Policy, PromptView, layer_roles


# ------------------------------------------------------------------------------------------ placement

# The arrays the steps hand to their page work carry layouts, one letter per axis (b batch rows, h heads,
# c chunk tokens, s slots, d head dim; "" a scalar, "state" a whole KVState; `VIEW_LAYOUTS` below).
# One device ignores them; a mesh (`kvjax.distributed`) splits b over "data" and h over "model".
# KVState fields `allocate_for_append` changes besides `overflow` (restored when another shard failed)
_ALLOCATION_FIELDS = ("page_table", "num_free", "refcount", "kmin", "kmax", "slot_pos", "slot_score")


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """Where the steps' state lives: here one whole `KVState` on one device. Every call that reads or writes
    pages goes through `per_shard(fn, in_layouts, out_layouts)`; a policy's decisions (`compress_layer`,
    `decode_scores`) run outside it on the whole `PromptView` / `DecodeView`. `kvjax.distributed.MeshPlacement` runs the
    same calls per shard of a stacked state under `shard_map`, so the steps below are written once."""

    sharded = False

    def per_shard(self, fn: Callable, in_layouts: tuple, out_layouts) -> Callable:
        return fn

    def all_shards(self, ok: jax.Array) -> jax.Array:
        """Inside `per_shard`: whether `ok` holds on every shard."""
        return ok

    def next_position(self, state: KVState) -> jax.Array:
        """int32[B]: each sequence's next position."""
        return state.next_position

    def with_next_position(self, state: KVState, next_position: jax.Array) -> KVState:
        return state.replace(next_position=next_position)


ONE_DEVICE = OneDevice()


def allocate_everywhere(state: KVState, num_new, *, C: int, placement: OneDevice):
    """`allocate_for_append` with one rule kept across shards: a step appends everywhere or nowhere (a shard
    that got its pages while another could not gives them back). Returns `(state, num_new or 0)`."""
    new, ok = allocate_for_append(state, num_new, C)
    if placement.sharded:
        ok = placement.all_shards(ok)
        new = new.replace(**{f: jnp.where(ok, getattr(new, f), getattr(state, f)) for f in _ALLOCATION_FIELDS})
    return new, jnp.where(ok, num_new, 0)


# ------------------------------------------------------------------------------------------- the step


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "policy", "placement"), donate_argnames=("state",))
def append_token(params, state: KVState, tokens, num_new, last_logits, *, cfg: ModelConfig, dtype, policy: Policy,
                 placement: OneDevice = ONE_DEVICE) -> tuple[KVState, jax.Array]:
    """A decode step: append `tokens int32[B]` (a row with `num_new int32[B]` 0 appends nothing and keeps
    `last_logits f32[B, V]`) to every layer, the policy's selection and decode-time eviction applying.
    `params` is the model's parameter tree; `placement` where the state lives (`OneDevice`, or a mesh's
    stacked state, `kvjax.distributed.MeshPlacement`). Returns `(state, logits f32[B, V])`. Donates `state`."""
    allocate = functools.partial(allocate_everywhere, C=1, placement=placement)
    state, num_new = placement.per_shard(allocate, ("state", "b"), ("state", "b"))(state, num_new)
    positions = placement.next_position(state)[:, None]  # int32[B, 1]
    next_position = positions[:, 0] + num_new
    plans = decode_plans(policy, layer_segments(policy, state, cfg.num_layers, cfg.windows), cfg.windows)
    state, logits = decode_forward(params, state, tokens[:, None], positions, num_new, next_position, plans, cfg=cfg,
                                   dtype=dtype, policy=policy, placement=placement,
                                   rope=rope_frequencies(cfg, state.long_rope))
    logits = jnp.where((num_new > 0)[:, None], logits, last_logits)
    return placement.with_next_position(state, next_position), logits


def layer_segments(policy: Policy, state: KVState, num_layers: int, windows: tuple = ()) -> tuple[tuple[int, int], ...]:
    """Runs `(start, stop)` of layers the step treats alike at trace time: the roles `policy` plays in them
    (`layer_roles`), how many pages they read and their sliding window (`windows`, the
    model's `ModelConfig.windows`; empty: none). Usually one or two runs (dense layers first), so the
    steps' compile time does not grow with depth (a model alternating windows, Gemma-2's, has one run a
    layer)."""
    key = [(layer_roles(policy, l), state.layer_read_pages(l), windows[l] if windows else 0) for l in range(num_layers)]
    starts = [l for l in range(num_layers) if l == 0 or key[l] != key[l - 1]]
    return tuple(zip(starts, starts[1:] + [num_layers]))


class DecodePlan(NamedTuple):
    """What a decode step does in layers `start .. stop - 1` (static, derived once from the policy's roles)."""

    start: int
    stop: int
    sliding: int  # the layers' sliding window (0: none; no policy acts there)
    selects: bool  # read only what the policy's selector chooses
    slots: bool  # the policy's selector lists single slots (`Selector.unit`): the pool is read as one-slot pages
    accumulate: bool  # add each slot's attention to its score (H2O)
    evict: bool  # drop a slot of each head over the decode budget
    view_fields: tuple  # the `DecodeView` fields the shards return for the evictor


# the slot fields of `PromptView` and `DecodeView`, per slot `[B, H, ...]`, and the step's attention statistics
SLOT_FIELDS = ("k", "slot_pos", "valid", "slot_score", "lengths")
STAT_FIELDS = ("q", "row_max", "row_sum")
# their layouts, one letter per axis (b batch rows, h heads, s slots, d head dim), for a mesh's shards
VIEW_LAYOUTS = {"k": "bhsd", "slot_pos": "bhs", "valid": "bhs", "slot_score": "bhs", "lengths": "bh", "q": "bhd",
                "row_max": "bh", "row_sum": "bh", "read": "bhsd"}
STEP_LAYOUTS = ("state", "", "bchd", "bchd", "bchd", "bc", "b")  # state, layer, q, k, v, positions, num_new


def decode_plans(policy: Policy, segments, windows: tuple) -> tuple[DecodePlan, ...]:
    """One `DecodePlan` per run of alike layers (`segments`, `layer_segments`), from the roles
    the policy plays there (`layer_roles`); a sliding-window layer's own rule replaces them."""
    slots = policy.selector is not None and policy.selector.unit == "slot"
    plans = []
    for start, stop in segments:
        sliding = windows[start] if windows else 0
        roles = layer_roles(policy, start)
        compressed, evict, selects = (role and not sliding for role in (roles.compress, roles.evict, roles.select))
        fields = SLOT_FIELDS + STAT_FIELDS + (("read",) if selects else ()) if evict else ()
        accumulate = compressed and policy.compressor.accumulates_attention
        plans.append(DecodePlan(start, stop, sliding, selects, slots, accumulate, evict, fields))
    return tuple(plans)


def decode_forward(params, state: KVState, tokens, positions, num_new, next_position, plans, *, cfg: ModelConfig,
                   dtype, policy: Policy, placement, rope) -> tuple[KVState, jax.Array]:
    """The model over one token per row `tokens int32[B, 1]` at `positions int32[B, 1]` (rows with `num_new`
    0 write nothing; `next_position int32[B]` after it) whose pages are allocated: embed, each plan's
    layers (`decode_layer`), final norm and logits. Returns `(state, logits f32[B, V])`."""
    layers = params["layers"]

    def one_layer(layer, plan, state, x):
        x, state = decode_layer(layers, layer, x, state, positions, num_new, next_position, plan, cfg=cfg, dtype=dtype,
                                policy=policy, placement=placement, rope=rope)
        return state, x

    state, x = over_layers(plans, one_layer, state, embed(params, cfg, dtype, tokens))
    return state, final_logits(params, cfg, dtype, x[:, 0])


def over_layers(plans, one_layer, state: KVState, carry):
    """`state, carry = one_layer(layer, plan, local, carry)` for each plan's layers in order (a plan: any
    static record with `start` and `stop`), `local` being the state with the plan's read bound
    (`KVState.for_layers`, the whole tuple restored after). A plan's layers are scanned with the layer
    index traced; a one-layer plan runs once with it as a Python int. Returns `(state, carry)`."""
    for plan in plans:

        def body(state_carry, layer, plan=plan):
            state, carry = state_carry
            local, carry = one_layer(layer, plan, state.for_layers(plan.start, plan.stop), carry)
            return (local.replace(read_pages=state.read_pages), carry), None

        if plan.stop - plan.start == 1:
            (state, carry), _ = body((state, carry), plan.start)
        else:
            indices = jnp.arange(plan.start, plan.stop, dtype=jnp.int32)
            (state, carry), _ = jax.lax.scan(body, (state, carry), indices)
    return state, carry


def decode_layer(layers, layer, x, state: KVState, positions, num_new, next_position, plan: DecodePlan, *,
                 cfg: ModelConfig, dtype, policy: Policy, placement, rope) -> tuple[jax.Array, KVState]:
    """One layer of a decode step, `x [B, 1, E]` -> `(x, state)`: the model's first half (norm, q/k/v,
    RoPE), then on the layer's pages write the new k/v, select pages, attend; then evict over budget; then
    the model's second half (o_proj, MLP)."""
    inputs = layer_inputs(layers, layer, cfg, dtype, x, positions, rope, first=plan.start, stop=plan.stop)
    on_pages = functools.partial(attend_in_window if plan.sliding else write_select_attend, policy=policy, plan=plan,
                                 num_layers=cfg.num_layers)
    out_layouts = ("state", "bchd", {name: VIEW_LAYOUTS[name] for name in plan.view_fields})
    state, out, parts = placement.per_shard(on_pages, STEP_LAYOUTS, out_layouts)(
        state, layer, inputs.q, inputs.k, inputs.v, positions, num_new)
    if plan.evict:
        evictor = policy.evictor
        view = DecodeView(layer=layer, num_layers=cfg.num_layers, next_position=next_position, **parts)
        victim = jnp.argmin(jnp.where(view.valid, evictor.decode_scores(view), jnp.inf), axis=-1).astype(jnp.int32)
        evict = functools.partial(evict_over_budget, budget=evictor.decode_budget)
        state = placement.per_shard(evict, ("state", "", "bh", "bhsd"), "state")(state, layer, victim, view.k)
    return layer_output(layers, layer, cfg, dtype, x, out, first=plan.start, stop=plan.stop), state


def write_select_attend(state: KVState, layer, q, k, v, positions, num_new, *, policy: Policy, plan: DecodePlan,
                        num_layers: int):
    """On one state (or one shard's): write the token's k/v `[B, 1, H, D]`, choose the pages to read, attend
    with `q [B, 1, Hq, D]`. Returns `(state, out [B, 1, Hq, D], the plan's view fields)`."""
    state = append_to_layer(state, layer, k, v, positions, num_new, sketch=new_sketch_rows(policy, state, layer, k))
    pages = policy.selector.select_pages(page_view(state, layer, num_layers, q[:, 0])) if plan.selects else None
    if not (plan.accumulate or plan.evict):
        return state, decode_attention(q, state, layer, pages, slots=plan.slots), {}
    out, row_max, row_sum = decode_attention(q, state, layer, pages, return_stats=True)
    read = None if pages is None else read_slots(pages, state.lengths[layer], state.page_size,
                                                 state.layer_read_pages(layer))
    view = DecodeView(layer=layer, num_layers=num_layers, next_position=positions[:, 0] + num_new,
                      **slot_fields(state, layer), q=q[:, 0], row_max=row_max, row_sum=row_sum, read=read)
    if plan.accumulate:  # H2O: every query's attention, summed over the group, adds to the slot's score
        delta = view.probs.sum(axis=2) * (num_new > 0)[:, None, None]  # [B, H, S]
        state = add_slot_scores(state, layer, delta)
        view = view._replace(slot_score=view.slot_score + delta)
    return state, out, {name: getattr(view, name) for name in plan.view_fields}


def attend_in_window(state: KVState, layer, q, k, v, positions, num_new, *, policy: Policy, plan: DecodePlan,
                     num_layers: int):
    """A decode step in a sliding-window layer of `plan.sliding` tokens: write, attend over every slot
    (exactly the window), then drop each head's oldest slot once it holds a whole window (a hole the next
    token fills), so the layer frees its pages as the window moves. Shapes as `write_select_attend`."""
    state = append_to_layer(state, layer, k, v, positions, num_new)
    out = decode_attention(q, state, layer)
    keys, _, slot_pos, valid = gather_layer(state, layer)  # [B, H, S, D], [B, H, S]
    oldest = jnp.argmin(jnp.where(valid, slot_pos, jnp.iinfo(jnp.int32).max), axis=-1).astype(jnp.int32)
    full = state.lengths[layer] - (state.hole[layer] >= 0) >= plan.sliding  # [B, H]
    return evict_one_slot(state, layer, oldest, full, keys), out, {}


def evict_over_budget(state: KVState, layer, victim, keys, *, budget: int) -> KVState:
    """Drop slot `victim int32[B, H]` of each head holding more than `budget` slots (a pending hole aside)."""
    over = state.lengths[layer] - (state.hole[layer] >= 0) > budget
    return evict_one_slot(state, layer, victim, over, keys)


# ------------------------------------------------------------------------------------------ views


def new_sketch_rows(policy: Policy, state: KVState, layer, k):
    """The key-sketch rows of new keys `k [B, C, H, D]` the append writes (`Selector.sketch_keys`), or None
    when the state has no sketch or the policy's selector keeps none."""
    selector = policy.selector
    if state.key_sketch is None or selector is None or not selector.keeps_key_sketch:
        return None
    return selector.sketch_keys(state.key_sketch, layer, k)


def slot_fields(state: KVState, layer) -> dict:
    """The slot fields (`SLOT_FIELDS`) of one layer's `PromptView` or `DecodeView`: `[B, H, S]` slots in
    logical order; `layer` may be traced (the state's read bound must then be the same for every layer)."""
    k, _, slot_pos, valid = gather_layer(state, layer)
    P = state.layer_read_pages(layer)
    score = state.slot_score[jnp.clip(state.page_table[layer, :, :, :P], 0, state.num_pages - 1)]
    return {"k": k, "slot_pos": slot_pos, "valid": valid, "slot_score": score.reshape(slot_pos.shape),
            "lengths": state.lengths[layer]}


def prompt_view(state: KVState, layer, num_layers: int, next_position, final_chunk=None, last_queries=None,
                pool_threshold=None, slots: dict | None = None) -> PromptView:
    """One layer's `PromptView`: `next_position int32[B]`, `final_chunk bool[B]` (None: every sequence's last
    chunk), `last_queries` the prefill's carry (`engine.step.new_last_queries`, or None), `pool_threshold
    f32[B]` or None, `slots` the layer's `slot_fields` (None: gathered here from `state`; a mesh gathers them
    per shard)."""
    if final_chunk is None:
        final_chunk = jnp.ones(next_position.shape, bool)
    extra = {} if last_queries is None else {"window_q": last_queries["q"][layer], "window_pos": last_queries["pos"]}
    slots = slot_fields(state, layer) if slots is None else slots
    return PromptView(layer=layer, num_layers=num_layers, next_position=next_position, final_chunk=final_chunk,
                      pool_threshold=pool_threshold, **slots, **extra)


def page_view(state: KVState, layer, num_layers: int, q) -> PageView:
    """What a selector reads at a decode step (`PageView`): the query `q [B, Hq, D]` and the layer's page
    metadata (the table up to its read bound, the pool's keys and their min/max, the key sketch if any)."""
    P = state.layer_read_pages(layer)
    return PageView(
        layer=layer, num_layers=num_layers, lengths=state.lengths[layer], q=q,
        page_table=state.page_table[layer, :, :, :P], page_size=state.page_size, kmin=state.kmin, kmax=state.kmax,
        k_pages=state.k_pages, key_sketch=state.key_sketch,
    )


__all__ = ["DecodePlan", "ONE_DEVICE", "OneDevice", "SLOT_FIELDS", "VIEW_LAYOUTS", "allocate_everywhere",
           "append_token", "attend_in_window", "decode_forward", "decode_layer", "decode_plans", "evict_over_budget",
           "layer_segments", "new_sketch_rows", "over_layers", "page_view", "prompt_view", "slot_fields",
           "write_select_attend"]
