"""The serving engine over `generate`'s own machinery: every policy, continuous batching, sampling per request.

Notes: docs/modules.md (`kvjax/serving/batch_engine.py`)."""

from __future__ import annotations

import functools
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.engine.decode import decode_plans
from kvjax.engine.decode_loop import decode_steps
from kvjax.engine.api import as_token_lists, policy_or_full
from kvjax.engine.generation import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_STEPS_PER_DISPATCH,
    feed_tokens,
    PrefillPlan,
    prefill_row_steps,
)
from kvjax.models.loading import Model
from kvjax.util.disk_tier import DiskTier
from kvjax.util.lru import BytesLRU
from kvjax.policies import Policy
from kvjax.models.rope import uses_long_factors
from kvjax.cache.rows import clear_row, place_pages, place_row
from kvjax.jenga.allocator import RequestTooLargeError
from kvjax.jenga.row_pool import RowPool
from kvjax.serving.memory import MemorySample, sample_memory
from kvjax.serving.prefix_states import PrefixStates, chunk_boundaries
from kvjax.engine.sampling import sample_first_tokens, validate_sampling
from kvjax.cache.state import CacheCapacityError, KVState, pages_for
from kvjax.engine.decode import layer_segments
from kvjax.engine.step import LOCAL_BACKEND, StepBackend


@dataclass(eq=False)
class BatchRequest:
    """A request and, as it runs, its output: `tokens` (EOS included when one ended it), their `logprobs`,
    and `finish_reason` ("stop": an EOS token, "length": `max_new_tokens`, "abort": `on_tokens` asked to
    stop, "error": the request could not be served, `error` says why) once finished. `on_tokens(request, new_tokens: list[int])` is called after every dispatch that
    gave the request tokens; returning True ends it. `on_finished(request)` is called once, when it finishes."""

    request_id: str
    prompt: np.ndarray
    max_new_tokens: int
    policy: Policy
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos: tuple[int, ...] = ()
    decode_last: int = 0
    on_tokens: Callable[["BatchRequest", list[int]], bool | None] | None = None
    on_finished: Callable[["BatchRequest"], None] | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why a request finished with "error" (its prefill could not fit the cache)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def batch_key(self) -> tuple:
        """What rows of one decode batch must share (static in the compiled step)."""
        return (self.policy, self.temperature, self.top_k, self.top_p, self.eos)


@dataclass(eq=False)
class _Prefilled:
    """A request prefilled on its own, waiting for a row: its one-sequence state and sampling carry; or a
    question on a shared read-only state (`document`), fed in its row before its first token is sampled."""

    request: BatchRequest
    state: KVState
    logits: jax.Array  # f32[1, V] after the prompt (and decode tail)
    pending: int  # the first sampled token, not yet appended (-1 while a question waits to be fed)
    key: jax.Array | None  # the request's PRNG key after the first split (None while a question waits)
    long_rope: bool
    prefix: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32[T] the prompt's whole chunks
    question: np.ndarray | None = None  # int32[T] fed in the row (`submit_question`)
    document: Hashable | None = None  # rows on one `document` read its whole pages from one copy


@dataclass(eq=False)
class _Document:
    """A read-only state rows of one batch read from one copy in its pool: per group, the small pages of its
    whole pages (the first of the table of the row that placed them; each reader's table starts with them,
    refcounted by the allocator), and the requests reading them."""

    blocks: dict[str, tuple[int, ...]]
    readers: set[str]


def row_pages(cfg, capacity: int, page_size: int) -> int:
    """Pages one decoding row can hold at most: `capacity` tokens in each full-attention layer, a window's
    worth in each windowed one (a row decodes one token a step, so a windowed layer never holds more than
    its window; its prefill ran on its own state). Summed over layers and kv heads: what the default pool
    holds per row."""
    return cfg.num_kv_heads * sum(pages_for(min(w, capacity) if w else capacity, page_size) for w in cfg.windows)


def rewritten_layers(cfg, policy: Policy, state: KVState, holes: np.ndarray) -> np.ndarray:
    """bool[L]: layers whose existing slots a decode step under `policy` may rewrite besides appending
    (`decode_plans`: a decode-time evictor's or an accumulating scorer's (H2O's) compressed layers, sliding
    windows), or where `state` has an eviction hole (`holes int[L, ...]`: the next token fills it). Rows
    continuing one state read their own copies of those layers' pages, never shared ones."""
    plans = decode_plans(policy, layer_segments(policy, state, cfg.num_layers, cfg.windows), cfg.windows)
    out = np.zeros(cfg.num_layers, bool)
    for plan in plans:
        out[plan.start: plan.stop] = bool(plan.sliding or plan.accumulate or plan.evict)
    return out | (holes.reshape(cfg.num_layers, -1) >= 0).any(axis=1)


