"""kvjax's public generation API: `prefill`, `decode_step`, `generate`, `generate_text`, `forward_logits`, the
dense no-cache forward (`dense_forward`) every cached path is checked against, and the checks of what enters
(tokens, context, policy), which every entry point uses. The host loops they drive live in
`kvjax.engine.generation`."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.attention import dense_causal_attention
from kvjax.cache.state import KVState, overflow_error
from kvjax.engine.generation import (
    DEFAULT_CHUNK_SIZE, DEFAULT_STEPS_PER_DISPATCH, generate_rows, PrefillPlan, prefill_rows,
)
from kvjax.engine.decode import append_token
from kvjax.models import CausalLM
from kvjax.models.config import ModelConfig
from kvjax.models.loading import Model
from kvjax.models.rope import rope_frequencies, uses_long_factors
from kvjax.policies import FullPolicy, Policy


# ------------------------------------------------------------------------------ what enters, checked


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
    return [as_token_row(row, vocab_size, f"{name}[{i}]") for i, row in enumerate(rows)]


def as_token_row(row, vocab_size: int, name: str) -> np.ndarray:
    """One token sequence as int32[T], refused by `name` when empty, not 1-D, not integer, or holding an id
    outside the vocabulary (which would embed as NaN)."""
    row = np.asarray(row)
    if row.size == 0:
        raise ValueError(f"{name} is empty: every sequence needs at least one token")
    if row.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of token ids, got shape {row.shape}")
    if not np.issubdtype(row.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {row.dtype}")
    bad = np.flatnonzero((row < 0) | (row >= vocab_size))
    if bad.size:
        raise ValueError(
            f"{name} has token id {int(row[bad[0]])} at position {int(bad[0])} outside the vocabulary [0, {vocab_size})"
        )
    return row.astype(np.int32)


def check_context(cfg: ModelConfig, longest_prompt: int, max_new_tokens: int, allow_longer_context: bool) -> None:
    """Refuse, before any work, a request longer than the model's context (`max_position_embeddings`)."""
    needed = longest_prompt + max_new_tokens
    if needed > cfg.max_position_embeddings and not allow_longer_context:
        raise ValueError(
            f"the longest prompt ({longest_prompt} tokens) plus max_new_tokens ({max_new_tokens}) needs {needed} "
            f"positions but the model's context is {cfg.max_position_embeddings} (max_position_embeddings); pass "
            "allow_longer_context=True to run past it anyway"
        )


def policy_or_full(policy: Policy | None) -> Policy:
    if policy is None:
        return FullPolicy()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a kvjax Policy (see kvjax.make_policy), got {type(policy).__name__}")
    return policy


# ------------------------------------------------------------------------------------------- entries


