"""The host loops behind the public API (`kvjax.engine.api`, which checks what enters): chunked prefill of
rows, the on-device decode of rows, feeding given tokens. Subsystems (serving, RAG, distributed) build on them.

Notes: docs/modules.md (`kvjax/engine/generation.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.engine.decode_loop import decode_steps
from kvjax.models.loading import Model
from kvjax.policies import Policy
from kvjax.models.rope import uses_long_factors
from kvjax.cache.rows import insert_row
from kvjax.engine.sampling import sample_first_tokens, validate_sampling
from kvjax.cache.state import CacheCapacityError, KVState, pages_for
from kvjax.engine.reconstruction import score_by_reconstruction
from kvjax.engine.step import LOCAL_BACKEND, StepBackend, compressor_acts, new_last_queries
from kvjax.util.trees import copied

DEFAULT_CHUNK_SIZE = 512
DEFAULT_STEPS_PER_DISPATCH = 16  # decode steps per device call in generate (kvjax.engine.decode_loop)
CAPACITY_BUCKET = 256  # default capacities round up to this many tokens, so nearby lengths share compiles


def bucketed(tokens: int) -> int:
    """`tokens` rounded up to a multiple of `CAPACITY_BUCKET` (default capacities)."""
    return -(-tokens // CAPACITY_BUCKET) * CAPACITY_BUCKET


def _chunk_size_for(longest: int, chunk_size: int) -> int:
    """A power-of-two chunk no larger than needed (few compiles for short prompts)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bucket = 16
    while bucket < min(longest, chunk_size):
        bucket *= 2
    return min(bucket, chunk_size)


# --------------------------------------------------------------------------------------------- API


class PrefillCarry(NamedTuple):
    """What chunked prefill carries from one chunk to the next, after `tokens` prompt tokens: the state, the
    carry of last queries (`kvjax.engine.step.new_last_queries`, or None) and the logits `f32[B, V]` at the
    last token."""

    state: KVState
    last_queries: Any
    logits: jax.Array
    tokens: int


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """How a chunked prefill runs (`prefill_rows`): `policy`, `capacity` tokens per (layer, head) in pages of
    `page_size`, chunks of up to `chunk_size` tokens, LongRoPE decided from `declared_length`, room for
    `reserve_tokens` more tokens after compression, on `backend` (None: one device, `LOCAL_BACKEND`).
    `progress` shows a bar over the chunks of a prompt of several; `resume` and `on_chunk` reuse a prefix's
    prefill (`prefill_chunk_steps`)."""

    policy: Policy
    page_size: int
    capacity: int
    chunk_size: int
    declared_length: int
    reserve_tokens: int
    backend: StepBackend | None = None
    progress: bool = False
    resume: PrefillCarry | None = None
    on_chunk: Callable[[PrefillCarry], None] | None = None

    @classmethod
    def for_prompts(cls, policy: Policy, longest: int, max_new_tokens: int, capacity: int | None, page_size: int,
                    chunk_size: int, **rest) -> "PrefillPlan":
        """`prefill`'s sizing: with no `capacity`, the longest prompt plus `max_new_tokens` (LongRoPE decides
        from that length; the capacity rounds it up to `CAPACITY_BUCKET`) with `max_new_tokens` reserved; with
        one, LongRoPE decides from the capacity and nothing is reserved."""
        if capacity is None:
            declared = longest + max_new_tokens
            held = max(declared, policy.slots_needed(longest, max_new_tokens, chunk_size))  # KVzip's pass holds more
            return cls(policy, page_size, bucketed(held), chunk_size, declared, max_new_tokens, **rest)
        return cls(policy, page_size, capacity, chunk_size, capacity, 0, **rest)


def prefill_rows(model: Model, rows: list[np.ndarray], plan: PrefillPlan) -> tuple[KVState, jax.Array]:
    """Chunked prefill of validated token rows as `plan` says. Returns `(state, logits f32[B, V])`."""
    return run_to_end(prefill_row_steps(model, rows, plan))


