"""Locret's training targets, computed through kvjax's own prefill step (the paged state, chunked prefill).

Notes: docs/modules.md (`kvjax/locret/labels.py`)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.attention import attention_max
from kvjax.cache.state import gather_layer, init_state
from kvjax.engine.step import append_chunk
from kvjax.models.config import ModelConfig
from kvjax.models.rope import uses_long_factors
from kvjax.policies import FullPolicy

FULL = FullPolicy()
ANSWER_BLOCK = 64  # answer queries scored at once in the label step


class Batch(NamedTuple):
    """Left-aligned, padded (prefix, answer) pairs. B rows, Tp prefix slots, A answer slots."""

    prefix: jax.Array  # int32[B, Tp]
    prefix_len: jax.Array  # int32[B], at least 1
    answer: jax.Array  # int32[B, A]
    answer_len: jax.Array  # int32[B], at least 1


class Targets(NamedTuple):
    """Per-layer retaining-head inputs and labels of the prefix tokens. L layers. The inputs are None when
    `compute_targets(..., features=False)` (labels only)."""

    q_pre: jax.Array | None  # [L, B, Tp, Hq, D]
    k_pre: jax.Array | None  # [L, B, Tp, H, D]
    v: jax.Array | None  # [L, B, Tp, H, D]
    labels: jax.Array  # f32[L, B, Tp, H]
    valid: jax.Array  # bool[B, Tp]: a real prefix token


def _chunk(params, state, tokens, num_new, out, *, cfg: ModelConfig, dtype, on_layer):
    """Append `tokens int32[B, C]` (the first num_new[b] real) to every layer and attend, with the step every
    prefill runs (`kvjax.engine.step.append_chunk`, the full cache); `out = on_layer(layer, inputs, state,
    out)` sees each layer after its append and writes what it records into `out` (arrays with a leading
    `[L]` axis). Returns `(state, out)`."""
    logits = jnp.zeros((tokens.shape[0], cfg.vocab_size), jnp.float32)
    state, _, _, out = append_chunk(params, state, None, tokens, num_new, logits, cfg=cfg, dtype=dtype,
                                   policy=FULL, observe=on_layer, observed=out)
    return state, out


def answer_logit_max(
    q: jax.Array, answer_real: jax.Array, k: jax.Array, key_real: jax.Array, answer_block: int = ANSWER_BLOCK
) -> jax.Array:
    """max over real answer queries and over the GQA group of `q . k / sqrt(D)`: `f32[B, H, S]`.

    `q [B, A, Hq, D]` post-RoPE answer queries, `answer_real bool[B, A]`, `k [B, H, S, D]` keys in slot
    order, `key_real bool[B, H, S]`. Entries of unreal keys are 0. The answer is visited `answer_block`
    queries at a time with a running max (`kvjax.cache.attention.attention_max`), so the largest score
    tensor is `[B, H, G, answer_block, S]`, whatever the answer's length (never `[.., A, S]`, nor anything
    `[.., S, S]`). Answer queries follow every prefix key, so no causal mask applies."""
    B, A = answer_real.shape
    after = jnp.ones((B, A), jnp.int32)  # every key at position 0 is "before" them: only key_real restricts
    zeros = jnp.zeros(k.shape[:3], jnp.int32)
    return attention_max(q, after, answer_real, k, zeros, key_real, probs=False, block=answer_block)


def _prefill_features(model_params, batch: Batch, *, cfg: ModelConfig, dtype, chunk_size: int, page_size: int,
                      capacity: int, features: bool = True):
    """The prefix of `batch` prefilled chunk by chunk into a full state of `capacity` slots (every prefill's
    step): `(state, (q_pre, k_pre, v) each [L, B, Tp, ...] or () when not features)`."""
    B, Tp = batch.prefix.shape
    C = min(chunk_size, Tp)
    if Tp % C:
        raise ValueError(f"prefix width {Tp} must be a multiple of chunk_size {C}")
    state = init_state(cfg, B, capacity, page_size, dtype=dtype, long_rope=uses_long_factors(cfg, capacity))
    L, Hq, H, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def record(layer, inputs, state, feats):
        return tuple(f.at[layer].set(x.astype(f.dtype)) for f, x in zip(feats, (inputs.q_pre, inputs.k_pre, inputs.v)))

    def prefix_chunk(state, i):
        num_new = jnp.clip(batch.prefix_len - i * C, 0, C).astype(jnp.int32)
        shapes = ((L, B, C, Hq, D), (L, B, C, H, D), (L, B, C, H, D)) if features else ()
        feats = tuple(jnp.zeros(shape, dtype) for shape in shapes)
        tokens = jax.lax.dynamic_slice_in_dim(batch.prefix, i * C, C, axis=1)
        return _chunk(model_params, state, tokens, num_new, feats, cfg=cfg, dtype=dtype, on_layer=record)

    # a scan over the chunks: one chunk's program, compiled once whatever the length
    state, chunks = jax.lax.scan(prefix_chunk, state, jnp.arange(Tp // C))  # each [Tp // C, L, B, C, ...]
    stack = lambda x: jnp.moveaxis(x, 0, 2).reshape(L, B, Tp, *x.shape[4:])  # [L, B, Tp, ...]
    return state, tuple(stack(x) for x in chunks)


def compute_targets(model_params, batch: Batch, *, cfg: ModelConfig, dtype, chunk_size: int, page_size: int = 16,
                    features: bool = True) -> Targets:
    """Retaining-head inputs and labels for `batch` (see the module docstring). `chunk_size` must divide
    the prefix width Tp (or exceed it). `features=False` records no inputs (labels only: what scoring
    tokens by their labels needs, `L * Tp * (Hq + 2H) * D` less memory)."""
    B, Tp = batch.prefix.shape
    A = batch.answer.shape[1]
    L, H = cfg.num_layers, cfg.num_kv_heads
    state, inputs = _prefill_features(model_params, batch, cfg=cfg, dtype=dtype, chunk_size=chunk_size,
                                      page_size=page_size, capacity=Tp + A, features=features)
    answer_real = jnp.arange(A)[None, :] < batch.answer_len[:, None]

    def label(layer, inputs, state, labels):
        k, _, pos, valid = gather_layer(state, layer)
        prefix_key = valid & (pos < batch.prefix_len[:, None, None])
        best = answer_logit_max(inputs.q, answer_real, k, prefix_key)  # [B, H, S], slot order = position
        return labels.at[layer].set(jnp.moveaxis(best[:, :, :Tp], 1, 2))  # [B, Tp, H]

    _, labels = _chunk(
        model_params, state, batch.answer, batch.answer_len.astype(jnp.int32), jnp.zeros((L, B, Tp, H), jnp.float32),
        cfg=cfg, dtype=dtype, on_layer=label,
    )
    valid = jnp.arange(Tp)[None, :] < batch.prefix_len[:, None]
    return Targets(*(inputs or (None, None, None)), labels, valid)


LOG_FLOOR = 1e-8  # KVzip scores below this are taken as this before the log


def kvzip_targets(model, batch: Batch, *, chunk_size: int, page_size: int = 16, sinks: int = 4) -> Targets:
    """Retaining-head inputs and KVzip's label for `batch`: the log of the largest softmax attention each
    prefix token gets while the frozen `model` (a `kvjax.models.loading.Model`, its tokenizer gives the
    repeat instruction) repeats the prefix (`kvjax.engine.reconstruction`), floored at LOG_FLOOR: labels
    `f32[L, B, Tp, H]`, question-agnostic (the answer is not read). Host-driven, not traceable."""
    from kvjax.engine.reconstruction import reconstruction_scores
    from kvjax.engine.generation import bucketed
    from kvjax.policies.kvzip import INSTRUCTION_ROOM, KVzip

    B, Tp = batch.prefix.shape
    spec = KVzip(sink_size=sinks).scoring_pass
    capacity = bucketed(Tp + min(spec.chunk, Tp) + INSTRUCTION_ROOM)
    prefill = jax.jit(functools.partial(_prefill_features, cfg=model.cfg, dtype=model.dtype, chunk_size=chunk_size,
                                        page_size=page_size, capacity=capacity))
    state, inputs = prefill(model.params, batch)
    rows = [np.asarray(p[:n]) for p, n in zip(np.asarray(batch.prefix), np.asarray(batch.prefix_len))]
    _, scores = reconstruction_scores(model, state, rows, spec)  # [L, B, H, S], slot order = position
    labels = jnp.log(jnp.maximum(jnp.moveaxis(scores[..., :Tp], 2, 3), LOG_FLOOR))  # [L, B, Tp, H]
    valid = jnp.arange(Tp)[None, :] < batch.prefix_len[:, None]
    return Targets(*inputs, labels, valid)
