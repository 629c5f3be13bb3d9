"""Jit-compiled chunked prefill and decode over the paged KV state, and the public generation API.

One step function serves both: it appends a chunk of tokens `[B, C]` (C = chunk size for prefill, 1 for
decode) to every layer's pages and attends over them. Shapes are static (chunk size, capacity, page size);
lengths are arrays, so decoding never recompiles. The state is donated to each step.
"""

from __future__ import annotations

import collections
import functools
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import (
    blocked_paged_attention,
    dense_causal_attention,
    dense_decode_attention,
    paged_attention,
    sparse_decode_attention,
)
from kvjax.config import ModelConfig
from kvjax.loading import Model
from kvjax.models import CausalLM
from kvjax.compaction import compact_layer, evict_one_slot
from kvjax.policies import FullPolicy, LayerView, Policy
from kvjax.rope import rope_frequencies, uses_long_factors
from kvjax.sampling import sample_tokens, validate_sampling
from kvjax.state import (
    KVState,
    add_slot_scores,
    allocate_for_append,
    append_to_layer,
    CacheCapacityError,
    gather_layer,
    init_state,
    overflow_error,
    pages_for,
)

# How many times each jitted function was traced (i.e. compiled), by name and input shape. Tests use it to
# show that decode does not recompile as it goes.
TRACE_COUNTS: collections.Counter = collections.Counter()

DEFAULT_CHUNK_SIZE = 512
CAPACITY_BUCKET = 256  # default capacities round up to this many tokens, so nearby lengths share compiles


def _bucketed(tokens: int) -> int:
    return -(-tokens // CAPACITY_BUCKET) * CAPACITY_BUCKET


# ----------------------------------------------------------------------------------------------- steps


def _layer_view(state: KVState, layer: int, num_layers: int, next_position, **extra) -> LayerView:
    k, _, slot_pos, valid = gather_layer(state, layer)
    P = state.layer_read_pages(layer)
    score = state.slot_score[jnp.clip(state.page_table[layer, :, :, :P], 0, state.num_pages - 1)]
    return LayerView(
        layer=layer, num_layers=num_layers, k=k, slot_pos=slot_pos, valid=valid,
        slot_score=score.reshape(slot_pos.shape), lengths=state.lengths[layer], next_position=next_position,
        **extra,
    )


def _keep_last(window, chunk, num_new):
    """Each row's last w real entries of concat(window, chunk): `window [B, w, ...]`, `chunk [B, C, ...]`."""
    w = window.shape[1]
    rows = num_new[:, None] + jnp.arange(w)[None, :]  # [B, w] rows of the concatenation
    rows = rows.reshape(rows.shape + (1,) * (window.ndim - 2))
    return jnp.take_along_axis(jnp.concatenate([window, chunk.astype(window.dtype)], axis=1), rows, axis=1)


def new_window(cfg: ModelConfig, batch: int, size: int, dtype):
    """The prefill carry of the last `size` queries per layer (None when the policy needs none)."""
    if size <= 0:
        return None
    return {
        "q": jnp.zeros((cfg.num_layers, batch, size, cfg.num_heads, cfg.head_dim), dtype),
        "pos": jnp.full((batch, size), -1, jnp.int32),
    }


def _append_and_attend(state: KVState, layer: int, q, k, v, positions, num_new, *, policy: Policy, decoding: bool,
                       need_probs: bool, score=None):
    """One layer of an append step on one state (a whole state, or one shard's): write the chunk's k/v, then
    attend, through the policy's page selection when decoding. With `need_probs`, also the chunk's attention
    probabilities `f32[B, H, G, C, S]` (padding rows zeroed), added to `slot_score` for accumulating
    policies. Returns `(state, out [B, C, Hq, D], probs or None)`."""
    state = append_to_layer(state, layer, k, v, positions, num_new, score=score)
    selected = policy.select_pages(layer, q[:, 0], state) if decoding else None
    if selected is not None:
        return state, sparse_decode_attention(q, state, layer, selected), None
    if not need_probs:
        if decoding:
            return state, dense_decode_attention(q, state, layer), None
        return state, blocked_paged_attention(q, positions, state, layer), None
    out, probs = paged_attention(q, positions, state, layer, return_probs=True)
    real = (jnp.arange(q.shape[1])[None, :] < num_new[:, None])[:, None, None, :, None]
    probs = jnp.where(real, probs, 0.0)
    if policy.accumulates_attention:
        state = add_slot_scores(state, layer, probs.sum(axis=(2, 3)))
    return state, out, probs


def _decode_victim(policy: Policy, view: LayerView) -> jax.Array:
    """int32[B, H]: each head's lowest-scoring valid slot after a decode step (policies evicting while decoding)."""
    scores = jnp.where(view.valid, policy.decode_scores(view), jnp.inf)
    return jnp.argmin(scores, axis=-1).astype(jnp.int32)


def _over_decode_budget(state: KVState, layer: int, policy: Policy) -> jax.Array:
    """bool[B, H]: heads holding more than the policy's decode budget (a pending hole does not count)."""
    return state.lengths[layer] - (state.hole[layer] >= 0) > policy.decode_budget(0)


def _forward_chunk(params, cfg: ModelConfig, dtype, tokens, positions, num_new, last_logits, attend, state, window,
                   window_q: list):
    """The model over one chunk with `attend` (which appends each layer's window queries to `window_q`).
    Returns `(state, window carry, logits f32[B, V])`: logits at each row's last real token, `last_logits`
    where a row has none."""
    B, C = tokens.shape
    module = CausalLM(cfg, dtype)
    rope = rope_frequencies(cfg, state.long_rope)
    hidden, state = module.apply({"params": params}, tokens, positions, rope, attend, state)
    if window is not None:
        window = {"q": jnp.stack(window_q), "pos": _keep_last(window["pos"], positions, num_new)}
    last = jnp.clip(num_new - 1, 0, C - 1)
    logits = module.apply({"params": params}, hidden[jnp.arange(B), last], method=CausalLM.logits)
    return state, window, jnp.where((num_new > 0)[:, None], logits, last_logits)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "policy"), donate_argnames=("state", "window"))