def prefill_row_steps(
    model: Model, rows: list[np.ndarray], plan: PrefillPlan
) -> Generator[None, None, tuple[KVState, jax.Array]]:
    """`prefill_rows` one chunk at a time: a generator that yields after every chunk's step (so a caller
    can run other work between chunks, as the batch engine runs decode dispatches) and returns
    `(state, logits)` after the compression."""
    backend, policy = plan.backend or LOCAL_BACKEND, plan.policy
    compressor, selector = policy.compressor, policy.selector
    state, last_queries, logits = yield from prefill_chunk_steps(model, rows, plan)
    if compressor is not None and compressor.scoring_pass is not None:  # KVzip: the prompt repeated, its slots scored
        if plan.backend is not None and plan.backend is not LOCAL_BACKEND:
            raise NotImplementedError(f"policy {policy.name!r}: its scoring pass (KVzip's reconstruction) runs on one "
                                      "device, not on a mesh")
        state = score_by_reconstruction(model, state, rows, policy)
    if compressor is not None and compressor.chunks is None:
        state = compress_prefilled(model, state, last_queries, policy, [len(r) for r in rows], plan.reserve_tokens,
                                   backend)
    if selector is None or not selector.keeps_key_sketch:
        return state, logits
    attach = selector.attach_sketch  # the selector's key sketch, fitted on the compressed cache
    if backend.placement.sharded:  # per shard: each fits its own heads' keys
        attach = backend.placement.per_shard(attach, ("state",), "state")
    return attach(state), logits


