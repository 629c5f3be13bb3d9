"""The prefill steps (`append_chunk`: a chunk's loop over layers, read top to bottom as a decode step's is;
`compress_step`) and the host loops' `StepBackend`.

Notes: docs/modules.md (`kvjax/engine/step.py`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.cache.attention import attention_column_sums, blocked_paged_attention
from kvjax.cache.compaction import compact_layer
from kvjax.engine.decode import (
    ONE_DEVICE, SLOT_FIELDS, VIEW_LAYOUTS, OneDevice, allocate_everywhere, append_token, layer_segments,
    new_sketch_rows, over_layers, prompt_view, slot_fields,
)
from kvjax.models.config import ModelConfig
from kvjax.models.rope import rope_frequencies
from kvjax.models.transformer import embed, final_logits, layer_inputs, layer_output
from kvjax.policies import Policy, layer_roles
from kvjax.cache.state import (
    KVState,
    add_slot_scores,
    append_to_layer,
    gather_layer,
    init_state,
    overflow_error,
)

# ------------------------------------------------------------------------------------------- per layer


def append_and_attend(state: KVState, layer, q, k, v, positions, num_new, *, policy: Policy, accumulate: bool = False,
                      score=None):
    """One layer of a prefill chunk on one state (a whole state, or one shard's): write the chunk's k/v
    `[B, C, H, D]` at `positions int32[B, C]` (the first `num_new[b]` real), then attend with `q [B, C, Hq, D]`
    (`blocked_paged_attention`). `score f32[B, C, H]` becomes the new slots' `slot_score`. With `accumulate`
    (H2O) each slot's attention from the chunk's real queries (summed over the group) is added to
    `slot_score`, block by block (`attention_column_sums`). Returns `(state, out [B, C, Hq, D])`."""
    sketch = new_sketch_rows(policy, state, layer, k)  # a selector's per-slot key sketch
    state = append_to_layer(state, layer, k, v, positions, num_new, score=score, sketch=sketch)
    if not accumulate:
        return state, blocked_paged_attention(q, positions, state, layer)
    out, row_max, row_sum = blocked_paged_attention(q, positions, state, layer, return_stats=True)
    real = jnp.arange(q.shape[1])[None, :] < num_new[:, None]
    sums = attention_column_sums(q, positions, state, layer, row_max, row_sum, real)
    return add_slot_scores(state, layer, sums), out


def append_and_attend_sliding(state: KVState, layer, q, k, v, positions, num_new, *, sliding: int, next_position):
    """One layer of a prefill chunk in a layer with a sliding window of `sliding` tokens (a query at p sees
    p - sliding + 1 .. p): attend with the window mask (`blocked_paged_attention`), then compact the layer
    to the tokens after `next_position - sliding` (`compact_layer`, pages freed), so such a layer never
    holds more than `sliding - 1 + C` slots (Jenga's point; a decode step's own rule is
    `kvjax.engine.decode.attend_in_window`). Shapes as `append_and_attend`; returns `(state, out)`."""
    state = append_to_layer(state, layer, k, v, positions, num_new)
    out = blocked_paged_attention(q, positions, state, layer, window=sliding)
    _, _, slot_pos, valid = gather_layer(state, layer)  # [B, H, S]
    keep = valid & (slot_pos > next_position[:, None, None] - sliding)  # at most sliding - 1 positions
    bound = max(1, min(sliding - 1, keep.shape[-1]))
    keep_slots = jnp.argsort(~keep, axis=-1, stable=True)[..., :bound].astype(jnp.int32)  # kept first, in slot order
    state = compact_layer(state, layer, keep_slots, keep.sum(-1).astype(jnp.int32))
    return state.replace(hole=state.hole.at[layer].set(-1)), out


class ChunkPlan(NamedTuple):
    """What a prefill chunk does in layers `start .. stop - 1` (static, derived once from the policy's roles)."""

    start: int
    stop: int
    sliding: int  # the layers' sliding window (0: none; no policy acts there)
    accumulate: bool  # every real query's attention is added to slot_score (H2O)
    schedule: Any  # the compressor's `ChunkSchedule`, whose per-token scores the new slots take (Locret), or None


def chunk_plans(policy: Policy, segments, windows: tuple) -> tuple[ChunkPlan, ...]:
    """One `ChunkPlan` per run of alike layers (`segments`, `layer_segments`), from the roles the policy
    plays there (`layer_roles`); a sliding-window layer's own rule replaces them."""
    plans = []
    for start, stop in segments:
        sliding = windows[start] if windows else 0
        compressor = policy.compressor if layer_roles(policy, start).compress and not sliding else None
        accumulate = compressor is not None and compressor.accumulates_attention
        plans.append(ChunkPlan(start, stop, sliding, accumulate, None if compressor is None else compressor.chunks))
    return tuple(plans)


# ------------------------------------------------------------------------------------ last queries


def keep_last(carry, chunk, num_new):
    """Each row's last w real entries of concat(carry, chunk): `carry [B, w, ...]`, `chunk [B, C, ...]`,
    `num_new int32[B]` real entries per chunk row."""
    w = carry.shape[1]
    rows = num_new[:, None] + jnp.arange(w)[None, :]  # [B, w] rows of the concatenation
    rows = rows.reshape(rows.shape + (1,) * (carry.ndim - 2))
    return jnp.take_along_axis(jnp.concatenate([carry, chunk.astype(carry.dtype)], axis=1), rows, axis=1)


def new_last_queries(cfg: ModelConfig, batch: int, size: int, dtype):
    """The prefill's carry of each sequence's last `size` queries per layer (what a compressor's
    `window_size` asks for: SnapKV's observation window): `{"q": [L, B, w, Hq, D], "pos": int32[B, w]}`
    (-1 before the prompt start), or None when the policy needs none."""
    if size <= 0:
        return None
    return {
        "q": jnp.zeros((cfg.num_layers, batch, size, cfg.num_heads, cfg.head_dim), dtype),
        "pos": jnp.full((batch, size), -1, jnp.int32),
    }


# ------------------------------------------------------------------------------------------- prefill


def prefill_forward(params, state: KVState, tokens, positions, num_new, next_position, last_queries, plans, *,
                    cfg: ModelConfig, dtype, policy: Policy, placement, rope, policy_params=None,
                    observe: Callable | None = None, observed=None):
    """The model over one prefill chunk `tokens int32[B, C]` at `positions int32[B, C]` (the first
    `num_new int32[B]` of each row real) whose pages are allocated: embed, each plan's layers
    (`prefill_layer`), final norm and logits at each row's last real token (any token of a row with none).
    Returns `(state, last_queries, logits f32[B, V], observed)`."""
    B, C = tokens.shape
    layers = params["layers"]

    def one_layer(layer, plan, state, carry):
        x, queries, observed = carry
        x, state, queries, observed = prefill_layer(
            layers, layer, x, state, positions, num_new, next_position, plan, queries, cfg=cfg, dtype=dtype,
            policy=policy, placement=placement, rope=rope, policy_params=policy_params, observe=observe,
            observed=observed,
        )
        return state, (x, queries, observed)

    queries = None if last_queries is None else last_queries["q"]
    state, (x, queries, observed) = over_layers(plans, one_layer, state,
                                                (embed(params, cfg, dtype, tokens), queries, observed))
    if last_queries is not None:
        last_queries = {"q": queries, "pos": keep_last(last_queries["pos"], positions, num_new)}
    logits = final_logits(params, cfg, dtype, x[jnp.arange(B), jnp.clip(num_new - 1, 0, C - 1)])
    return state, last_queries, logits, observed


def prefill_layer(layers, layer, x, state: KVState, positions, num_new, next_position, plan: ChunkPlan, queries, *,
                  cfg: ModelConfig, dtype, policy: Policy, placement, rope, policy_params=None,
                  observe: Callable | None = None, observed=None):
    """One layer of a prefill chunk, `x [B, C, E]` -> `(x, state, queries, observed)`: the model's first
    half (norm, q/k/v, RoPE), then on the layer's pages write the chunk's k/v (with the schedule's
    per-token scores) and attend (adding H2O's attention sums), then the chunk's queries into the carry of
    last queries (`queries [L, B, w, Hq, D]` or None), `observe` (`append_chunk`), the model's second half."""
    inputs = layer_inputs(layers, layer, cfg, dtype, x, positions, rope, first=plan.start, stop=plan.stop)
    args = (state, layer, inputs.q, inputs.k, inputs.v, positions, num_new, next_position)
    layouts = ("state", "", "bchd", "bchd", "bchd", "bc", "b", "b")  # the traced layer enters a shard as an argument
    if plan.sliding:
        def on_pages(state, layer, q, k, v, positions, num_new, next_position):
            return append_and_attend_sliding(state, layer, q, k, v, positions, num_new, sliding=plan.sliding,
                                             next_position=next_position)
    else:
        if plan.schedule is not None:  # a per-token score (Locret's heads read every head's features)
            args, layouts = args + (plan.schedule.score(layer, inputs, policy_params),), layouts + ("bch",)

        def on_pages(state, layer, q, k, v, positions, num_new, next_position, score=None):
            return append_and_attend(state, layer, q, k, v, positions, num_new, policy=policy,
                                     accumulate=plan.accumulate, score=score)

    state, out = placement.per_shard(on_pages, layouts, ("state", "bchd"))(*args)
    if queries is not None:
        queries = queries.at[layer].set(keep_last(queries[layer], inputs.q, num_new))
    if observe is not None:
        observed = observe(layer, inputs, state, observed)
    return layer_output(layers, layer, cfg, dtype, x, out, first=plan.start, stop=plan.stop), state, queries, observed


def scan_layers(body: Callable[[Any, Any], Any], carry, start: int, stop: int):
    """`carry = body(carry, layer)` for layers start .. stop - 1, scanned (the layer index traced)."""
    carry, _ = jax.lax.scan(lambda c, layer: (body(c, layer), None), carry, jnp.arange(start, stop, dtype=jnp.int32))
    return carry


# ---------------------------------------------------------------------------------------------- steps


@functools.partial(
    jax.jit, static_argnames=("cfg", "dtype", "policy", "placement", "observe"),
    donate_argnames=("state", "last_queries"),
)
def append_chunk(
    params, state: KVState, last_queries, tokens, num_new, last_logits, policy_params=None, *, cfg: ModelConfig,
    dtype, policy: Policy, placement: OneDevice = ONE_DEVICE, observe: Callable | None = None, observed=None,
):
    """A prefill chunk: append `tokens int32[B, C]` (the first `num_new int32[B]` of each row are real) to
    every layer and attend (`prefill_forward`). `params` is the model's parameter tree, `last_queries` the
    prefill's carry of last queries (`new_last_queries`, or None), `last_logits f32[B, V]` the logits to
    keep for rows with nothing new, `policy_params` the arrays of the compressor's chunk schedule
    (`compressor.chunks.params`, Locret's heads), else None. `placement`: where the state lives
    (`OneDevice`, or a mesh's stacked state, `kvjax.distributed.MeshPlacement`). A decode step, where the
    policy's page selection and decode-time eviction apply, is `kvjax.engine.decode.append_token`. Returns
    the state, the carry of last queries and logits `f32[B, V]` at each row's last real token.

    `observe(layer, inputs, state, observed) -> observed` (one device) sees each layer's `AttentionInputs`
    and its state after the append, and updates the caller's carry `observed` (arrays with a leading `[L]`
    axis: the layers run in a scan); the step then returns `observed` as a fourth value. Locret's labels
    record their features and score the answer this way, through the same step as generation.
    """
    C = tokens.shape[1]
    allocate = functools.partial(allocate_everywhere, C=C, placement=placement)
    state, num_new = placement.per_shard(allocate, ("state", "b"), ("state", "b"))(state, num_new)
    start = placement.next_position(state)  # int32[B]: each row's first new position
    next_position = start + num_new
    plans = chunk_plans(policy, layer_segments(policy, state, cfg.num_layers, cfg.windows), cfg.windows)
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    state, last_queries, logits, observed = prefill_forward(
        params, state, tokens, positions, num_new, next_position, last_queries, plans, cfg=cfg, dtype=dtype,
        policy=policy, placement=placement, rope=rope_frequencies(cfg, state.long_rope), policy_params=policy_params,
        observe=observe, observed=observed,
    )
    logits = jnp.where((num_new > 0)[:, None], logits, last_logits)
    state = placement.with_next_position(state, next_position)
    return (state, last_queries, logits) if observe is None else (state, last_queries, logits, observed)


def compressor_acts(policy: Policy, layer: int, windows: tuple = ()) -> bool:
    """Whether the policy compresses `layer`: one its compressor acts in, outside a sliding window (`windows`,
    the model's `ModelConfig.windows`), whose own eviction rules there."""
    return layer_roles(policy, layer).compress and not (windows and windows[layer])


def compress_segments(policy: Policy, state: KVState, num_layers: int, windows: tuple = ()) -> tuple[tuple[int, int], ...]:
    """The runs of `layer_segments` whose layers the policy compresses (`compressor_acts`)."""
    return tuple(
        (a, b) for a, b in layer_segments(policy, state, num_layers, windows) if compressor_acts(policy, a, windows)
    )


def pooled_threshold(state: KVState, policy: Policy, num_layers: int, windows: tuple, keep_bound: int) -> jax.Array:
    """f32[B]: the `compressor.pooled_budget * H * L'`-th best score among the candidates of the L' compressed
    layers' kv heads (-inf where they hold fewer): what a slot needs to be kept when the budget is pooled. A
    head's candidates are its `keep_bound` best valid slots, as many as it may keep, so a head the bound
    clips leaves its surplus to the others' next-best slots and the pool is filled exactly (ties at the
    threshold all kept)."""
    flat = []
    for start, stop in compress_segments(policy, state, num_layers, windows):
        local = state.for_layers(start, stop)

        def scores(layer, local=local):
            slots = slot_fields(local, layer)
            valid = jnp.where(slots["valid"], slots["slot_score"], -jnp.inf)  # [B, H, S]
            return jax.lax.top_k(valid, min(keep_bound, valid.shape[-1]))[0]  # [B, H, K]

        part = jax.lax.map(scores, jnp.arange(start, stop, dtype=jnp.int32))  # [l, B, H, K]
        flat.append(jnp.moveaxis(part, 1, 0).reshape(part.shape[1], -1))
        count = policy.compressor.pooled_budget * part.shape[2]  # per layer
    flat = jnp.concatenate(flat, axis=-1)  # [B, L' * H * K]
    count = min(count * sum(b - a for a, b in compress_segments(policy, state, num_layers, windows)), flat.shape[-1])
    return jax.lax.top_k(flat, count)[0][:, -1]


@functools.partial(
    jax.jit, static_argnames=("num_layers", "policy", "keep_bound", "read_pages", "windows", "placement"),
    donate_argnames=("state",),
)
def compress_step(
    state: KVState, last_queries, final=None, *, num_layers: int, policy: Policy, keep_bound: int,
    read_pages: tuple | None, windows: tuple = (), placement: OneDevice = ONE_DEVICE,
):
    """Apply the policy's keep sets (at most `keep_bound` slots per head, static; a per-layer budget below
    it, PyramidKV's, is data) to every compressed layer (none inside a sliding window of `windows`), then
    bound each layer's pages to `read_pages`. `last_queries` is the prefill's carry (`new_last_queries`, or
    None); `final bool[B]` (per-chunk compression): whether this was each sequence's last prefill chunk. The
    policy decides on each layer's whole view; the pages are compacted where they live (`placement`, as in
    `append_chunk`)."""
    compressor = policy.compressor
    next_position = placement.next_position(state)
    view_parts = placement.per_shard(slot_fields, ("state", ""), {name: VIEW_LAYOUTS[name] for name in SLOT_FIELDS})
    compact = placement.per_shard(compact_layer, ("state", "", "bhs", "bh"), "state")
    threshold = None
    if compressor.pooled_budget is not None:
        if placement.sharded:
            raise NotImplementedError(f"policy {policy.name!r}: a budget pooled over layers runs on one device "
                                      "(Locret: pool='head' budgets each kv head, on a mesh too)")
        threshold = pooled_threshold(state, policy, num_layers, windows, keep_bound)
    for start, stop in compress_segments(policy, state, num_layers, windows):

        def body(state, layer, start=start, stop=stop):
            local = state.for_layers(start, stop)
            view = prompt_view(local, layer, num_layers, next_position, final, last_queries, threshold,
                               slots=view_parts(local, layer))
            keep_slots, keep_count = compressor.compress_layer(view, keep_bound)
            return compact(local, layer, keep_slots, keep_count).replace(read_pages=state.read_pages)

        state = scan_layers(body, state, start, stop)
    return state.replace(read_pages=read_pages)


# -------------------------------------------------------------------------------------------- backend


class StepBackend(NamedTuple):
    """Where the host loop's state lives and which jitted steps advance it: one device (`LOCAL_BACKEND`) or a
    device mesh (`kvjax.distributed`, which stacks one state per shard). The prefill, decode and generate
    loops of `kvjax.engine.generation` are written once against it."""

    new_state: Callable[..., KVState]  # (cfg, B, capacity, page_size, num_pages, dtype, long_rope, read_pages)
    append_chunk: Callable  # `append_chunk`'s signature (a prefill chunk)
    append_token: Callable  # `kvjax.engine.decode.append_token`'s signature (a decode step)
    compress_step: Callable  # `compress_step`'s signature
    overflow_error: Callable[[KVState], Exception | None]
    put: Callable[[Any], jax.Array]  # a host array with a leading batch axis -> a device array
    fetch: Callable[[jax.Array], Any] = jax.device_get  # a step's output -> host numpy (on a mesh: gathered)
    placement: OneDevice = ONE_DEVICE  # the steps' placement, for other per-shard work on the state (rows)


def local_state(cfg, batch, capacity, page_size, num_pages, dtype, long_rope, read_pages) -> KVState:
    """An empty single-device state (`init_state`) with static per-layer read bounds `read_pages`."""
    state = init_state(cfg, batch, capacity, page_size, num_pages=num_pages, dtype=dtype, long_rope=long_rope)
    return state.replace(read_pages=read_pages)


# `put`: jax.device_put, not jnp.asarray, which builds a program per shape and dtype (JAX 0.10)
LOCAL_BACKEND = StepBackend(local_state, append_chunk, append_token, compress_step, overflow_error, jax.device_put)


__all__ = [
    "LOCAL_BACKEND",
    "ChunkPlan",
    "SLOT_FIELDS",
    "VIEW_LAYOUTS",
    "StepBackend",
    "append_and_attend",
    "append_and_attend_sliding",
    "append_chunk",
    "chunk_plans",
    "compress_segments",
    "compress_step",
    "compressor_acts",
    "keep_last",
    "local_state",
    "new_last_queries",
    "prefill_forward",
    "prefill_layer",
    "scan_layers",
]