def _append_step(
    params, state: KVState, window, tokens, num_new, last_logits, policy_params=None, *, cfg: ModelConfig, dtype, policy: Policy
):
    """Append `tokens int32[B, C]` (the first `num_new[b]` of each row are real) and attend.
    `policy_params` is `policy.device_params()` (arrays its hooks read, e.g. Locret's heads).

    C = 1 is a decode step: the policy's page selection and decode-time eviction apply. Returns the state,
    the window carry and logits f32[B, V] at each row's last real token (`last_logits` where num_new is 0).
    """
    B, C = tokens.shape
    decoding = C == 1
    TRACE_COUNTS[("append_step", B, C)] += 1
    positions = state.next_position[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    state, ok = allocate_for_append(state, num_new, C)
    num_new = jnp.where(ok, num_new, 0)
    seen = state.next_position + num_new
    window_q = []

    def attend(layer, inputs, state):
        compressed = policy.compresses_layer(layer)
        need_probs = compressed and (policy.accumulates_attention or (decoding and policy.evicts_while_decoding))
        score = policy.append_scores(layer, inputs, policy_params) if compressed else None
        state, out, probs = _append_and_attend(
            state, layer, inputs.q, inputs.k, inputs.v, inputs.positions, num_new, policy=policy, decoding=decoding,
            need_probs=need_probs, score=score,
        )
        if probs is not None and decoding and policy.evicts_while_decoding:
            view = _layer_view(state, layer, cfg.num_layers, seen, probs=probs[:, :, :, 0])
            state = evict_one_slot(
                state, layer, _decode_victim(policy, view), _over_decode_budget(state, layer, policy), view.k
            )
        if window is not None:
            window_q.append(_keep_last(window["q"][layer], inputs.q, num_new))
        return out, state

    state, window, logits = _forward_chunk(
        params, cfg, dtype, tokens, positions, num_new, last_logits, attend, state, window, window_q
    )
    return state.replace(next_position=seen), window, logits


@functools.partial(
    jax.jit, static_argnames=("num_layers", "policy", "keep_bound", "read_pages"), donate_argnames=("state",)
)
def _compress_step(state: KVState, window, final=None, *, num_layers: int, policy: Policy, keep_bound: int, read_pages: tuple):
    """Apply the policy's keep sets to every compressed layer, then bound each layer's pages to `read_pages`.
    `final bool[B]` (per-chunk compression): whether this was each sequence's last prefill chunk."""
    TRACE_COUNTS[("compress_step", keep_bound)] += 1
    for layer in range(num_layers):
        if not policy.compresses_layer(layer):
            continue
        extra = {} if window is None else {"window_q": window["q"][layer], "window_pos": window["pos"]}
        extra["final_chunk"] = final
        view = _layer_view(state, layer, num_layers, state.next_position, **extra)
        keep_slots, keep_count = policy.compress_layer(view, keep_bound)
        state = compact_layer(state, layer, keep_slots, keep_count)
    return state.replace(read_pages=read_pages)


class StepBackend(NamedTuple):
    """Where the host loop's state lives and which jitted steps advance it: one device (`LOCAL_BACKEND`) or a
    device mesh (`kvjax.distributed`, which stacks one state per shard). The prefill, decode and generate
    loops below are written once against it."""

    new_state: Callable[..., KVState]  # (cfg, B, capacity, page_size, num_pages, dtype, long_rope, read_pages)
    append_step: Callable  # `_append_step`'s signature
    compress_step: Callable  # `_compress_step`'s signature
    overflow_error: Callable[[KVState], Exception | None]
    put: Callable[[Any], jax.Array]  # a host array with a leading batch axis -> a device array


def _local_state(cfg, batch, capacity, page_size, num_pages, dtype, long_rope, read_pages) -> KVState:
    state = init_state(cfg, batch, capacity, page_size, num_pages=num_pages, dtype=dtype, long_rope=long_rope)
    return state.replace(read_pages=read_pages)


LOCAL_BACKEND = StepBackend(_local_state, _append_step, _compress_step, overflow_error, jnp.asarray)


def dense_forward(params, tokens, cfg: ModelConfig, dtype=jnp.float32, long_rope: bool = False) -> jax.Array:
    """Dense causal forward, no cache: `tokens int32[B, T]` at positions 0..T-1 -> logits `f32[B, T, V]`.
    Differentiable and not jitted (the default model's training calls it inside its own jitted step)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def attend(layer, inputs, carry):
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), carry

    logits, _ = CausalLM(cfg, dtype).apply(
        {"params": params}, tokens, positions, rope_frequencies(cfg, long_rope), attend, None, method=CausalLM.hidden_and_logits
    )
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "long_rope"))
def _dense_logits(params, tokens, *, cfg: ModelConfig, dtype, long_rope: bool):
    TRACE_COUNTS[("dense_logits", *tokens.shape)] += 1
    return dense_forward(params, tokens, cfg, dtype, long_rope)


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def _sample(logits, key, *, temperature, top_k, top_p):
    return sample_tokens(logits, key, temperature, top_k, top_p)


# ------------------------------------------------------------------------------------------ inputs


def as_token_lists(prompt_ids, vocab_size: int, name: str = "prompt_ids") -> list[np.ndarray]:
    """Validate prompts given as an int array `[B, T]` or a list of token lists (ragged)."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        array = np.asarray(prompt_ids)
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2:
            raise ValueError(f"{name} must be [batch, length] or a list of token lists, got shape {array.shape}")
        rows = list(array)
    else:
        rows = [np.asarray(list(r) if not isinstance(r, np.ndarray) else r) for r in prompt_ids]
    if not rows:
        raise ValueError(f"{name} is empty: give at least one prompt")
    out = []
    for i, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"{name}[{i}] is empty: every prompt needs at least one token")
        if not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"{name}[{i}] must hold integer token ids, got dtype {row.dtype}")
        bad = np.flatnonzero((row < 0) | (row >= vocab_size))
        if bad.size:
            raise ValueError(
                f"{name}[{i}] has token id {int(row[bad[0]])} at position {int(bad[0])} outside the vocabulary "
                f"[0, {vocab_size})"
            )
        out.append(row.astype(np.int32))
    return out