def dense_forward(params, tokens, cfg: ModelConfig, dtype=jnp.float32, long_rope: bool = False,
                  observe: Callable | None = None, observed=None):
    """Dense causal forward, no cache: `tokens int32[B, T]` at positions 0..T-1 -> logits `f32[B, T, V]`,
    each layer within its sliding window (`ModelConfig.windows`). Differentiable and not jitted (the
    default model's training calls it inside its own jitted step). `observe(layer, inputs, observed) ->
    observed` sees each layer's `AttentionInputs` (RAG's chunk encoder records its K/V this way); with it
    the forward returns `(logits, observed)` (unused logits cost nothing under `jit`)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    windows = jnp.asarray(cfg.windows, jnp.int32)  # [L]

    def attend(layer, inputs, carry):
        if observe is not None:
            carry = observe(layer, inputs, carry)
        return dense_causal_attention(inputs.q, inputs.k, inputs.v, window=windows[layer]), carry

    logits, observed = CausalLM(cfg, dtype).apply(
        {"params": params}, tokens, positions, rope_frequencies(cfg, long_rope), attend, observed,
        method=CausalLM.hidden_and_logits,
    )
    return logits if observe is None else (logits, observed)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "long_rope"))
def _dense_logits(params, tokens, *, cfg: ModelConfig, dtype, long_rope: bool):
    return dense_forward(params, tokens, cfg, dtype, long_rope)


def forward_logits(model: Model, tokens) -> jax.Array:
    """Dense causal forward with no cache: `tokens int[B, T]` -> logits `f32[B, T, V]`."""
    rows = as_token_lists(tokens, model.cfg.vocab_size, "tokens")
    if len({len(r) for r in rows}) != 1:
        raise ValueError("forward_logits takes equal-length rows; pad them or call it once per row")
    array = jax.device_put(np.stack(rows))
    long_rope = uses_long_factors(model.cfg, array.shape[1])
    return _dense_logits(model.params, array, cfg=model.cfg, dtype=model.dtype, long_rope=long_rope)


def prefill(
    model: Model,
    prompt_ids,
    policy: Policy | None = None,
    *,
    page_size: int = 16,
    capacity: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_new_tokens: int = 256,
    allow_longer_context: bool = False,
    progress: bool = False,
) -> tuple[KVState, jax.Array]:
    """Chunked prefill of `prompt_ids` (int `[B, T]` or ragged token lists) into a new paged state.

    Returns `(state, logits f32[B, V])`: logits at each prompt's last token. `capacity` (tokens per layer and
    head) defaults to the longest prompt plus `max_new_tokens`, the room left for `decode_step`; an explicit
    capacity need only hold the prompts (decode raises `CacheCapacityError` when it fills up). A prompt past
    the model's context is refused unless `allow_longer_context`; `progress` shows a bar over the chunks.
    """
    policy = policy_or_full(policy)
    rows = as_token_lists(prompt_ids, model.cfg.vocab_size)
    longest = max(len(r) for r in rows)
    check_context(model.cfg, longest, 0, allow_longer_context)
    plan = PrefillPlan.for_prompts(policy, longest, max_new_tokens, capacity, page_size, chunk_size, progress=progress)
    return prefill_rows(model, rows, plan)


def decode_step(model: Model, state: KVState, token_ids, policy: Policy | None = None) -> tuple[jax.Array, KVState]:
    """Append one token per sequence (`token_ids int[B]`) and return `(logits f32[B, V], state)`.

    The input state is donated (its buffers are reused); use the returned one. Raises `CacheCapacityError`
    when the cache is full. Inside a user's `jax.jit`, `lax.scan` or `lax.while_loop` (traced tokens or
    state) the host-side checks are skipped: the step is pure, and a full cache is left in the state's
    capacity flag (`state.overflow[0] != 0`; `kvjax.cache.state.overflow_error(state)` names it) for the caller
    to check after the loop. Tokens must then be in the vocabulary.
    """
    policy = policy_or_full(policy)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, token_ids))):
        return _decode_tokens(model, state, jnp.asarray(token_ids, jnp.int32).reshape(-1), policy)
    tokens = np.asarray(token_ids, np.int32).reshape(-1)
    B = state.next_position.shape[0]
    if tokens.shape[0] != B:
        raise ValueError(f"token_ids has {tokens.shape[0]} entries but the state holds {B} sequences")
    as_token_lists(tokens[:, None], model.cfg.vocab_size, "token_ids")
    logits, state = _decode_tokens(model, state, jax.device_put(tokens), policy)
    error = overflow_error(state)
    if error is not None:
        raise error
    return logits, state


def _decode_tokens(model: Model, state: KVState, tokens: jax.Array, policy: Policy) -> tuple[jax.Array, KVState]:
    """One decode step of `tokens int32[B]` on one device (`append_token`: no checks, traceable)."""
    B = tokens.shape[0]
    state, logits = append_token(model.params, state, tokens, jnp.ones((B,), jnp.int32),
                                 jnp.zeros((B, model.cfg.vocab_size), jnp.float32), cfg=model.cfg, dtype=model.dtype,
                                 policy=policy)
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
    allow_longer_context: bool = False,
    progress: bool = False,
    steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH,
    on_tokens: Callable[[int, np.ndarray], bool | None] | None = None,
):
    """Generate up to `max_new_tokens` per prompt. Returns `int32[B, max_new_tokens]`, -1 after a sequence's
    EOS (the EOS token itself is kept), and with `return_logprobs=True` also `f32[B, max_new_tokens]` (the
    chosen tokens' log-probabilities under the model, NaN where the token is -1).

    `decode_last=N` prefills all but the last N prompt tokens and feeds those N one at a time as decode
    steps (Quest's protocol: the question arrives after compression). `eos_token_id` defaults to the model's.
    A request past the model's context (prompt plus `max_new_tokens`) is refused before any work unless
    `allow_longer_context`; `progress` shows a bar over the prefill chunks. `steps_per_dispatch` decode
    steps run per call to the device (`kvjax.engine.decode_loop`; results do not depend on it). `on_tokens` streams:
    see `continue_rows`.
    """
    rows = as_token_lists(prompt_ids, model.cfg.vocab_size)
    check_context(model.cfg, max(len(r) for r in rows), max_new_tokens, allow_longer_context)
    return generate_rows(
        model, rows, max_new_tokens, policy_or_full(policy), decode_last=decode_last, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, page_size=page_size, capacity=capacity, chunk_size=chunk_size,
        eos_token_id=eos_token_id, return_logprobs=return_logprobs, progress=progress,
        steps_per_dispatch=steps_per_dispatch, on_tokens=on_tokens,
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

