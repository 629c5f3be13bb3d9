"""Continuous-batching engine over the Jenga allocator and one device pool.

Each `step()` schedules running requests (oldest first: a decode token or the next prefill chunk), then
admits waiting requests first come, first served while the allocator can place their first chunk after
their prefix-cache hit; runs the batch through the model (kvjax.serving.paged_step: K/V written to and
read from the pool through the allocator's page tables); commits what was computed; samples greedily.
A request whose growth does not fit preempts the most recently admitted one (freed, recomputed later,
as vLLM does). A request that could not fit even alone in the pool is rejected at submit.

    engine = Engine(model, windows=alternating_windows(cfg.num_layers, 32), pool_bytes=8 << 20)
    rid = engine.submit(prompt_ids, max_new_tokens=16)
    outputs = engine.run()            # request id -> RequestOutput
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.generation import as_token_lists
from kvjax.loading import Model
from kvjax.serving.allocator import JengaAllocator, RequestTooLargeError
from kvjax.serving.model_groups import build_layer_groups, check_row_aligned
from kvjax.serving.paged_step import StepGeometry, paged_model_step
from kvjax.serving.views import apply_page_copies, make_pool


@dataclass
class RequestOutput:
    """A finished request. token_ids int32[n]: the generated tokens; logits f32[n, V] (with
    record_logits): the logits each token was chosen from. cached_prompt_tokens: prompt tokens served from
    the prefix cache at the first admission. finish_reason: "length" or "eos"."""

    request_id: str
    prompt_len: int
    token_ids: np.ndarray
    finish_reason: str
    cached_prompt_tokens: int
    num_preemptions: int
    logits: np.ndarray | None = None


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool (committed)
    admitted_at: int = -1  # admission counter of the latest admission (preemption victims: the largest)
    first_hit: int | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class EngineMetrics:
    """Counters of an engine's run. Hit rate: prompt tokens served from the prefix cache over the tokens
    asked at each admission (re-admissions after preemption included)."""

    steps: int = 0
    model_calls: int = 0
    admissions: int = 0
    preemptions: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0
    admitted_tokens: int = 0
    hit_tokens: int = 0
    peak_running: int = 0  # most requests resident (holding pages) at once
    running_sum: int = 0
    step_seconds: float = 0.0
    waste_samples: list[dict] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.admitted_tokens if self.admitted_tokens else 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0

    @property
    def waste_fraction(self) -> float:
        """Waste over held bytes, summed over the stats samples."""
        held = sum(s["held_bytes"] for s in self.waste_samples)
        return sum(s["waste_bytes"] for s in self.waste_samples) / held if held else 0.0


def _bucket(n: int, minimum: int = 1) -> int:
    """Next power of two >= max(n, minimum): few distinct shapes, few compiles."""
    size = minimum
    while size < n:
        size *= 2
    return size


class Engine:
    """Serves greedy generation for many requests at once over one pool.

    Args:
        model: a kvjax Model (Llama / Mistral / Qwen2 architecture; LongRoPE is not supported).
        windows: per layer, a sliding window in tokens or None for full attention (e.g.
            alternating_windows(num_layers, W) for Gemma-2's pattern). Default: the config's
            sliding_window on every layer (Mistral), full attention when it has none.
        pool_bytes: size of the device pool.
        paging: "jenga" (a group per layer kind, out-of-window pages released) or "uniform" (one group
            holding every token of every layer, vLLM v0's layout; the same attention).
        tokens_per_page, large_page_bytes: page geometry (kvjax.serving.layout).
        chunk_size: most prompt tokens one request computes in a step.
        max_num_seqs: most requests running at once. max_num_batched_tokens: tokens per step.
        enable_prefix_caching: reuse cached blocks of earlier requests' prompts.
        eos_token_id: stops a request (default: the model's).
        record_logits: keep the logits of every generated token (tests).
        stats_every: sample allocator.stats() every this many steps (0: never) for waste accounting.
        buckets: how step shapes are padded. "pow2": rows, chunk and pages read per group round up to
            powers of two (a step costs about what it computes; a compile per new shape). "max": every
            step has the largest shapes (max_num_seqs rows, chunk_size tokens, every page a request can
            read), so there are two compiles (decode and prefill) but each step reads the most pages.
        max_model_len: longest prompt plus max_new_tokens a request may ask for (submit raises past it);
            bounds the pages a "max" step reads (default: every page of the pool).
    """

    def __init__(
        self,
        model: Model,
        *,
        pool_bytes: int,
        windows: Sequence[int | None] | None = None,
        paging: str = "jenga",
        tokens_per_page: int = 16,
        large_page_bytes: int | None = None,
        chunk_size: int = 64,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        enable_prefix_caching: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
        record_logits: bool = False,
        stats_every: int = 0,
        buckets: str = "pow2",
        max_model_len: int | None = None,
    ) -> None:
        cfg = model.cfg
        if cfg.rope.rope_type == "longrope":
            raise ValueError("the serving engine does not support LongRoPE models (rope factors chosen per request)")
        for name, value in (("chunk_size", chunk_size), ("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.windows = (cfg if windows is None else cfg.with_windows(windows)).windows
        dtype = jnp.dtype(model.dtype).name
        self.groups = build_layer_groups(self.windows, cfg.num_kv_heads, cfg.head_dim, dtype, tokens_per_page, paging)
        self.allocator = JengaAllocator(
            self.groups.specs, pool_bytes, large_page_bytes=large_page_bytes, enable_prefix_caching=enable_prefix_caching
        )
        self.layout = self.allocator.layout
        check_row_aligned(self.groups, self.layout)
        self.geometry = StepGeometry(self.layout, self.groups)
        self.pool = make_pool(self.layout)
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = frozenset(model.eos_token_ids if eos_token_id is None else np.atleast_1d(eos_token_id).tolist())
        self.record_logits = record_logits
        self.stats_every = stats_every
        if buckets not in ("pow2", "max"):
            raise ValueError(f"buckets must be 'pow2' or 'max', got {buckets!r}")
        self.buckets = buckets
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        self.max_model_len = max_model_len
        # Most pages a step reads per group: a sliding group only its window and chunk, others everything.
        self._max_read_pages = []
        for group, spec in enumerate(self.groups.specs):
            longest = max_model_len or self.layout.num_pages(group) * spec.tokens_per_page
            pages = self.groups.peak_pages(group, longest, chunk_size, keep_window=False)
            self._max_read_pages.append(_bucket(min(self.layout.num_pages(group), pages)))
        self.keep_window = enable_prefix_caching and self.allocator.keep_shared_prefix_window
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # in admission order
        self.finished: dict[str, RequestOutput] = {}
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self._known: set[str] = set()

    # =================================================================================================
    # Requests
    # =================================================================================================
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, request_id: str | None = None) -> str:
        """Queues a request; returns its id. Raises RequestTooLargeError when the request could not fit
        even alone in the pool (its prompt plus max_new_tokens, at the engine's chunk size)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        request_id = f"req{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} was already submitted")
        prompt = as_token_lists([prompt_ids], self.model.cfg.vocab_size, f"prompt of request {request_id!r}")[0]
        if self.max_model_len is not None and len(prompt) + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        self._check_fits_pool(request_id, len(prompt), max_new_tokens)
        self._known.add(request_id)
        self.waiting.append(_Sequence(request_id, prompt.tolist(), max_new_tokens))
        self.metrics.prompt_tokens += len(prompt)
        return request_id

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> dict[str, tuple[int, int]]:
        """Per group: (small pages, large pages) a request holds at most (the bound admission uses)."""
        cached = prompt_len + max_new_tokens - 1  # the last generated token is never fed back
        return self.groups.peak_large_pages(self.layout, cached, self.chunk_size, self.keep_window)

    def _check_fits_pool(self, request_id: str, prompt_len: int, max_new_tokens: int) -> None:
        need = self.pages_needed(prompt_len, max_new_tokens)
        large = sum(n for _, n in need.values())
        if large > self.layout.num_large_pages:
            per_group = ", ".join(f"{name}: {small} pages ({n} large)" for name, (small, n) in need.items())
            raise RequestTooLargeError(
                f"request {request_id!r} ({prompt_len} prompt + {max_new_tokens} new tokens) needs up to {large} "
                f"large pages of {self.layout.large_page_bytes} bytes [{per_group}] but the pool has "
                f"{self.layout.num_large_pages} ({self.layout.pool_bytes} bytes); it can never run"
            )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> dict[str, RequestOutput]:
        """Steps until every submitted request has finished; returns all finished outputs by id."""
        while self.has_unfinished:
            self.step()
        return dict(self.finished)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[np.ndarray]:
        """Submits `prompts`, runs them to completion and returns their tokens, in order."""
        ids = [self.submit(p, max_new_tokens) for p in prompts]
        self.run()
        return [self.finished[i].token_ids for i in ids]

    # =================================================================================================
    # One step
    # =================================================================================================
    def step(self) -> list[RequestOutput]:
        """Schedules, runs and commits one batch; returns the requests that finished in it."""
        started = time.perf_counter()
        scheduled = self._schedule()
        if not scheduled and self.has_unfinished:
            raise RuntimeError(
                f"engine made no progress: {len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.allocator.num_free_large_pages()} free large pages (a bug: admission bounds should prevent this)"
            )
        metrics = self.metrics
        metrics.steps += 1
        metrics.running_sum += len(self.running)
        metrics.peak_running = max(metrics.peak_running, len(self.running))
        sampled = self._execute(scheduled)
        done = self._commit(scheduled, sampled)
        if self.stats_every and metrics.steps % self.stats_every == 0:
            self._sample_stats()
        metrics.step_seconds += time.perf_counter() - started
        return done

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """[(request, tokens to compute this step)]: running requests first (oldest first), preempting the
        newest when one cannot grow, then admissions."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[_Sequence, int]] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted for an older request this step
                continue
            count = min(len(seq.tokens) - seq.computed, self.chunk_size, budget)
            chunk = seq.tokens[seq.computed : seq.computed + count]
            while (allocation := self.allocator.allocate(seq.request_id, chunk)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if allocation is None:
                continue
            self._apply_copies(allocation.copies)
            scheduled.append((seq, count))
            budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.tokens
            hit = self.allocator.get_computed_prefix(tokens)
            count = min(len(tokens) - hit.num_tokens, self.chunk_size, budget)
            allocation = self.allocator.allocate(seq.request_id, tokens[hit.num_tokens : hit.num_tokens + count], hit)
            if allocation is None:
                break  # first come, first served: later requests wait behind it
            self._apply_copies(allocation.copies)
            self.waiting.popleft()
            seq.computed = hit.num_tokens
            seq.admitted_at = next(self._admissions)
            if seq.first_hit is None:
                seq.first_hit = hit.num_tokens
            self.running.append(seq)
            self.metrics.admissions += 1
            self.metrics.admitted_tokens += len(tokens)
            self.metrics.hit_tokens += hit.num_tokens
            scheduled.append((seq, count))
            budget -= count
        return scheduled

    def _preempt(self, seq: _Sequence) -> None:
        """Frees the request's pages; it waits at the front of the queue and recomputes its tokens (its
        cached prefix blocks can still hit)."""
        self.allocator.free(seq.request_id)
        self.running.remove(seq)
        seq.computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.metrics.preemptions += 1

    def _apply_copies(self, copies) -> None:
        if copies:
            self.pool = apply_page_copies(self.pool, self.layout, copies)

    def _execute(self, scheduled: list[tuple[_Sequence, int]]) -> dict[int, tuple[int, np.ndarray | None]]:
        """Runs the batch: decode rows (one token) and prefill rows (chunks) as two calls, so decodes are
        not padded to the chunk. Returns, per scheduled index, (next token, logits or None)."""
        out: dict[int, tuple[int, np.ndarray | None]] = {}
        decode = [i for i, (_, count) in enumerate(scheduled) if count == 1]
        prefill = [i for i, (_, count) in enumerate(scheduled) if count > 1]
        for rows in (decode, prefill):
            if rows:
                out.update(self._run_rows([scheduled[i] for i in rows], rows))
        return out

    def _run_rows(self, batch: list[tuple[_Sequence, int]], indices: list[int]) -> dict:
        padded = self.buckets == "max"
        B = _bucket(self.max_num_seqs if padded else len(batch))
        decoding = all(count == 1 for _, count in batch)
        C = 1 if decoding else _bucket(self.chunk_size if padded else max(count for _, count in batch), 8)
        tokens = np.zeros((B, C), np.int32)
        starts = np.zeros((B,), np.int32)
        num_new = np.zeros((B,), np.int32)
        slices = [[] for _ in self.groups.specs]
        offsets = np.zeros((len(self.groups.specs), B), np.int32)
        for row, (seq, count) in enumerate(batch):
            tokens[row, :count] = seq.tokens[seq.computed : seq.computed + count]
            starts[row], num_new[row] = seq.computed, count
            tables = self.allocator.block_tables(seq.request_id)
            for group, spec in enumerate(self.groups.specs):
                first = self.groups.read_offset_block(group, seq.computed)
                offsets[group, row] = first
                slices[group].append(tables[spec.name][first:])
        table_arrays = []
        for group, rows in enumerate(slices):
            width = self._max_read_pages[group] if padded else _bucket(max(len(r) for r in rows))
            table = np.full((B, width), -1, np.int32)
            for row, pages in enumerate(rows):
                if len(pages) > width:
                    raise AssertionError(f"group {self.groups.specs[group].name!r}: {len(pages)} pages to read, bucket {width}")
                table[row, : len(pages)] = pages
            table_arrays.append(jnp.asarray(table))
        self.pool, next_tokens, logits = paged_model_step(
            self.model.params, self.pool, jnp.asarray(tokens), jnp.asarray(starts), jnp.asarray(num_new),
            tuple(table_arrays), tuple(jnp.asarray(o) for o in offsets),
            geo=self.geometry, cfg=self.model.cfg, dtype=self.model.dtype,
        )
        self.metrics.model_calls += 1
        next_host = np.asarray(next_tokens)
        logits_host = np.asarray(logits) if self.record_logits else None
        return {
            index: (int(next_host[row]), None if logits_host is None else logits_host[row])
            for row, index in enumerate(indices)
        }

    def _commit(self, scheduled: list[tuple[_Sequence, int]], sampled: dict) -> list[RequestOutput]:
        done = []
        for index, (seq, count) in enumerate(scheduled):
            self._apply_copies(self.allocator.commit(seq.request_id).copies)
            seq.computed += count
            self.metrics.computed_tokens += count
            if seq.computed < len(seq.tokens):
                continue  # prefill continues next step
            token, logits = sampled[index]
            seq.output.append(token)
            if logits is not None:
                seq.logits.append(logits)
            self.metrics.generated_tokens += 1
            reason = "eos" if token in self.eos else ("length" if len(seq.output) >= seq.max_new_tokens else None)
            if reason is not None:
                done.append(self._finish(seq, reason))
        return done

    def _finish(self, seq: _Sequence, reason: str) -> RequestOutput:
        self.allocator.free(seq.request_id)
        self.running.remove(seq)
        self.metrics.finished += 1
        output = RequestOutput(
            request_id=seq.request_id,
            prompt_len=len(seq.prompt),
            token_ids=np.asarray(seq.output, np.int32),
            finish_reason=reason,
            cached_prompt_tokens=seq.first_hit or 0,
            num_preemptions=seq.num_preemptions,
            logits=np.stack(seq.logits) if seq.logits else None,
        )
        self.finished[seq.request_id] = output
        return output

    def _sample_stats(self) -> None:
        stats = self.allocator.stats()
        self.metrics.waste_samples.append(
            {
                "step": self.metrics.steps,
                "held_bytes": stats.held_bytes,
                "needed_bytes": stats.needed_bytes,
                "reusable_bytes": stats.reusable_bytes,
                "waste_bytes": stats.waste_bytes,
                "running": len(self.running),
            }
        )