def run_to_end(steps: Generator):
    """Run a step generator (`prefill_row_steps`, `prefill_chunk_steps`) through; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def prefill_chunk_steps(
    model: Model, rows: list[np.ndarray], plan: PrefillPlan
) -> Generator[None, None, tuple[KVState, Any, jax.Array]]:
    """A generator yielding after every chunk's step (`prefill_row_steps`; `run_to_end` runs it through):
    `prefill_rows` up to, not including, the compression after prefill: every chunk appended (and, with a
    chunk schedule, compressed). Returns `(state, last_queries, logits)`, `last_queries` being the carry of
    the last `compressor.window_size` queries per layer (`kvjax.engine.step.new_last_queries`) or None.

    Prefix reuse (one row, a policy without a chunk schedule): `on_chunk(carry)` is called after every whole
    chunk with what the next chunk starts from (it must copy what it keeps: the next step donates the
    state), and `resume`, such a carry taken from a prompt with the same first `resume.tokens` tokens,
    starts the prefill there. The chunks are the ones a prefill from scratch runs (C from the whole
    prompt), so the result equals it: only the physical pages differ (`kvjax.cache.rows.insert_row`)."""
    backend, policy, page_size, capacity = plan.backend or LOCAL_BACKEND, plan.policy, plan.page_size, plan.capacity
    reserve_tokens, chunk_size, progress = plan.reserve_tokens, plan.chunk_size, plan.progress
    resume, on_chunk = plan.resume, plan.on_chunk
    cfg = model.cfg
    policy.validate(page_size)
    lengths = np.array([len(r) for r in rows], np.int32)
    B = len(rows)
    slots_needed = max(policy.slots_needed(int(n), reserve_tokens, chunk_size) for n in lengths)
    if slots_needed > pages_for(capacity, page_size) * page_size:
        raise_capacity(slots_needed, capacity, page_size)

    # Per-chunk compressors (Locret) compress after every chunk and append a tail without eviction; their
    # compressed layers get pages for what they can hold at once (slots_needed), not for the prompt.
    compressor = policy.compressor
    chunks = None if compressor is None else compressor.chunks
    per_chunk = chunks is not None
    tails = np.array([min(chunks.tail, int(n)) if per_chunk else 0 for n in lengths], np.int32)
    num_pages = read_bound = None
    if per_chunk:
        full = pages_for(capacity, page_size)
        bounded = min(full, pages_for(bucketed(slots_needed), page_size))
        read_bound = tuple(bounded if compressor_acts(policy, l, cfg.windows) else full for l in range(cfg.num_layers))
        num_pages = B * cfg.num_kv_heads * sum(read_bound)
    state = backend.new_state(
        cfg, B, capacity, page_size, num_pages, model.cache_dtype, uses_long_factors(cfg, plan.declared_length), read_bound
    )
    keep_bound = max(compressor.kept_bound(int(n), cfg.num_kv_heads) for n in lengths - tails) if per_chunk else 0
    policy_params = chunks.params if per_chunk else None
    if (resume is not None or on_chunk is not None) and (per_chunk or B != 1):
        raise ValueError("prefix reuse (resume, on_chunk) takes one row and a policy without a chunk schedule, got "
                         f"{B} rows and policy {policy.name!r}")

    def run_chunks(state, last_queries, logits, part: list, compress: bool, C: int, done: int = 0):
        part_len = np.array([len(r) for r in part], np.int32)
        num_chunks = -(-int(part_len.max()) // C)
        padded = np.zeros((B, num_chunks * C), np.int32)
        for i, row in enumerate(part):
            padded[i, : len(row)] = row
        last_chunk = -(-part_len // C) - 1
        for i in tqdm(range(num_chunks), desc="prefill", unit="chunk", disable=not progress or num_chunks < 2,
                      leave=False):
            num_new = np.clip(part_len - i * C, 0, C).astype(np.int32)
            state, last_queries, logits = backend.append_chunk(
                model.params, state, last_queries, backend.put(padded[:, i * C : (i + 1) * C]), backend.put(num_new),
                logits, policy_params, cfg=cfg, dtype=model.dtype, policy=policy,
            )
            if compress:
                state = backend.compress_step(
                    state, last_queries, backend.put(i >= last_chunk), num_layers=cfg.num_layers, policy=policy,
                    keep_bound=keep_bound, read_pages=read_bound, windows=cfg.windows,
                )
            if on_chunk is not None and (num_new == C).all():
                on_chunk(PrefillCarry(state, last_queries, logits, done + (i + 1) * C))
            yield
        return state, last_queries, logits

    logits = backend.put(np.zeros((B, cfg.vocab_size), np.float32))
    last_queries = None if compressor is None else new_last_queries(cfg, B, compressor.window_size, model.dtype)
    head = [r[: len(r) - t] for r, t in zip(rows, tails)]
    C = _chunk_size_for(max(len(r) for r in head), chunk_size)
    done = 0
    if resume is not None:
        done = resume.tokens
        if done % C or done > len(head[0]):
            raise ValueError(f"a prefill of {len(head[0])} tokens in chunks of {C} cannot resume after {done} tokens")
        state = insert_row(state, resume.state, jnp.int32(0))
        last_queries = None if last_queries is None else copied(resume.last_queries)
        logits = jnp.copy(resume.logits)
        head = [r[done:] for r in head]
    state, last_queries, logits = yield from run_chunks(state, last_queries, logits, head, per_chunk, C, done)
    if tails.any():
        part = [r[len(r) - t :] for r, t in zip(rows, tails)]
        C = _chunk_size_for(int(tails.max()), chunk_size)
        state, last_queries, logits = yield from run_chunks(state, last_queries, logits, part, False, C)
    error = backend.overflow_error(state)
    if error is not None:
        raise error
    return state, last_queries, logits


def compress_prefilled(
    model: Model, state: KVState, last_queries, policy: Policy, prompt_lengths: Sequence[int], reserve_tokens: int,
    backend: StepBackend | None = None,
) -> KVState:
    """The compression after prefill (a policy without a chunk schedule): each compressed layer keeps the
    policy's slots and reads at most the pages they and `reserve_tokens` more tokens need (one more, for a
    policy that evicts while decoding). `last_queries` is the prefill's carry of them. Donates `state`."""
    backend = backend or LOCAL_BACKEND
    cfg = model.cfg
    keep_bound = max(policy.compressor.kept_bound(int(n), cfg.num_kv_heads) for n in prompt_lengths)
    grow = 1 if policy.evicts_while_decoding else reserve_tokens
    bounded = min(state.max_pages, pages_for(bucketed(keep_bound + grow), state.page_size))
    read_pages = tuple(
        bounded if compressor_acts(policy, l, cfg.windows) else state.max_pages for l in range(cfg.num_layers)
    )
    return backend.compress_step(
        state, last_queries, num_layers=cfg.num_layers, policy=policy, keep_bound=keep_bound, read_pages=read_pages,
        windows=cfg.windows,
    )