class _Batch:
    """One decode batch: a `max_rows`-row state whose pages come from one Jenga pool (`RowPool`: layer groups
    of different lifetimes and sizes, prefix blocks cached across groups), the rows' sampling carry and
    their requests. The device state's own free stack is unused (empty): the host places every page."""

    def __init__(self, engine: "BatchEngine", key: tuple, long_rope: bool, heads: int):
        cfg = engine.model.cfg
        self.policy, self.temperature, self.top_k, self.top_p, eos = key
        self.eos = jnp.asarray(np.asarray(eos, np.int32).reshape(-1))
        R = engine.max_rows
        # `heads`: kv heads per shard, each shard a pool of its own, all placed alike
        default = R * row_pages(cfg, engine.capacity, engine.page_size) * heads // cfg.num_kv_heads
        # rows whose pages never change after prefill (no compression, no decode-time eviction: those layers
        # get groups of their own, which cache nothing) and whose page metadata is not fitted to each prompt
        # (a selector's key sketch) share and cache whole-block prefixes
        selector = self.policy.selector
        self.pool = RowPool(cfg, self.policy, heads, engine.page_size, jnp.dtype(engine.model.cache_dtype).name,
                            engine.pool_pages, default, caching=selector is None or not selector.keeps_key_sketch,
                            uniform=engine.uniform_pages)
        state = engine.backend.new_state(cfg, R, engine.capacity, engine.page_size, self.pool.num_pages,
                                         engine.model.cache_dtype, long_rope, None)
        self.state = state.replace(num_free=jnp.zeros_like(state.num_free))
        self.tables = np.full((cfg.num_layers, R, heads, state.max_pages), -1, np.int32)  # what the device holds
        self.read_pages: tuple | None = ()  # () until the first row: then the rows' largest bounds
        self.logits = jnp.zeros((R, cfg.vocab_size), jnp.float32)
        self.pending = np.zeros(R, np.int32)
        self.keys = jnp.zeros((R, 2), jnp.uint32)
        self.rows: list[BatchRequest | None] = [None] * R
        self.documents: dict[Hashable, _Document] = {}  # shared read-only states rows read (`submit_question`)

    def free_row(self) -> int | None:
        return next((i for i, r in enumerate(self.rows) if r is None), None)

    @property
    def live(self) -> bool:
        return any(r is not None for r in self.rows)

    def widen_reads(self, row_bounds: tuple | None) -> None:
        """Static read bounds covering every row's (None: every page); wider bounds compile a new step."""
        if self.read_pages == ():
            self.read_pages = row_bounds
        elif self.read_pages is not None:
            self.read_pages = None if row_bounds is None else tuple(map(max, self.read_pages, row_bounds))
        self.state = self.state.replace(read_pages=self.read_pages)


@functools.lru_cache(maxsize=None)
def _row_operations(placement) -> tuple[Callable, Callable, Callable]:
    """`place_row`, `place_pages` and `clear_row` where `placement`'s states live: a row joins and leaves a
    batch on every shard of it, each shard's pool placed alike (its own heads), so on a mesh they run per
    shard (compiled once per mesh)."""
    if not placement.sharded:
        return place_row, place_pages, clear_row
    per_shard = lambda fn, layouts: jax.jit(placement.per_shard(fn, layouts, "state"), donate_argnums=0)  # noqa: E731
    return (per_shard(place_row, ("state", "state", "", "", "", "")), per_shard(place_pages, ("state", "", "")),
            per_shard(clear_row, ("state", "")))


def _padded(pages: list[np.ndarray], none: int) -> jnp.ndarray:
    """int32[K]: `pages` joined and padded with `none` to a power of two (few programs)."""
    pages = np.concatenate(pages) if pages else np.zeros(0, np.int32)
    size = max(8, 1 << int(np.ceil(np.log2(max(len(pages), 1)))))
    return jnp.asarray(np.pad(pages, (0, size - len(pages)), constant_values=none).astype(np.int32))


