"""KVzip's context reconstruction: the prompt fed again after a repeat instruction, through the one step
(`append_chunk` with `observe`); each prompt slot scored by the attention the repetition gives it.

Notes: docs/modules.md (`kvjax/engine/reconstruction.py`)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.attention import attention_max
from kvjax.cache.compaction import compact_layer
from kvjax.cache.state import KVState, gather_layer, set_slot_scores
from kvjax.engine.step import append_chunk, scan_layers
from kvjax.models.loading import Model
from kvjax.policies import FullPolicy, Policy, ScoringPass

FULL = FullPolicy()
CHUNK_BUCKET = 256  # fed chunks are padded to a multiple of this, so nearby prompt lengths share a compile


def instruction_ids(tokenizer, spec: ScoringPass) -> tuple[list[int], list[int], list[int]]:
    """(first instruction, later instruction, turn end) token ids, as kvpress's `KVzipPress` builds them: the
    turn end is what the chat template puts after a user turn (with the generation prompt), or "\\n" for a
    tokenizer without one. A model without a tokenizer repeats its prompt with no instruction."""
    if tokenizer is None:
        return [], [], []
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    suffix = "\n"
    if getattr(tokenizer, "chat_template", None):
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False)
        suffix = text.split(separator)[1]
    return encode(spec.first), encode(spec.later), encode(suffix)


def repeat_feeds(rows: Sequence[np.ndarray], spec: ScoringPass, ids) -> list[list[tuple[int, int, list[int]]]]:
    """Per pass i, per row: `(start, end, fed token ids)`, the prompt positions start .. end - 1 repeated
    (`start == end`, nothing fed, once a row is done)."""
    first, later, suffix = ids
    passes = max(-(-len(r) // spec.chunk) for r in rows)
    out = []
    for i in range(passes):
        feeds = []
        for row in rows:
            start, end = min(i * spec.chunk, len(row)), min((i + 1) * spec.chunk, len(row))
            lead = first if i == 0 else later + list(row[max(0, start - spec.overlap) : start])
            feeds.append((start, end, lead + suffix + list(row[start:end]) if end > start else []))
        out.append(feeds)
    return out


def _observe(layer, inputs, state: KVState, observed, *, sinks: int):
    """Each layer after the fed chunk's append: the chunk's prompt slots take the largest softmax attention a
    fed query gives them, over the sinks, the chunk's slots and the fed tokens (KVzip's restricted softmax)."""
    k, _, pos, valid = gather_layer(state, layer)  # [B, H, S, D], [B, H, S]
    lo, hi, n = (observed[name][:, None, None] for name in ("lo", "hi", "n"))
    ok = valid & ((pos < jnp.minimum(sinks, lo)) | ((pos >= lo) & (pos < hi)) | (pos >= n))
    best = attention_max(inputs.q, inputs.positions, observed["real"], k, pos, ok, probs=True)
    scores = observed["scores"]
    mine = valid & (pos >= lo) & (pos < hi)
    return {**observed, "scores": scores.at[layer].set(jnp.where(mine, best, scores[layer]))}


@functools.partial(jax.jit, donate_argnames=("state",))
def _truncate(state: KVState, lengths: jax.Array) -> KVState:
    """Every layer keeps its slots at positions before `lengths int32[B]` (in slot order); next position = lengths."""

    def body(state, layer):
        _, _, pos, valid = gather_layer(state, layer)
        keep = valid & (pos < lengths[:, None, None])
        slots = jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32)  # kept first, in slot order
        return compact_layer(state, layer, slots, keep.sum(-1).astype(jnp.int32))

    state = scan_layers(body, state, 0, state.page_table.shape[0])
    return state.replace(next_position=lengths)


@functools.partial(jax.jit, static_argnames=("policy",), donate_argnames=("state",))
def score_slots(state: KVState, scores: jax.Array, *, policy: Policy) -> KVState:
    """`slot_score` of every layer from per-slot `scores f32[L, B, H, S]` (`gather_layer`'s slot order; a
    reconstruction's, or any other per-token score): the first `sinks` positions +inf, then the policy's pool
    (`ScoringPass.pool`: -inf on the slots to evict), ready for its `compress_layer`. Donates `state`."""
    spec = policy.compressor.scoring_pass
    L = scores.shape[0]
    pos, valid = jax.vmap(lambda layer: gather_layer(state, layer)[2:])(jnp.arange(L))  # [L, B, H, S]
    scores = jnp.where(valid, jnp.where(pos < spec.sinks, jnp.inf, scores), -jnp.inf)
    pooled = spec.pool(scores)
    return scan_layers(lambda st, layer: set_slot_scores(st, layer, pooled[layer]), state, 0, L)


def reconstruction_scores(model: Model, state: KVState, rows: Sequence[np.ndarray], spec: ScoringPass):
    """The reconstruction pass of `spec` over prefilled `rows`: `(state, scores f32[L, B, H, S])`, each prompt
    slot's largest attention from the repetition in `gather_layer`'s slot order (0 elsewhere). The state
    comes back holding the prompt only (the fed tokens dropped, the next position the prompt's end).
    Donates `state`."""
    if model.cfg.windows and any(model.cfg.windows):
        raise ValueError("the reconstruction pass does not run on sliding-window layers")
    lengths = np.array([len(r) for r in rows], np.int32)
    room = state.capacity - int(lengths.max())
    L, B, H = state.page_table.shape[:3]
    scores = jnp.zeros((L, B, H, state.max_pages * state.page_size), jnp.float32)
    logits = jnp.zeros((B, model.cfg.vocab_size), jnp.float32)
    observe = functools.partial(_observe, sinks=spec.sinks)
    for feeds in repeat_feeds(rows, spec, instruction_ids(model.tokenizer, spec)):
        longest = max(len(f) for _, _, f in feeds)
        if longest > room:
            raise ValueError(f"a repeat chunk of {longest} tokens does not fit the {room} slots the cache holds "
                             "past the prompt; raise capacity or lower the pass's chunk")
        C = min(-(-longest // CHUNK_BUCKET) * CHUNK_BUCKET, room)
        tokens = np.zeros((B, C), np.int32)
        for b, (_, _, fed) in enumerate(feeds):
            tokens[b, : len(fed)] = fed
        num_new = np.array([len(f) for _, _, f in feeds], np.int32)
        observed = {"scores": scores, "real": jnp.asarray(np.arange(C)[None, :] < num_new[:, None]),
                    "lo": jnp.asarray([f[0] for f in feeds], jnp.int32),
                    "hi": jnp.asarray([f[1] for f in feeds], jnp.int32), "n": jnp.asarray(lengths)}
        state, _, _, observed = append_chunk(
            model.params, state, None, jnp.asarray(tokens), jnp.asarray(num_new), logits, cfg=model.cfg,
            dtype=model.dtype, policy=FULL, observe=observe, observed=observed,
        )
        scores = observed["scores"]
        state = _truncate(state, jnp.asarray(lengths))
    return state, scores


def score_by_reconstruction(model: Model, state: KVState, rows: Sequence[np.ndarray], policy: Policy) -> KVState:
    """The scoring pass of the policy's compressor (`Compressor.scoring_pass`) over prefilled `rows`, its pooled
    scores written to `slot_score` (`reconstruction_scores`, then `score_slots`). Donates `state`."""
    state, scores = reconstruction_scores(model, state, rows, policy.compressor.scoring_pass)
    return score_slots(state, scores, policy=policy)


__all__ = ["instruction_ids", "reconstruction_scores", "repeat_feeds", "score_by_reconstruction", "score_slots"]