def generate_rows(
    model: Model, rows: list[np.ndarray], max_new_tokens: int, policy: Policy, *, decode_last: int,
    temperature: float, top_k: int, top_p: float, seed: int, page_size: int, capacity: int | None, chunk_size: int,
    eos_token_id, return_logprobs: bool, backend: StepBackend | None = None, progress: bool = False,
    steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH, on_tokens: Callable | None = None,
):
    """`generate` on checked token rows (`kvjax.engine.api`), with the state on `backend` (one device by
    default, or a mesh)."""
    backend = backend or LOCAL_BACKEND
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    shortest, longest = min(len(r) for r in rows), max(len(r) for r in rows)
    if not 0 <= decode_last < shortest:
        raise ValueError(f"decode_last must be in [0, shortest prompt length {shortest}), got {decode_last}")
    needed = longest + max_new_tokens
    held = max(needed, policy.slots_needed(longest, max_new_tokens + decode_last, chunk_size))
    capacity = bucketed(held) if capacity is None else capacity

    plan = PrefillPlan(policy, page_size, capacity, chunk_size, needed, max_new_tokens + decode_last, backend, progress)
    state, logits = prefill_rows(model, [r[: len(r) - decode_last] for r in rows], plan)
    return continue_rows(
        model, state, logits, [r[len(r) - decode_last :] for r in rows], max_new_tokens, policy,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, return_logprobs=return_logprobs,
        backend=backend, steps_per_dispatch=steps_per_dispatch, on_tokens=on_tokens,
    )