class BatchEngine:
    """Continuous batching over `generate`'s prefill, step and decode loop (module docstring).

    `max_rows`: rows per decode batch; `capacity`: tokens one request may reach (prompt plus new tokens)
    per layer and head; `pool_pages`: single-head pages of each batch's pool (per shard on a mesh), rounded up
    to whole large pages of its Jenga pool (`kvjax.jenga.row_pool.RowPool`; default: `max_rows` full-capacity
    rows, `row_pages`: a windowed layer needs only its window, and a large page per layer group);
    `prefix_cache_bytes`: room for prefill carries at chunk boundaries, reused by requests whose prompts
    start with the same whole chunks (`kvjax.serving.prefix_states`; 0 turns it off). That budget is
    `self.cache`, a `BytesLRU` that RAG chunk caches may share (`kvjax.rag.ChunkStore(model, lru=engine.cache)`),
    so one least-recently-used order bounds both. `prefill_chunks_per_step`: at most this many prefill
    chunks run between two dispatches (Sarathi's chunked prefills, interleaved at dispatch granularity: live
    rows keep decoding while a long prompt prefills); 0, the default, prefills whole prompts first, which
    measured faster on a 2-core CPU (docs/design.md, "Serving"). `memory_every`: after every this many
    dispatches, record what the dispatched batch's pages hold in `memory_samples` (`kvjax.serving.memory`;
    a host read of the batch's page tables and slot positions; 0, the default, records nothing).
    A request that cannot fit `capacity` is refused at `submit` (ValueError); one that fits but finds no
    free row or too few free pages waits, prefilled, until a row finishes. `backend`: where the states live
    and which step advances them (default one device; `kvjax.distributed.on_mesh` gives a model with its heads
    split over a mesh's devices and its backend; the prefix cache and memory samples are then off).
    `disk_cache`: a `DiskTier` under `self.cache`: what its memory budget evicts is written there, within the
    tier's own budget, and read back on a hit; `disk_cache.stats` reports its hits, hit rate and bytes.
    `uniform_pages`: every layer and head in one page group, each holding the whole context as paging did
    before Jenga (the baseline `eval/bench_jenga_engine.py` measures the pool against)."""

    def __init__(self, model: Model, *, max_rows: int = 8, capacity: int = 2048, page_size: int = 16,
                 pool_pages: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH, prefix_cache_bytes: int = 256 << 20,
                 prefill_chunks_per_step: int = 0, memory_every: int = 0, backend: StepBackend | None = None,
                 disk_cache: DiskTier | None = None, uniform_pages: bool = False):
        if max_rows < 1 or capacity < 1 or steps_per_dispatch < 1:
            raise ValueError(f"max_rows, capacity and steps_per_dispatch must be >= 1, got {max_rows}, {capacity}, "
                             f"{steps_per_dispatch}")
        self.model, self.max_rows, self.capacity, self.page_size = model, max_rows, capacity, page_size
        self.pool_pages, self.chunk_size, self.steps = pool_pages, chunk_size, steps_per_dispatch
        self.uniform_pages = uniform_pages
        if prefill_chunks_per_step < 0:
            raise ValueError(f"prefill_chunks_per_step must be >= 0 (0: no limit), got {prefill_chunks_per_step}")
        self.prefill_chunks_per_step = prefill_chunks_per_step
        if memory_every < 0:
            raise ValueError(f"memory_every must be >= 0 (0: never), got {memory_every}")
        self.backend = backend or LOCAL_BACKEND
        sharded = self.backend.placement.sharded
        if sharded and memory_every:
            raise ValueError("memory_every reads one device's state; it is not available on a mesh")
        self.memory_every = memory_every
        self.memory_samples: list[MemorySample] = []
        self._place_row, self._place_pages, self._clear_row = _row_operations(self.backend.placement)
        # one byte budget for prefix carries and whatever else shares it (RAG chunks: ChunkStore(lru=...), saved
        # documents); no prefix carries on a mesh (their resume inserts a one-device row)
        self.cache = BytesLRU(prefix_cache_bytes, disk=disk_cache)
        self.prefix = PrefixStates(lru=self.cache) if prefix_cache_bytes and not sharded else None
        self.waiting: deque[BatchRequest] = deque()
        self.prefilling: BatchRequest | None = None  # the request whose prefill is in progress
        self._prefill_steps = None  # its generator (`_prefill`)
        self.ready: deque[_Prefilled] = deque()
        self.batches: dict[tuple, _Batch] = {}
        self.requests: dict[str, BatchRequest] = {}
        self._ids = itertools.count()
        self._turn = 0
        self.dispatches = 0
        self.leaked_pages = 0  # device pages a dropped batch's pool still held for requests
        self.shared_pages = 0  # device pages rows did not copy: their prefix or document was in their batch's pool
        self.shared_rows = 0  # rows that found their prefix in their batch's pool (prefix hits)

    # ------------------------------------------------------------------------------------------ requests

    def submit(self, prompt_ids, max_new_tokens: int = 16, policy: Policy | None = None, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, decode_last: int = 0,
               on_tokens: Callable | None = None, request_id: str | None = None) -> str:
        """Queue one request (a token list); returns its id. Arguments as `generate`'s for one prompt."""
        (prompt,) = as_token_lists([prompt_ids], self.model.cfg.vocab_size)
        validate_sampling(temperature, top_k, top_p)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0 <= decode_last < len(prompt):
            raise ValueError(f"decode_last must be in [0, prompt length {len(prompt)}), got {decode_last}")
        if len(prompt) + max_new_tokens > self.capacity:
            raise ValueError(f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                             f"engine's capacity of {self.capacity} tokens per request")
        eos = self.model.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        policy = policy_or_full(policy)
        policy.validate(self.page_size)
        request = BatchRequest(request_id, prompt, max_new_tokens, policy, float(temperature), int(top_k),
                               float(top_p), int(seed), tuple(int(e) for e in eos), decode_last, on_tokens)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def submit_prefilled(self, state: KVState, logits, max_new_tokens: int = 16, policy: Policy | None = None, *,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                         eos_token_id=None, on_tokens: Callable | None = None, request_id: str | None = None) -> str:
        """Queue a request whose cache is already built: a one-sequence `state` (for example CacheClip's
        assembled and recomputed RAG context, `kvjax.rag.rag_prefill(...).state`) and its last `logits
        f32[1, V]`. It continues as an ordinary request: first token sampled from `logits`, then decoded in
        a batch with `policy`'s decode-time roles (default full). Its page table may be narrower than the
        engine's capacity, not wider. On a mesh the state is stacked where the engine's states live (each head
        shard's pages on its own pool: `kvjax.load_state(..., backend=engine.backend)`)."""
        request = self._prefilled_request(state, max_new_tokens, policy, temperature, top_k, top_p, seed, eos_token_id,
                                          on_tokens, request_id)
        self._sample_first(request, state, jnp.asarray(logits, jnp.float32).reshape(1, -1), state.long_rope)
        return request.request_id

    def submit_question(self, state: KVState, logits, question_ids, max_new_tokens: int = 16,
                        policy: Policy | None = None, *, document: Hashable, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int = 0, eos_token_id=None, on_tokens: Callable | None = None,
                        on_finished: Callable | None = None, request_id: str | None = None) -> str:
        """Queue a question on a read-only one-sequence `state` (as `submit_prefilled`'s; a saved document,
        `kvjax.serving.saved_documents`) that requests name by one `document` key: `question_ids` are fed by
        decode in the request's row, then it is answered as `submit_prefilled`'s request. Rows of a batch on
        one document read its whole pages from one copy in the pool, placed by the first of them and freed
        with the last; each copies only the pages it writes (each head's partial last page, and every page
        of a layer whose slots decode rewrites: `rewritten_layers`). `state` is neither changed nor donated;
        `logits f32[1, V]` (None: zeros, with a question to feed). `on_finished(request)`: `BatchRequest`'s."""
        question = np.asarray(question_ids, np.int32).reshape(-1)
        if logits is None and not len(question):
            raise ValueError("submit_question needs a question to feed when the state comes without logits")
        lengths = self._over_shards(self.backend.fetch(state.lengths))
        if int(lengths.max()) + len(question) + max_new_tokens > self.capacity:
            raise ValueError(f"a state of {int(lengths.max())} slots per head, a question of {len(question)} tokens "
                             f"and {max_new_tokens} new tokens exceed the engine's capacity of {self.capacity}")
        request = self._prefilled_request(state, max_new_tokens, policy, temperature, top_k, top_p, seed, eos_token_id,
                                          on_tokens, request_id, on_finished)
        logits = (jnp.zeros((1, self.model.cfg.vocab_size), jnp.float32) if logits is None
                  else jnp.asarray(logits, jnp.float32).reshape(1, -1))
        self.ready.append(_Prefilled(request, state, logits, -1, None, state.long_rope, question=question,
                                     document=document))
        return request.request_id

    def _prefilled_request(self, state: KVState, max_new_tokens: int, policy: Policy | None, temperature: float,
                           top_k: int, top_p: float, seed: int, eos_token_id, on_tokens: Callable | None,
                           request_id: str | None, on_finished: Callable | None = None) -> BatchRequest:
        """The checked and registered request of `submit_prefilled` or `submit_question` for `state`."""
        stacked = state.page_table.ndim == 6  # [Sd, Sm, L, B, H, P]: a mesh's stacked state
        if stacked != self.backend.placement.sharded:
            raise ValueError(
                "submit_prefilled got a one-device state, but this engine's states live on a mesh: load it with "
                "backend=engine.backend" if self.backend.placement.sharded else "submit_prefilled got a state "
                f"stacked over {state.page_table.shape[:2]} mesh shards, but this engine's states live on one device")
        if state.page_table.shape[-3] * (state.page_table.shape[0] if stacked else 1) != 1:
            raise ValueError(f"submit_prefilled takes a one-sequence state, got page table {state.page_table.shape}")
        if state.page_size != self.page_size or state.max_pages > pages_for(self.capacity, self.page_size):
            raise ValueError(f"the state's page size {state.page_size} and {state.max_pages} pages per head must "
                             f"fit the engine's {self.page_size} and {pages_for(self.capacity, self.page_size)}")
        validate_sampling(temperature, top_k, top_p)
        eos = self.model.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = BatchRequest(request_id, np.zeros(0, np.int32), max_new_tokens, policy_or_full(policy),
                               float(temperature), int(top_k), float(top_p), int(seed), tuple(int(e) for e in eos),
                               0, on_tokens, on_finished)
        self.requests[request_id] = request
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.ready or any(b.live for b in self.batches.values()))

    def run(self) -> dict[str, BatchRequest]:
        """Step until every request has finished; returns every request by id."""
        while self.has_work:
            self.step()
        return dict(self.requests)

    # ------------------------------------------------------------------------------------------ one step

    def step(self) -> None:
        """Insert prefilled requests that fit, prefill (`_advance_prefill`: whole prompts by default, at most
        `prefill_chunks_per_step` chunks when set, the rest of a prompt continuing next step), then run one
        dispatch of one live batch (batches take turns)."""
        self._insert_ready()
        self._advance_prefill()
        live = [b for b in self.batches.values() if b.live]
        if live:
            self._dispatch(live[self._turn % len(live)])
            self._turn += 1
        elif self.ready:  # nothing live will free pages: the request can never fit
            item = self.ready[0]
            held = int(self._held_pages(item.state).sum())
            batch = self.batches[item.request.batch_key + (item.long_rope,)]
            raise CacheCapacityError(
                f"request {item.request.request_id} holds {held} pages per shard, more than a batch pool of "
                f"{batch.pool.num_pages} has room for: raise pool_pages", held, batch.pool.num_pages)
        self._drop_idle_batches()

    def _drop_idle_batches(self) -> None:
        """Free the pools of batches with no live row and no prefilled request waiting for them."""
        wanted = {item.request.batch_key + (item.long_rope,) for item in self.ready}
        for key in [k for k, b in self.batches.items() if not b.live and k not in wanted]:
            self.leaked_pages += self.batches.pop(key).pool.live_pages()

    def _advance_prefill(self) -> None:
        """Prefill chunks until `prefill_chunks_per_step` ran (0: until no waiting request is left, or one
        prefilled request waits for a row), inserting each request whose prefill ends."""
        budget = self.prefill_chunks_per_step or float("inf")
        ran = 0
        while ran < budget:
            if self._prefill_steps is None:
                if not self.waiting or self.ready:
                    return
                self.prefilling = self.waiting.popleft()
                self._prefill_steps = self._prefill(self.prefilling)
            try:
                next(self._prefill_steps)
                ran += 1
                continue
            except StopIteration:  # prefilled, its first token sampled: ready for a row
                pass
            except CacheCapacityError as error:  # this request cannot be served; the others go on
                self.prefilling.finish_reason, self.prefilling.error = "error", str(error)
            self.prefilling = self._prefill_steps = None
            self._insert_ready()

    def _prefill(self, request: BatchRequest):
        """The request's prefill as a generator yielding after every chunk (`prefill_row_steps`); at its end
        the decode tail is fed and the first token sampled (`_sample_first`)."""
        model, prompt, tail = self.model, request.prompt, request.decode_last
        declared = len(prompt) + request.max_new_tokens
        head = prompt[: len(prompt) - tail]
        boundaries = chunk_boundaries(head, self.chunk_size)
        resume = on_chunk = None
        compressor = request.policy.compressor
        if self.prefix is not None and not (compressor is not None and compressor.chunks is not None):
            # what else shapes the prefill's carry (the model is the engine's)
            key = (request.policy, uses_long_factors(model.cfg, declared), self.capacity, self.page_size,
                   self.chunk_size, str(model.cache_dtype))
            resume = self.prefix.lookup(key, boundaries, len(head))
            on_chunk = lambda carry: self.prefix.store(key, boundaries, carry)  # noqa: E731
        plan = PrefillPlan(request.policy, self.page_size, self.capacity, self.chunk_size, declared,
                           request.max_new_tokens + tail, self.backend, resume=resume, on_chunk=on_chunk)
        state, logits = yield from prefill_row_steps(model, [head], plan)
        state, logits = feed_tokens(model, state, logits, [prompt[len(prompt) - tail:]], request.policy, self.backend)
        whole = len(head) // self.chunk_size * self.chunk_size  # prefilled in the same chunks by every prompt
        self._sample_first(request, state, logits, uses_long_factors(model.cfg, declared), head[:whole])

    def _sample_first(self, request: BatchRequest, state: KVState, logits: jax.Array, long_rope: bool,
                      prefix: np.ndarray | None = None) -> None:
        """The first token from the prefill's logits (as `generate` samples it); the request then waits for a
        row unless that token ended it."""
        first, logprob, key = self._first_token(request, logits)
        if self._emit(request, [first], [logprob]):
            return
        self.ready.append(_Prefilled(request, state, logits, first, key, long_rope,
                                     np.zeros(0, np.int32) if prefix is None else np.asarray(prefix)))

    def _first_token(self, request: BatchRequest, logits: jax.Array) -> tuple[int, float, jax.Array]:
        """The request's first token sampled from `logits f32[1, V]` as `generate` samples it, its log-prob,
        and the request's PRNG key after."""
        token, logprob, key = sample_first_tokens(logits, jax.random.PRNGKey(request.seed),
                                                  temperature=request.temperature, top_k=request.top_k,
                                                  top_p=request.top_p)
        return int(token[0]), float(logprob[0]), key

    def _insert_ready(self) -> None:
        """Put prefilled requests into free rows of their batch, on pages its pool has room for now (a
        request that finds no row or no room waits). A prompt's whole chunks already in the pool (cached by
        an earlier row of the batch) are shared, not copied; its own then join the pool's prefix cache."""
        still = deque()
        while self.ready:
            item = self.ready.popleft()
            key = item.request.batch_key + (item.long_rope,)
            heads = item.state.page_table.shape[-2]  # kv heads per shard
            if key not in self.batches:
                self.batches[key] = _Batch(self, key[:-1], item.long_rope, heads)
            batch = self.batches[key]
            slot = batch.free_row()
            if slot is None or not self._place(batch, slot, item):
                still.append(item)
                continue
            if item.question is not None:
                self._feed_question(batch, slot, item)
                continue
            batch.logits = batch.logits.at[slot].set(item.logits[0])
            batch.pending[slot] = item.pending
            batch.keys = batch.keys.at[slot].set(item.key)
            batch.rows[slot] = item.request
        self.ready = still

    def _over_shards(self, array: np.ndarray, reduce=np.max) -> np.ndarray:
        """A fetched per-head array `[..., L, B, H]` (on a mesh `[Sd, Sm, L, b, h]`) as `[L, B, H]`, its shards
        (all placed alike) reduced by `reduce`: the most (or least) any shard's head there holds."""
        return reduce(array.reshape((-1,) + array.shape[-3:]), axis=0)

    def _held_pages(self, state: KVState) -> np.ndarray:
        """int[L, H]: logical pages each (layer, kv head) of a one-sequence state holds (on a mesh: the most
        any shard's head there holds)."""
        table = self.backend.fetch(state.page_table)  # [..., L, 1, H, P]
        return self._over_shards((table >= 0).sum(axis=-1))[:, 0]

    def _place(self, batch: _Batch, slot: int, item: _Prefilled) -> bool:
        """Take pages for `item` from `batch.pool` and put it into row `slot`; False when the pool has no
        room for it now. A question's row on a document already in the pool starts its table with the
        document's whole pages (shared, not copied); the first row on it copies them in for the others."""
        pool, rid, P = batch.pool, item.request.request_id, batch.tables.shape[-1]
        hit = pool.hit(item.prefix, self.chunk_size)
        held = np.minimum(self._held_pages(item.state), P)
        document = None if item.document is None else batch.documents.get(item.document)
        reused = pool.hit_blocks(hit) if document is None else {g: len(p) for g, p in document.blocks.items()}
        if not self._room_to_finish(batch, item, held, reused):
            return False
        if item.question is not None:  # the question's pages, placed ahead of its feed
            lengths = self._over_shards(self.backend.fetch(item.state.lengths))
            ahead = pool.pages_ahead(lengths, np.array([len(item.question)]), item.state.read_pages, P)[:, 0]
            held = np.maximum(held, ahead)
        try:
            if document is not None:
                pool.allocator.share(rid, document.blocks)
            placed = pool.allocator.reserve(rid, pool.blocks(held), hit)
        except RequestTooLargeError:
            placed = None  # `step` reports it when nothing live can make room
        if placed is None:
            pool.allocator.free(rid)
            return False
        table = pool.table(rid, P)
        if item.document is None:
            copy = ~pool.shared(hit, P)
        elif document is None:  # the first row on the document: its whole pages copied in, for the others too
            lengths = self._over_shards(self.backend.fetch(item.state.lengths), np.min)[:, 0]
            holes = self._over_shards(self.backend.fetch(item.state.hole))
            blocks = pool.whole_blocks(lengths, rewritten_layers(self.model.cfg, batch.policy, item.state, holes))
            tables = pool.allocator.block_tables(rid)
            document = batch.documents[item.document] = _Document({g: tables[g][:n] for g, n in blocks.items()}, set())
            copy = np.ones_like(table, bool)
        else:
            copy = ~pool.first_blocks(reused, P)
        if document is not None:
            document.readers.add(rid)
        fresh = [pool.device_pages(g, pages) for g, pages in enumerate(placed.new_pages.values())]
        batch.widen_reads(item.state.read_pages)
        # the row's own read bounds are static data: dropped, so one program places every row
        batch.state = self._place_row(batch.state, item.state.replace(read_pages=None), jnp.int32(slot),
                                      jnp.asarray(table), jnp.asarray(copy), _padded(fresh, pool.num_pages))
        batch.tables[:, slot] = table
        self.shared_pages += int((~copy).sum()) * self.model.cfg.num_kv_heads // table.shape[1]
        self.shared_rows += hit is not None
        if len(item.prefix):
            pool.allocator.register_prefix(rid, item.prefix)
        return True

    def _feed_question(self, batch: _Batch, slot: int, item: _Prefilled) -> None:
        """Feed the question of `item`, placed in row `slot` on pages placed ahead for it, by decode steps of
        the batch in which no other row appends; then sample its first token from the logits after it."""
        rows = [item.question if row == slot else np.zeros(0, np.int32) for row in range(self.max_rows)]
        logits = batch.logits.at[slot].set(item.logits[0])
        batch.state, batch.logits = feed_tokens(self.model, batch.state, logits, rows, batch.policy, self.backend)
        first, logprob, key = self._first_token(item.request, batch.logits[slot][None])
        batch.pending[slot] = first
        batch.keys = batch.keys.at[slot].set(key)
        batch.rows[slot] = item.request
        if self._emit(item.request, [first], [logprob]):
            self._release_row(batch, slot)

    def _release_row(self, batch: _Batch, slot: int) -> None:
        """Empty row `slot` of `batch`, its request finished: its pages back to the pool (shared ones once
        their last reader goes) and its place among a document's readers."""
        request_id = batch.rows[slot].request_id
        batch.state = self._clear_row(batch.state, jnp.int32(slot))
        batch.tables[:, slot] = -1
        batch.pool.allocator.free(request_id)
        batch.rows[slot] = None
        for key, document in list(batch.documents.items()):
            document.readers.discard(request_id)
            if not document.readers:
                del batch.documents[key]

    def _room_to_finish(self, batch: _Batch, item: _Prefilled, held: np.ndarray, reused: dict[str, int]) -> bool:
        """Whether the pool can hold `item` (holding `held int[L, H]` pages, of which `reused` small pages per
        group live rows hold already: a prefix hit's, a document's) and every live row of `batch` up to their
        last tokens (`RowPool.room_to_finish`): a row joins only then, so rows never run out of pages
        mid-decode (no preemption)."""
        pool, P = batch.pool, batch.tables.shape[-1]
        lengths = self._over_shards(self.backend.fetch(batch.state.lengths))  # [L, R, H]
        remaining = np.array([0 if r is None else r.max_new_tokens - len(r.tokens) for r in batch.rows])
        final = pool.pages_ahead(lengths, remaining, batch.read_pages or None, P)  # [L, R, H]
        row_lengths = self._over_shards(self.backend.fetch(item.state.lengths))  # [L, 1, H]
        left = np.array([item.request.max_new_tokens - len(item.request.tokens)
                         + (0 if item.question is None else len(item.question))])
        mine = np.maximum(pool.pages_ahead(row_lengths, left, item.state.read_pages, P)[:, 0], held)
        return pool.room_to_finish({r.request_id: final[:, slot] for slot, r in enumerate(batch.rows) if r is not None},
                                   mine, reused)

    def _place_ahead(self, batch: _Batch, limit: np.ndarray) -> None:
        """Reserve the pages the next dispatch's tokens (`limit int[R]` a row at most) may write, in the
        pool, and place them in the device tables before the step runs (the step takes none itself)."""
        pool = batch.pool
        lengths = self._over_shards(self.backend.fetch(batch.state.lengths))  # [L, R, H]
        ahead = pool.pages_ahead(lengths, np.minimum(limit, self.steps), batch.read_pages or None,
                                 batch.tables.shape[-1])
        fresh = []
        for slot, request in enumerate(batch.rows):
            if request is None:
                continue
            placed = pool.allocator.reserve(request.request_id, pool.blocks(ahead[:, slot]))
            if placed is None:
                raise CacheCapacityError(
                    f"the batch pool of {pool.num_pages} pages per shard is full: request {request.request_id} "
                    "needs pages for its next tokens; raise pool_pages or lower max_rows", 1, 0)
            if any(placed.new_pages.values()):
                fresh += [pool.device_pages(g, pages) for g, pages in enumerate(placed.new_pages.values())]
                batch.tables[:, slot] = pool.table(request.request_id, batch.tables.shape[-1])
        if fresh:
            batch.state = self._place_pages(batch.state, jnp.asarray(batch.tables), _padded(fresh, pool.num_pages))

    def _dispatch(self, batch: _Batch) -> None:
        R = self.max_rows
        limit = np.array([0 if r is None else r.max_new_tokens - len(r.tokens) for r in batch.rows], np.int32)
        self._place_ahead(batch, limit)
        done = jnp.asarray(limit <= 0)
        run = decode_steps(
            self.model.params, batch.state, batch.logits, jnp.asarray(batch.pending), batch.keys, done, batch.eos,
            jnp.asarray(limit), step=self.backend.append_token, steps=self.steps, cfg=self.model.cfg,
            dtype=self.model.dtype, policy=batch.policy, temperature=batch.temperature, top_k=batch.top_k,
            top_p=batch.top_p,
        )
        batch.state, batch.logits, batch.keys = run.state, run.logits, run.key
        batch.pending = np.array(run.pending)
        self.dispatches += 1
        error = self.backend.overflow_error(batch.state)
        if error is not None:
            raise error
        if self.memory_every and self.dispatches % self.memory_every == 0:
            live = [slot for slot, request in enumerate(batch.rows) if request is not None]
            self.memory_samples.append(sample_memory(batch.state, live, self.dispatches))
        count = int(run.count)
        tokens, logprobs = np.asarray(run.tokens)[:, :count], np.asarray(run.logprobs)[:, :count]
        for slot in range(R):
            request = batch.rows[slot]
            if request is None:
                continue
            got = tokens[slot] >= 0
            if self._emit(request, tokens[slot][got].tolist(), logprobs[slot][got].tolist()):
                self._release_row(batch, slot)

    def _emit(self, request: BatchRequest, tokens: list[int], logprobs: list[float]) -> bool:
        """Record new tokens; returns whether the request finished."""
        request.tokens += tokens
        request.logprobs += logprobs
        if tokens and tokens[-1] in request.eos:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = "length"
        if tokens and request.on_tokens is not None and request.on_tokens(request, tokens) and not request.finished:
            request.finish_reason = "abort"
        if request.finished and request.on_finished is not None:
            request.on_finished(request)
        return request.finished


__all__ = ["BatchEngine", "BatchRequest"]
