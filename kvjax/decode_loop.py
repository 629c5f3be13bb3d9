"""Several decode steps per dispatch: sampling, EOS and the append step inside one jitted `while_loop`.

The host loop of `kvjax.generation.continue_rows` returns to Python after every token to copy the sampled
tokens out and test EOS. On a GPU or TPU that round trip costs more than a small model's step. Here one
call runs up to `steps` (static) decode steps on the device:

    for each step, while steps remain and some row is not done:
        append the pending tokens (the step of `kvjax.step`, with its policy), giving new logits
        split the key and sample (`kvjax.sampling.sample_tokens`, the same split as the host loop)
        record each row's token and log-probability (-1 and NaN once the row is done)
        rows that sampled an EOS token are done

The first token of a generation is sampled from the prefill's logits before any dispatch, so every
dispatch starts by appending. Results equal the host loop's token for token: same key sequence, same
steps, the same -1 fill; and no step runs after the last token (the host loop appends nothing after it
either).

Shapes: B rows, V vocabulary, K = `steps`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.policies import Policy
from kvjax.sampling import sample_tokens
from kvjax.state import KVState


class Dispatch(NamedTuple):
    """What one dispatch of `decode_steps` hands back."""

    state: KVState
    logits: jax.Array  # f32[B, V] after the last appended tokens
    pending: jax.Array  # int32[B] the last sampled tokens, not yet appended
    key: jax.Array  # the PRNG key after the last split
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
    params, state: KVState, logits, pending, key, done, eos, limit, *, step: Callable, steps: int,
    cfg: ModelConfig, dtype, policy: Policy, temperature: float, top_k: int, top_p: float,
) -> Dispatch:
    """Run at most `min(steps, limit)` decode steps (module docstring) from `pending int32[B]`, `key`,
    `done bool[B]`; `eos int32[E]` are the stop tokens, `limit int32[]` the steps still allowed. `step` is a
    `StepBackend.append_step` (static: one program per backend and shape). Donates `state`."""
    B = pending.shape[0]
    tokens = jnp.full((B, steps), -1, jnp.int32)
    logprobs = jnp.full((B, steps), jnp.nan, jnp.float32)
    bound = jnp.minimum(limit, steps)

    def cond(carry):
        i, done = carry[0], carry[5]
        return (i < bound) & ~jnp.all(done)

    def body(carry):
        i, state, logits, pending, key, done, tokens, logprobs = carry
        state, _, logits = step(
            params, state, None, pending[:, None], jnp.ones((B,), jnp.int32), logits, None, cfg=cfg, dtype=dtype,
            policy=policy,
        )
        key, step_key = jax.random.split(key)
        new, new_logprobs = sample_tokens(logits, step_key, temperature, top_k, top_p)
        tokens = tokens.at[:, i].set(jnp.where(done, -1, new))
        logprobs = logprobs.at[:, i].set(jnp.where(done, jnp.nan, new_logprobs))
        done = done | jnp.isin(new, eos)
        return i + 1, state, logits, new, key, done, tokens, logprobs

    count, state, logits, pending, key, done, tokens, logprobs = jax.lax.while_loop(
        cond, body, (jnp.int32(0), state, logits, pending, key, done, tokens, logprobs)
    )
    return Dispatch(state, logits, pending, key, done, tokens, logprobs, count)


__all__ = ["Dispatch", "decode_steps"]