def _chunk_size_for(longest: int, chunk_size: int) -> int:
    """A power-of-two chunk no larger than needed (few compiles for short prompts)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bucket = 16
    while bucket < min(longest, chunk_size):
        bucket *= 2
    return min(bucket, chunk_size)


def _warn_sliding_window(cfg: ModelConfig, length: int) -> None:
    if cfg.sliding_window is not None and length > cfg.sliding_window:
        warnings.warn(
            f"this {cfg.model_type} config declares sliding_window={cfg.sliding_window}; kvjax attends over the "
            f"whole context, so past {cfg.sliding_window} tokens (here {length}) outputs differ from transformers",
            stacklevel=3,
        )


def _policy_or_full(policy: Policy | None) -> Policy:
    if policy is None:
        return FullPolicy()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a kvjax Policy (see kvjax.make_policy), got {type(policy).__name__}")
    return policy


# --------------------------------------------------------------------------------------------- API


def forward_logits(model: Model, tokens) -> jax.Array:
    """Dense causal forward with no cache: `tokens int[B, T]` -> logits `f32[B, T, V]`."""
    rows = as_token_lists(tokens, model.cfg.vocab_size, "tokens")
    if len({len(r) for r in rows}) != 1:
        raise ValueError("forward_logits takes equal-length rows; pad them or call it once per row")
    array = jnp.asarray(np.stack(rows))
    _warn_sliding_window(model.cfg, array.shape[1])
    long_rope = uses_long_factors(model.cfg, array.shape[1])
    return _dense_logits(model.params, array, cfg=model.cfg, dtype=model.dtype, long_rope=long_rope)


def _prefill_rows(
    model: Model,
    rows: list[np.ndarray],
    policy: Policy,
    page_size: int,
    capacity: int,
    chunk_size: int,
    declared_length: int,
    reserve_tokens: int,
    backend: StepBackend = LOCAL_BACKEND,
) -> tuple[KVState, jax.Array]:
    cfg = model.cfg
    policy.validate(page_size)
    _warn_sliding_window(cfg, declared_length)
    lengths = np.array([len(r) for r in rows], np.int32)
    B = len(rows)
    slots_needed = max(policy.slots_needed(int(n), reserve_tokens, chunk_size) for n in lengths)
    if slots_needed > pages_for(capacity, page_size) * page_size:
        raise_capacity(slots_needed, capacity, page_size)

    # Per-chunk compressors (Locret) compress after every chunk and append a tail without eviction; their
    # compressed layers get pages for what they can hold at once (slots_needed), not for the prompt.
    per_chunk = policy.compresses and policy.compresses_each_chunk
    tails = np.array([policy.prefill_tail(int(n)) if per_chunk else 0 for n in lengths], np.int32)
    num_pages = read_bound = None
    if per_chunk:
        full = pages_for(capacity, page_size)
        bounded = min(full, pages_for(_bucketed(slots_needed), page_size))
        read_bound = tuple(bounded if policy.compresses_layer(l) else full for l in range(cfg.num_layers))
        num_pages = B * cfg.num_kv_heads * sum(read_bound)
    state = backend.new_state(
        cfg, B, capacity, page_size, num_pages, model.dtype, uses_long_factors(cfg, declared_length), read_bound
    )
    keep_bound = max(policy.kept_bound(int(n), cfg.num_kv_heads) for n in lengths - tails)
    policy_params = policy.device_params()

    def run_chunks(state, window, logits, part: list, compress: bool):
        part_len = np.array([len(r) for r in part], np.int32)
        C = _chunk_size_for(int(part_len.max()), chunk_size)
        num_chunks = -(-int(part_len.max()) // C)
        padded = np.zeros((B, num_chunks * C), np.int32)
        for i, row in enumerate(part):
            padded[i, : len(row)] = row
        last_chunk = -(-part_len // C) - 1
        for i in range(num_chunks):
            num_new = np.clip(part_len - i * C, 0, C).astype(np.int32)
            state, window, logits = backend.append_step(
                model.params, state, window, backend.put(padded[:, i * C : (i + 1) * C]), backend.put(num_new),
                logits, policy_params, cfg=cfg, dtype=model.dtype, policy=policy,
            )
            if compress:
                state = backend.compress_step(
                    state, window, backend.put(i >= last_chunk), num_layers=cfg.num_layers, policy=policy,
                    keep_bound=keep_bound, read_pages=read_bound,
                )
        return state, window, logits

    logits = backend.put(jnp.zeros((B, cfg.vocab_size), jnp.float32))
    window = new_window(cfg, B, policy.window_size, model.dtype) if policy.compresses else None
    state, window, logits = run_chunks(state, window, logits, [r[: len(r) - t] for r, t in zip(rows, tails)], per_chunk)
    if tails.any():
        state, window, logits = run_chunks(state, window, logits, [r[len(r) - t :] for r, t in zip(rows, tails)], False)
    error = backend.overflow_error(state)
    if error is not None:
        raise error
    if policy.compresses and not per_chunk:
        keep_bound = max(policy.kept_bound(int(n), cfg.num_kv_heads) for n in lengths)
        grow = 1 if policy.evicts_while_decoding else reserve_tokens
        bounded = min(state.max_pages, pages_for(_bucketed(keep_bound + grow), page_size))
        read_pages = tuple(bounded if policy.compresses_layer(l) else state.max_pages for l in range(cfg.num_layers))
        state = backend.compress_step(state, window, num_layers=cfg.num_layers, policy=policy, keep_bound=keep_bound, read_pages=read_pages)
    return state, logits


def prefill(
    model: Model,
    prompt_ids,
    policy: Policy | None = None,
    *,
    page_size: int = 16,
    capacity: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_new_tokens: int = 256,
) -> tuple[KVState, jax.Array]:
    """Chunked prefill of `prompt_ids` (int `[B, T]` or ragged token lists) into a new paged state.

    Returns `(state, logits f32[B, V])`: logits at each prompt's last token. `capacity` (tokens per layer and
    head) defaults to the longest prompt plus `max_new_tokens`, the room left for `decode_step`; an explicit
    capacity need only hold the prompts (decode raises `CacheCapacityError` when it fills up).
    """
    policy = _policy_or_full(policy)
    rows = as_token_lists(prompt_ids, model.cfg.vocab_size)
    longest = max(len(r) for r in rows)
    if capacity is None:
        # LongRoPE decides from the declared length, not from the bucketed capacity
        declared, reserve, capacity = longest + max_new_tokens, max_new_tokens, _bucketed(longest + max_new_tokens)
    else:
        declared, reserve = capacity, 0
    return _prefill_rows(model, rows, policy, page_size, capacity, chunk_size, declared, reserve)


def decode_step(model: Model, state: KVState, token_ids, policy: Policy | None = None) -> tuple[jax.Array, KVState]:
    """Append one token per sequence (`token_ids int[B]`) and return `(logits f32[B, V], state)`.

    The input state is donated (its buffers are reused); use the returned one. Raises `CacheCapacityError`
    when the cache is full.
    """
    policy = _policy_or_full(policy)
    tokens = np.asarray(token_ids, np.int32).reshape(-1)
    B = state.next_position.shape[0]
    if tokens.shape[0] != B:
        raise ValueError(f"token_ids has {tokens.shape[0]} entries but the state holds {B} sequences")
    as_token_lists(tokens[:, None], model.cfg.vocab_size, "token_ids")
    logits, state = _decode(model, state, jnp.asarray(tokens), policy)
    error = overflow_error(state)
    if error is not None:
        raise error
    return logits, state


def _decode(
    model: Model, state: KVState, tokens: jax.Array, policy: Policy, backend: StepBackend = LOCAL_BACKEND
) -> tuple[jax.Array, KVState]:
    B = tokens.shape[0]
    state, _, logits = backend.append_step(
        model.params, state, None, backend.put(tokens[:, None]), backend.put(jnp.ones((B,), jnp.int32)),
        backend.put(jnp.zeros((B, model.cfg.vocab_size), jnp.float32)), policy.device_params(), cfg=model.cfg,
        dtype=model.dtype, policy=policy,
    )
    return logits, state


def generate(
    model: Model,
    prompt_ids,
    max_new_tokens: int = 8,
    policy: Policy | None = None,
    *,
    decode_last: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    page_size: int = 16,
    capacity: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eos_token_id: int | Sequence[int] | None = None,
    return_logprobs: bool = False,
):
    """Generate up to `max_new_tokens` per prompt. Returns `int32[B, max_new_tokens]`, -1 after a sequence's
    EOS (the EOS token itself is kept), and with `return_logprobs=True` also `f32[B, max_new_tokens]` (the
    chosen tokens' log-probabilities under the model, NaN where the token is -1).

    `decode_last=N` prefills all but the last N prompt tokens and feeds those N one at a time as decode
    steps (Quest's protocol: the question arrives after compression). `eos_token_id` defaults to the model's.
    """
    rows = as_token_lists(prompt_ids, model.cfg.vocab_size)
    return _generate_rows(
        model, rows, max_new_tokens, policy, decode_last=decode_last, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, page_size=page_size, capacity=capacity, chunk_size=chunk_size,
        eos_token_id=eos_token_id, return_logprobs=return_logprobs,
    )


def _generate_rows(
    model: Model, rows: list[np.ndarray], max_new_tokens: int, policy: Policy | None, *, decode_last: int,
    temperature: float, top_k: int, top_p: float, seed: int, page_size: int, capacity: int | None, chunk_size: int,
    eos_token_id, return_logprobs: bool, backend: StepBackend = LOCAL_BACKEND,
):
    """`generate` on validated token rows, with the state on `backend` (one device or a mesh)."""
    policy = _policy_or_full(policy)
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    shortest, longest = min(len(r) for r in rows), max(len(r) for r in rows)
    if not 0 <= decode_last < shortest:
        raise ValueError(f"decode_last must be in [0, shortest prompt length {shortest}), got {decode_last}")
    needed = longest + max_new_tokens
    capacity = _bucketed(needed) if capacity is None else capacity
    eos = model.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())

    state, logits = _prefill_rows(
        model, [r[: len(r) - decode_last] for r in rows], policy, page_size, capacity, chunk_size, needed,
        max_new_tokens + decode_last, backend,
    )
    for j in range(decode_last):
        step_tokens = jnp.asarray([r[len(r) - decode_last + j] for r in rows], jnp.int32)
        logits, state = _decode(model, state, step_tokens, policy, backend)

    B = len(rows)
    out = np.full((B, max_new_tokens), -1, np.int32)
    out_logprobs = np.full((B, max_new_tokens), np.nan, np.float32)
    done = np.zeros(B, bool)
    key = jax.random.PRNGKey(seed)
    eos_array = np.asarray(eos, np.int32)
    for t in range(max_new_tokens):
        key, step_key = jax.random.split(key)
        tokens, logprobs = _sample(logits, step_key, temperature=temperature, top_k=top_k, top_p=top_p)
        tokens_host, logprobs_host = np.asarray(tokens), np.asarray(logprobs)
        out[~done, t] = tokens_host[~done]
        out_logprobs[~done, t] = logprobs_host[~done]
        done |= np.isin(tokens_host, eos_array)
        if done.all() or t == max_new_tokens - 1:
            break
        logits, state = _decode(model, state, tokens, policy, backend)
    error = backend.overflow_error(state)
    if error is not None:
        raise error
    return (out, out_logprobs) if return_logprobs else out


def raise_capacity(needed_tokens: int, capacity: int, page_size: int):
    """Raise, before any work, for a request whose (layer, head) would hold more slots than capacity."""
    raise CacheCapacityError(
        f"the prompt plus max_new_tokens needs {needed_tokens} tokens ({pages_for(needed_tokens, page_size)} pages "
        f"per layer and head) but capacity is {capacity} tokens ({pages_for(capacity, page_size)} pages)",
        pages_for(needed_tokens, page_size),
        pages_for(capacity, page_size),
    )


def generate_text(model: Model, prompt: str | Sequence[str], max_new_tokens: int = 32, policy: Policy | None = None, **kwargs) -> Any:
    """Tokenize with `model.tokenizer`, generate, and decode. Returns a string (or a list for a list)."""
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer (no tokenizer.json beside its weights); use generate()")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [model.tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    out = generate(model, ids, max_new_tokens, policy, **kwargs)
    tokens = out[0] if isinstance(out, tuple) else out
    texts = [model.tokenizer.decode([int(t) for t in row if t >= 0], skip_special_tokens=True) for row in tokens]
    return texts[0] if isinstance(prompt, str) else texts
