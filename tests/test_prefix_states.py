"""Prefix reuse in the batch engine (`kvjax.serving.prefix_states`): a prefill resumed from another prompt's
carry at a shared chunk boundary equals a prefill from scratch, and requests with a shared prefix get
`generate`'s tokens while skipping the shared chunks."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from _sharding_worker import VOCAB
from kvjax.engine.generation import PrefillPlan, prefill_rows
from kvjax.serving.batch_engine import BatchEngine
from kvjax.serving.prefix_states import PrefixStates, chunk_boundaries
from kvjax.cache.state import gather_layer
# the engine tests' shapes and fixtures: one prefill program per policy serves both modules
from test_batch_engine import CAPACITY, CHUNK, PAGE_SIZE, cases, model  # noqa: F401


def shared_prompts(count: int, shared: int = 2 * CHUNK, seed: int = 0) -> list[list[int]]:
    """`count` prompts starting with the same `shared` tokens, then 5 to 40 tokens of their own."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, size=shared).tolist()
    return [system + rng.integers(0, VOCAB, size=int(rng.integers(5, 40))).tolist() for _ in range(count)]


def _at(prompt):
    return chunk_boundaries(prompt, CHUNK)


def _prefill(model, prompt, policy, **reuse):
    plan = PrefillPlan(policy, PAGE_SIZE, CAPACITY, CHUNK, CAPACITY, 16, **reuse)
    return prefill_rows(model, [np.asarray(prompt, np.int32)], plan)


@pytest.mark.parametrize("case_id", ["full", "snapkv", "h2o", "quest"])
def test_resumed_prefill_equals_prefill_from_scratch(model, cases, case_id):
    policy = cases[case_id].policy
    first, second = shared_prompts(2)
    cache = PrefixStates(1 << 30)
    _prefill(model, first, policy, on_chunk=lambda carry: cache.store("k", _at(first), carry))
    assert len(cache) == len(first) // CHUNK  # one entry per whole chunk of the first prompt
    resume = cache.lookup("k", _at(second), len(second))
    assert resume is not None and resume.tokens == 2 * CHUNK  # the shared chunks, not the first's own third
    scratch_state, scratch_logits = _prefill(model, second, policy)
    boundaries = []
    state, logits = _prefill(model, second, policy, resume=resume, on_chunk=lambda c: boundaries.append(c.tokens))
    assert all(b > resume.tokens for b in boundaries)  # the shared chunks did not run again
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(scratch_logits))
    assert state.read_pages == scratch_state.read_pages
    for layer in range(model.cfg.num_layers):
        for got, want in zip(gather_layer(state, layer), gather_layer(scratch_state, layer)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the carry is what the prefill starts from: another prefix's carry gives other logits
    other = PrefixStates(1 << 30)
    stranger = shared_prompts(1, seed=5)[0]
    _prefill(model, stranger, policy, on_chunk=lambda carry: other.store("k", _at(stranger), carry))
    wrong = other.lookup("k", _at(stranger[: 2 * CHUNK]), 2 * CHUNK)
    assert not np.array_equal(np.asarray(_prefill(model, second, policy, resume=wrong)[1]), np.asarray(scratch_logits))
    # the cached entry survived the resumed prefill's donations and still serves
    again, _ = _prefill(model, second, policy, resume=cache.lookup("k", _at(second), len(second)))
    np.testing.assert_array_equal(np.asarray(gather_layer(again, 0)[0]), np.asarray(gather_layer(state, 0)[0]))


def test_a_prompt_wholly_cached_needs_no_chunk(model, cases):
    full = cases["full"].policy
    first, _ = shared_prompts(2)
    cache = PrefixStates(1 << 30)
    _prefill(model, first, full, on_chunk=lambda carry: cache.store("k", _at(first), carry))
    shared = first[: 2 * CHUNK]
    ran = []
    state, logits = _prefill(model, shared, full, resume=cache.lookup("k", _at(shared), len(shared)), on_chunk=ran.append)
    scratch_state, scratch_logits = _prefill(model, shared, full)
    assert not ran
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(scratch_logits))
    np.testing.assert_array_equal(np.asarray(gather_layer(state, 1)[1]), np.asarray(gather_layer(scratch_state, 1)[1]))


def test_resume_refuses_a_carry_off_the_chunk_grid(model, cases):
    first, second = shared_prompts(2)
    cache = PrefixStates(1 << 30)
    full = cases["full"].policy
    _prefill(model, first, full, on_chunk=lambda carry: cache.store("k", _at(first), carry))
    carry = cache.lookup("k", _at(second), len(second))
    with pytest.raises(ValueError, match="cannot resume after 50 tokens"):
        _prefill(model, second, full, resume=carry._replace(tokens=50))
    with pytest.raises(ValueError, match="chunk schedule"):
        _prefill(model, second, cases["locret"].policy, resume=carry)


def _serve_like_generate(model, policy, rows, max_new=6) -> BatchEngine:
    """Serve `rows` through a 2-row engine and check each request's tokens against `generate` alone."""
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=CHUNK,
                         steps_per_dispatch=4)
    ids = [engine.submit(r, max_new, policy, eos_token_id=-1) for r in rows]
    out = engine.run()
    for rid, row in zip(ids, rows):
        tokens = kvjax.generate(model, [row], max_new, policy, page_size=PAGE_SIZE, capacity=CAPACITY,
                                chunk_size=CHUNK, eos_token_id=-1)[0]
        assert out[rid].tokens == tokens.tolist()
    return engine