@jax.jit
def _token_nll(logits, tokens):
    """-log p(tokens[b]) under `logits f32[B, V]`: f32[B]."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]


def feed_tokens(
    model: Model, state: KVState, logits: jax.Array, rows: Sequence[np.ndarray], policy: Policy,
    backend: StepBackend | None = None, return_nll: bool = False, progress: bool = False,
):
    """Feed each sequence its own `rows[b]` tokens one decode step at a time (ragged: a row that has run out
    appends nothing while the others go on). `logits f32[B, V]` are the state's last logits; returns the
    state and the logits after each row's last fed token, and with `return_nll` also `f32[B, T]`: each fed
    token's negative log-likelihood under the logits before it (NaN past a row's end), the decode-time
    perplexity of StreamingLLM and H2O. `progress` shows a bar over the steps. Donates `state`."""
    backend = backend or LOCAL_BACKEND
    lengths = np.array([len(r) for r in rows], np.int32)
    nll = np.full((len(rows), int(lengths.max(initial=0))), np.nan, np.float32)
    for j in tqdm(range(int(lengths.max(initial=0))), desc="decode", unit="token", disable=not progress, leave=False):
        tokens = np.array([r[j] if j < len(r) else 0 for r in rows], np.int32)
        if return_nll:
            nll[:, j] = np.where(j < lengths, np.asarray(_token_nll(logits, jnp.asarray(tokens))), np.nan)
        state, logits = backend.append_token(model.params, state, backend.put(tokens),
                                             backend.put((j < lengths).astype(np.int32)), logits, cfg=model.cfg,
                                             dtype=model.dtype, policy=policy)
    return (state, logits, nll) if return_nll else (state, logits)


def fed_rows(tails: Sequence[np.ndarray], backend: StepBackend) -> tuple[jax.Array, jax.Array] | None:
    """`(feed int32[B, F], feed_len int32[B])` for `decode_steps` to feed `tails[b]` (F a power of two, at
    least 8, so questions of nearby lengths share a program), or None when every tail is empty."""
    lengths = np.array([len(r) for r in tails], np.int32)
    longest = int(lengths.max(initial=0))
    if longest == 0:
        return None
    feed = np.zeros((len(tails), max(8, 1 << (longest - 1).bit_length())), np.int32)
    for b, row in enumerate(tails):
        feed[b, : len(row)] = row
    return backend.put(feed), backend.put(lengths)


def continue_rows(
    model: Model, state: KVState, logits: jax.Array, tails: Sequence[np.ndarray], max_new_tokens: int,
    policy: Policy, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None, return_logprobs: bool = False,
    backend: StepBackend | None = None, steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH,
    on_tokens: Callable[[int, np.ndarray], bool | None] | None = None,
):
    """Generation from a prefilled (and compressed) state: feed each row's `tails[b]` by decode (Quest's
    protocol for the question), then sample up to `max_new_tokens` per row, as `generate` does. Everything
    runs in `kvjax.engine.decode_loop.decode_steps`, `steps_per_dispatch` decode steps (sampling and EOS
    included) per call to the device, so the host waits once per dispatch rather than once per token; the
    first dispatch feeds the tails too (the first token is sampled from the logits after them, or, with no
    tails, from the prefill's logits on its own).

    `on_tokens(t, tokens int32[B, n])` (streaming) sees each block of new tokens as it arrives, tokens
    t .. t + n - 1 (-1 after a row's EOS); returning True stops generation there (the rest stays -1).
    Donates `state`."""
    backend = backend or LOCAL_BACKEND
    if steps_per_dispatch < 1:
        raise ValueError(f"steps_per_dispatch must be >= 1, got {steps_per_dispatch}")
    eos = model.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())
    eos_array = np.asarray(eos, np.int32).reshape(-1)
    B = len(tails)
    out = np.full((B, max_new_tokens), -1, np.int32)
    out_logprobs = np.full((B, max_new_tokens), np.nan, np.float32)
    key = jax.random.PRNGKey(seed)
    done = np.zeros(B, bool)
    pending = backend.put(np.zeros(B, np.int32))
    feed = fed_rows(tails, backend)
    if feed is None:  # the first token from the prefill's logits, on its own
        pending, logprobs, key = sample_first_tokens(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
        out[:, 0], out_logprobs[:, 0] = backend.fetch(pending), backend.fetch(logprobs)
        done = np.isin(out[:, 0], eos_array)
    done_device, eos_device = jax.device_put(done), jax.device_put(eos_array)
    stopped = feed is None and on_tokens is not None and bool(on_tokens(0, out[:, :1]))
    t = 0 if feed is not None else 1
    while t < max_new_tokens and not done.all() and not stopped:
        run = decode_steps(  # the first dispatch feeds the tails, if any, and samples the first token after them
            model.params, state, logits, pending, key, done_device, eos_device,
            np.int32(max_new_tokens - t - (feed is not None and t == 0)), *(feed or ()),
            step=backend.append_token, steps=steps_per_dispatch, cfg=model.cfg, dtype=model.dtype, policy=policy,
            temperature=temperature, top_k=top_k, top_p=top_p,
        )
        if feed is not None and t == 0:  # later dispatches feed nothing, through the same program
            feed = (feed[0], backend.put(np.zeros(B, np.int32)))
        state, logits, pending, key, done_device = run.state, run.logits, run.pending, run.key, run.done
        count = int(run.count)
        out[:, t : t + count] = backend.fetch(run.tokens)[:, :count]
        out_logprobs[:, t : t + count] = backend.fetch(run.logprobs)[:, :count]
        done = backend.fetch(done_device)
        stopped = on_tokens is not None and bool(on_tokens(t, out[:, t : t + count]))
        t += count
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


