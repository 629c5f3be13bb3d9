"""One full prefill, many policies: derive each policy that compresses once after prefill (or only selects
pages) from one uncompressed state, instead of prefilling once per policy and budget (not KVzip: its pass).

Notes: docs/modules.md (`kvjax/engine/shared_prefill.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kvjax.engine.api import as_token_lists, check_context, policy_or_full
from kvjax.engine.generation import (
    DEFAULT_CHUNK_SIZE, bucketed, compress_prefilled, PrefillPlan, prefill_chunk_steps, run_to_end,
)
from kvjax.models.loading import Model
from kvjax.policies import Compressor, Policy, PromptView
from kvjax.cache.state import KVState
from kvjax.util.trees import copied


@dataclasses.dataclass(frozen=True)
class CapturePolicy(Policy, Compressor):
    """The full cache, whose prefill also records what compressors read: the last `window` queries of every
    layer and, with `accumulate`, every query's attention in `slot_score`. It never compresses (it declares
    the role only so the steps treat every layer as one a compressor reads); not registered."""

    window: int = 0
    accumulate: bool = False

    @property
    def window_size(self) -> int:
        return self.window

    @property
    def accumulates_attention(self) -> bool:  # type: ignore[override]
        return self.accumulate

    def compress_layer(self, view: PromptView, keep_bound: int):
        raise RuntimeError("CapturePolicy never compresses: derive() compresses copies with each policy")


class SharedPrefill(NamedTuple):
    """One uncompressed prefill of a batch and what its compressors read."""

    state: KVState  # never donated: derive() copies it
    last_queries: Any  # {"q": [L, B, w, Hq, D], "pos": int32[B, w]} the last w queries, or None
    logits: jax.Array  # f32[B, V] at each prompt's last token
    prompt_lengths: tuple[int, ...]
    reserve_tokens: int  # tokens each sequence may still append (question + answer)
    capture: CapturePolicy  # what was gathered


def capture_for(policies: Sequence[Policy]) -> CapturePolicy:
    """The capture that serves every one of `policies`; ValueError naming one that compresses per chunk."""
    compressors = [p.compressor for p in policies if p.compressor is not None]
    for policy in policies:
        if policy.compressor is not None and policy.compressor.chunks is not None:
            raise ValueError(
                f"policy {policy.name!r} compresses during prefill (a chunk schedule), so it cannot be derived "
                "from a shared full prefill; prefill it on its own"
            )
        if policy.compressor is not None and policy.compressor.scoring_pass is not None:
            raise ValueError(
                f"policy {policy.name!r} scores the prompt in a pass of its own after prefill (KVzip's "
                "reconstruction), which needs the prompt's tokens; prefill it on its own"
            )
    return CapturePolicy(
        window=max((p.window_size for p in compressors), default=0),
        accumulate=any(p.accumulates_attention for p in compressors),
    )


def shared_prefill(
    model: Model, prompt_ids, policies: Sequence[Policy], *, reserve_tokens: int, page_size: int = 16,
    capacity: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, allow_longer_context: bool = False,
    progress: bool = False,
) -> SharedPrefill:
    """Prefill `prompt_ids` (int `[B, T]` or ragged token lists) once, uncompressed, gathering what every
    one of `policies` reads to compress. `reserve_tokens` is the room each sequence keeps for what follows
    (question and answer); `capacity` defaults to the longest prompt plus it, as `prefill` sizes it."""
    policies = [policy_or_full(p) for p in policies]
    for policy in policies:
        policy.validate(page_size)
    rows = as_token_lists(prompt_ids, model.cfg.vocab_size)
    longest = max(len(r) for r in rows)
    check_context(model.cfg, longest, reserve_tokens, allow_longer_context)
    capacity = bucketed(longest + reserve_tokens) if capacity is None else capacity
    capture = capture_for(policies)
    plan = PrefillPlan(capture, page_size, capacity, chunk_size, longest + reserve_tokens, reserve_tokens,
                       progress=progress)
    state, last_queries, logits = run_to_end(prefill_chunk_steps(model, rows, plan))
    return SharedPrefill(state, last_queries, logits, tuple(len(r) for r in rows), reserve_tokens, capture)


def derive(model: Model, shared: SharedPrefill, policy: Policy | None) -> tuple[KVState, jax.Array]:
    """`policy`'s state after prefill, from a copy of the shared one: `(state, logits f32[B, V])`, ready for
    `kvjax.engine.generation.continue_rows` or `decode_step`. `shared` stays usable."""
    policy = policy_or_full(policy)
    capture_for([policy])  # the chunk-schedule check
    state = copied(shared.state)
    compressor = policy.compressor
    if compressor is None or not compressor.accumulates_attention:
        state = state.replace(slot_score=jnp.zeros_like(state.slot_score))
    if compressor is None:
        return (state if policy.selector is None else policy.selector.attach_sketch(state)), shared.logits
    if compressor.window_size > shared.capture.window or (compressor.accumulates_attention
                                                           and not shared.capture.accumulate):
        raise ValueError(
            f"policy {policy.name!r} reads what the shared prefill did not gather ({shared.capture}); include it "
            "in shared_prefill's policies"
        )
    last_queries = None
    if compressor.window_size:
        have, w = shared.capture.window, compressor.window_size
        carried = shared.last_queries
        last_queries = {"q": carried["q"][:, :, have - w :], "pos": carried["pos"][:, have - w :]}
    state = compress_prefilled(model, state, last_queries, policy, shared.prompt_lengths, shared.reserve_tokens)
    return state, shared.logits


__all__ = ["CapturePolicy", "SharedPrefill", "capture_for", "derive", "shared_prefill"]
