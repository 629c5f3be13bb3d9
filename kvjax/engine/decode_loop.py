"""Several decode steps per dispatch: sampling, EOS and the append step inside one jitted `while_loop`.

Notes: docs/modules.md (`kvjax/engine/decode_loop.py`)."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.models.config import ModelConfig
from kvjax.policies import Policy
from kvjax.engine.sampling import sample_tokens
from kvjax.cache.state import KVState


class Dispatch(NamedTuple):
    """What one dispatch of `decode_steps` hands back."""

    state: KVState
    logits: jax.Array  # f32[B, V] after the last appended tokens
    pending: jax.Array  # int32[B] the last sampled tokens, not yet appended
    key: jax.Array  # the PRNG key (or keys, [B, 2]) after the last split
    done: jax.Array  # bool[B] rows that have produced an EOS token
    tokens: jax.Array  # int32[B, K] tokens of the steps run (-1 for done rows and steps not run)
    logprobs: jax.Array  # f32[B, K] their log-probabilities (NaN where the token is -1)
    count: jax.Array  # int32[] steps run (< K when every row finished or `stop` was reached)


@functools.partial(
    jax.jit,
    static_argnames=("step", "steps", "cfg", "dtype", "policy", "temperature", "top_k", "top_p"),
    donate_argnames=("state",),
)
def decode_steps(
    params, state: KVState, logits, pending, key, done, eos, limit, feed=None, feed_len=None, *, step: Callable,
    steps: int, cfg: ModelConfig, dtype, policy: Policy, temperature: float, top_k: int, top_p: float,
) -> Dispatch:
    """Run at most `steps` decode steps (module docstring) from `pending int32[B]`, `key` (one key, or
    `[B, 2]` per row), `done bool[B]`; `eos int32[E]` are the stop tokens, `limit int32[]` or `int32[B]` the
    steps each row may still take. `step` is a `StepBackend.append_token` (static: one program per backend
    and shape). Donates `state`.

    With `feed int32[B, F]` (row b's first `feed_len[b]` tokens: a question fed by decode, ragged as
    `feed_tokens` feeds it), the loop first appends those, sampling nothing, and the dispatch's first token is
    sampled from the logits after them (so `pending` is unused, and `limit` counts the steps after that
    token): the question and the answer in one program, one step compiled."""
    B = pending.shape[0]
    tokens = jnp.full((B, steps), -1, jnp.int32)
    logprobs = jnp.full((B, steps), jnp.nan, jnp.float32)
    limit = jnp.broadcast_to(limit, (B,))
    per_row_keys = key.ndim == 2
    # n: the feeding steps; step i appends generated tokens from i = n on, its sample is column i - first
    n = jnp.int32(0) if feed is None else jnp.max(feed_len, initial=0).astype(jnp.int32)
    first = jnp.maximum(n - 1, 0)

    def live(i, done):
        return ~done & (i - n < limit)

    def sample(logits, key):
        if not per_row_keys:
            key, step_key = jax.random.split(key)
            return (key, *sample_tokens(logits, step_key, temperature, top_k, top_p))

        def one_row(row_logits, row_key):  # a [1, V] batch: the shapes `generate` samples one prompt with
            row_key, step_key = jax.random.split(row_key)
            token, logprob = sample_tokens(row_logits[None], step_key, temperature, top_k, top_p)
            return row_key, token[0], logprob[0]

        return jax.vmap(one_row)(logits, key)

    def cond(carry):
        i, done = carry[0], carry[5]
        return (i - first < steps) & ((i < n) | jnp.any(live(i, done)))

    def body(carry):
        i, state, logits, pending, key, done, tokens, logprobs = carry
        if feed is None:
            token, appending = pending, live(i, done)
        else:
            feeding = i < n
            token = jnp.where(feeding, feed[:, jnp.minimum(i, feed.shape[1] - 1)], pending)
            appending = jnp.where(feeding, i < feed_len, live(i, done))
        state, logits = step(params, state, token, appending.astype(jnp.int32), logits, cfg=cfg, dtype=dtype,
                             policy=policy)
        emits = appending if feed is None else jnp.where(i < first, False, (i < n) | appending)
        if feed is None:
            key, new, new_logprobs = sample(logits, key)
        else:  # nothing sampled (nor a key split) while the question is fed
            key, new, new_logprobs = jax.lax.cond(
                i < first, lambda: (key, pending, jnp.zeros((B,), jnp.float32)), lambda: sample(logits, key))
        column = jnp.clip(i - first, 0, steps - 1)
        tokens = tokens.at[:, column].set(jnp.where(emits, new, tokens[:, column]))
        logprobs = logprobs.at[:, column].set(jnp.where(emits, new_logprobs, logprobs[:, column]))
        done = done | (emits & jnp.isin(new, eos))
        return i + 1, state, logits, jnp.where(emits, new, pending), key, done, tokens, logprobs

    end, state, logits, pending, key, done, tokens, logprobs = jax.lax.while_loop(
        cond, body, (jnp.int32(0), state, logits, pending, key, done, tokens, logprobs)
    )
    return Dispatch(state, logits, pending, key, done, tokens, logprobs, end - first)


__all__ = ["Dispatch", "decode_steps"]
