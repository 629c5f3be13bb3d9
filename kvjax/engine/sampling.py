"""Next-token choice from logits: greedy, or temperature sampling with top-k and top-p (nucleus)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def sample_tokens(
    logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """`logits f32[B, V]` -> (tokens int32[B], their log-probabilities under the model, f32[B]).

    temperature 0 is greedy. top_k 0 and top_p 1.0 disable those filters. Settings are static under jit.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if temperature == 0.0:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        scaled = logits.astype(jnp.float32) / temperature
        if top_k > 0:
            kth = jax.lax.top_k(scaled, min(top_k, scaled.shape[-1]))[0][:, -1:]
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        if top_p < 1.0:
            sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]
            cumulative = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least the best token)
            cutoff_index = jnp.sum(cumulative - jax.nn.softmax(sorted_desc, axis=-1) < top_p, axis=-1) - 1
            cutoff = jnp.take_along_axis(sorted_desc, cutoff_index[:, None], axis=-1)
            scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
        tokens = jax.random.categorical(key, scaled, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample_first_tokens(logits, key, *, temperature: float, top_k: int, top_p: float):
    """The first token of a generation from the prefill's logits, by the generation's `key` (split once
    here, as the decode loop splits it each step): `(tokens int32[B], log-probabilities f32[B], the key
    after)`. One jitted call (`generate` and the serving engine sample it this way, so both choose alike)."""
    key, step_key = jax.random.split(key)
    return (*sample_tokens(logits, step_key, temperature, top_k, top_p), key)


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