def test_engine_reuses_shared_prefixes_with_generates_tokens(model, cases):
    policy = cases["snapkv"].policy
    rows = shared_prompts(4)
    engine = _serve_like_generate(model, policy, rows)
    stats = engine.prefix.stats
    assert stats.hits == 3 and stats.hit_tokens == 3 * 2 * CHUNK  # every request after the first skips 2 chunks
    assert engine.leaked_pages == 0


def test_a_prompt_shorter_than_the_chunk_is_served(model, cases):
    """A prompt of a whole power-of-two chunk below the engine's chunk size prefills in smaller whole chunks,
    whose carries are between the engine's boundaries: served like `generate`, nothing cached for it."""
    rows = [np.random.default_rng(7).integers(0, VOCAB, size=CHUNK // 2).tolist()]
    engine = _serve_like_generate(model, cases["full"].policy, rows)
    assert len(engine.prefix) == 0 and engine.prefix.stats.lookups == 1


def test_per_chunk_compressors_prefill_from_scratch(model, cases):
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=CHUNK)
    for row in shared_prompts(2):
        engine.submit(row, 2, cases["locret"].policy, eos_token_id=-1)
    engine.run()
    assert engine.prefix.stats.lookups == 0 and len(engine.prefix) == 0


def test_least_recently_used_entries_go_past_the_byte_budget(model, cases):
    full = cases["full"].policy
    first, second = shared_prompts(2, seed=1), shared_prompts(2, seed=2)[0]
    probe = PrefixStates(1 << 30)
    _prefill(model, first[0], full, on_chunk=lambda carry: probe.store("k", _at(first[0]), carry))
    one_chunk = min(probe.sizes())
    cache = PrefixStates(3 * one_chunk)  # room for the one- and two-chunk entries of one prompt, not more
    _prefill(model, first[0], full, on_chunk=lambda carry: cache.store("k", _at(first[0]), carry))
    assert cache.lookup("k", _at(first[1]), len(first[1])).tokens == 2 * CHUNK  # touched: now the most recent
    _prefill(model, second, full, on_chunk=lambda carry: cache.store("k", _at(second), carry))
    assert cache.bytes <= cache.lru.max_bytes and cache.stats.evicted >= 1
    assert cache.lookup("k", _at(second), len(second)) is not None
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixStates(-1)


@pytest.mark.parametrize("case_id", ["full", "quest"])
def test_rows_share_a_live_rows_prefix_pages(model, cases, case_id):
    """Policies that never rewrite a row's pages share whole-page prefixes between live rows: fewer pages,
    the same tokens as `generate`, every page back on the free stack at the end."""
    policy = cases[case_id].policy
    rows = shared_prompts(4, seed=7)
    # long enough that a row still decodes while the next request's prefill (a chunk a step) ends
    engine = _serve_like_generate(model, policy, rows, max_new=16)
    per_row = model.cfg.num_layers * model.cfg.num_kv_heads * (2 * CHUNK // PAGE_SIZE)
    assert engine.shared_pages >= per_row and engine.shared_pages % per_row == 0
    assert engine.leaked_pages == 0


def test_evicting_policies_do_not_share_pages(model, cases):
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=CHUNK)
    for row in shared_prompts(2, seed=7):
        engine.submit(row, 3, cases["h2o"].policy, eos_token_id=-1)
    engine.run()
    assert engine.shared_pages == 0 and engine.prefix.stats.hits == 1 and engine.leaked_pages == 0


def test_a_shared_page_is_freed_by_its_last_row(model):
    from kvjax.cache.rows import insert_row, release_row
    from kvjax.cache.state import init_state

    first, second = shared_prompts(2)
    full = kvjax.make_policy("full")
    one, _ = _prefill(model, first, full)
    two, _ = _prefill(model, second, full)
    batch = init_state(model.cfg, 2, CAPACITY, PAGE_SIZE)
    N = batch.num_pages
    batch = insert_row(batch, one, np.int32(0))
    used_one = N - int(batch.num_free)
    batch = insert_row(batch, two, np.int32(1), np.int32(0), np.int32(2 * CHUNK // PAGE_SIZE))
    shared = model.cfg.num_layers * model.cfg.num_kv_heads * (2 * CHUNK // PAGE_SIZE)
    assert N - int(batch.num_free) == used_one + int(np.sum(np.asarray(two.page_table) >= 0)) - shared
    k_one, k_two = gather_layer(batch, 1)[0], gather_layer(two, 1)[0]
    np.testing.assert_array_equal(np.asarray(k_one[1]), np.asarray(k_two[0]))  # row 1 reads what it prefilled
    batch = release_row(batch, np.int32(0))  # the shared pages stay: row 1 still holds them
    assert int(np.max(np.asarray(batch.refcount))) == 1
    np.testing.assert_array_equal(np.asarray(gather_layer(batch, 1)[0][1]), np.asarray(k_two[0]))
    batch = release_row(batch, np.int32(1))
    assert int(batch.num_free) == N and not np.asarray(batch.refcount).any()
