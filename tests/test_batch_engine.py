"""The serving engine over `generate`'s machinery (`kvjax.serving.batch_engine`): ragged concurrent requests
joining and leaving a decode batch give, request by request, the tokens `generate` gives for that prompt
alone, under every policy role (compression after prefill, per-chunk eviction, page selection, decode-time
eviction, composition), with sampling and a seed per request; pages all return to the pool."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

import kvjax
from _sharding_worker import VOCAB, tiny_model
from kvjax.serving.batch_engine import BatchEngine, row_pages
from policy_cases import case_param, matrix_cases, quick_params

PAGE_SIZE, CAPACITY, CHUNK = 8, 128, 32  # one chunk size for every prompt: one prefill program per policy
CASE_IDS = ["full", "quest", "snapkv", "ada_snapkv", "pyramid", "h2o", "tova", "streaming", "locret",
            "compose-snapkv-quest", "compose-h2o-quest"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def cases(model):
    return {case.id: case for case in matrix_cases(model.cfg, page_size=PAGE_SIZE)}


# (prompt index, max_new_tokens, decode_last): five requests, ragged, through a batch of 2 rows, so rows
# are reused and requests join while others decode
REQUESTS = [(0, 9, 0), (1, 4, 3), (2, 12, 0), (3, 6, 2), (4, 7, 0)]


def prompts(batch: int) -> list[list[int]]:
    """Ragged prompts all longer than the policies' budget (32) after their decode tail: every request keeps
    the same number of slots, so each policy compiles one compression."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in [44, 38, 47, 41, 36][:batch]]


def _alone(model, prompt, max_new, decode_last, policy, **sampling):
    tokens, logprobs = kvjax.generate(
        model, [prompt], max_new, policy, decode_last=decode_last, page_size=PAGE_SIZE, capacity=CAPACITY,
        chunk_size=CHUNK, return_logprobs=True, eos_token_id=-1, **sampling)
    keep = tokens[0] >= 0
    return tokens[0][keep].tolist(), logprobs[0][keep]


def _check_engine(model, policy, sampling=None, steps=4, requests=REQUESTS):
    sampling = sampling or {}
    rows = prompts(batch=5)
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=CHUNK,
                         steps_per_dispatch=steps)
    ids = [engine.submit(rows[i], n, policy, decode_last=d, eos_token_id=-1, seed=10 + i, **sampling)
           for i, n, d in requests]
    out = engine.run()
    for rid, (i, n, d) in zip(ids, requests):
        tokens, logprobs = _alone(model, rows[i], n, d, policy, seed=10 + i, **sampling)
        assert out[rid].tokens == tokens, f"request {rid}"
        np.testing.assert_allclose(out[rid].logprobs, logprobs, atol=2e-4)
        assert out[rid].finish_reason == "length"
    assert not engine.batches and engine.leaked_pages == 0  # batches dropped, every page back on the stack
    return engine


@pytest.mark.parametrize("case_id", [case_param(case_id) for case_id in CASE_IDS])
def test_engine_equals_generate_per_request(model, cases, case_id):
    engine = _check_engine(model, cases[case_id].policy)
    assert engine.dispatches < sum(n for _, n, _ in REQUESTS)  # rows really shared dispatches


def test_engine_on_int8_pages_equals_generate(model, cases):
    """int8 pages (`kvjax serve --kv-dtype int8`): each request's tokens and log-probabilities equal `generate`'s
    on the same int8 pages, under H2O (compression after prefill, then eviction while decoding), so a row's
    per-slot scales travel with its pages into the batch and through its holes."""
    # three requests through two rows (one joins a row another has left), no decode tail: few programs
    _check_engine(model.with_kv_dtype("int8"), cases["h2o"].policy, requests=[(0, 9, 0), (1, 4, 0), (2, 6, 0)])


SELECTORS = {  # every page selector, selecting in layer 1 of 2 at 3 pages of 8 slots a head
    "quest_adaptive": dict(dense_layers=1, top_p=0.9), "quest_static": dict(dense_layers=1, page_size=PAGE_SIZE),
    "loki": dict(dense_layers=1, rank=4), "key_int4": dict(dense_layers=1),
}


@pytest.mark.parametrize("name", quick_params(list(SELECTORS), ["key_int4"]))
def test_engine_equals_generate_with_every_selector(model, name):
    """The selectors beyond Quest (a key sketch fitted to each prompt: the batch gets one at its first row,
    each row's fit beside its pages) and Quest's variants, rows joining and leaving. Then two prompts with a
    common 40-token prefix decode side by side: rows of a sketch do not share the prefix's pages, whose codes
    were written with the other row's fit."""
    policy = kvjax.make_policy(name, token_budget=32, **SELECTORS[name])
    _check_engine(model, policy)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, VOCAB, size=40).tolist()
    rows = [prefix + rng.integers(0, VOCAB, size=n).tolist() for n in (6, 9)]
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=CHUNK)
    ids = [engine.submit(row, 6, policy, eos_token_id=-1) for row in rows]
    out = engine.run()
    for rid, row in zip(ids, rows):
        tokens, logprobs = _alone(model, row, 6, 0, policy)
        assert out[rid].tokens == tokens
        np.testing.assert_allclose(out[rid].logprobs, logprobs, atol=2e-4)


@pytest.mark.parametrize("case_id", ["snapkv", "h2o"])
def test_engine_equals_generate_with_sliding_windows(model, cases, case_id):
    """Gemma-2's pattern (layer 0 windowed to 16 tokens, layer 1 full): the window moves while rows decode,
    the policy acts in the full layer, and rows still equal `generate` and return every page."""
    windowed = dataclasses.replace(model, cfg=model.cfg.with_windows([16, None]))
    # the default pool holds a window's pages in layer 0, not capacity's (and serves every request below)
    assert row_pages(windowed.cfg, CAPACITY, PAGE_SIZE) == model.cfg.num_kv_heads * (2 + CAPACITY // PAGE_SIZE)
    _check_engine(windowed, cases[case_id].policy)


@pytest.mark.parametrize("case_id", ["full", "h2o"])
def test_sampled_requests_follow_their_own_seeds(model, cases, case_id):
    _check_engine(model, cases[case_id].policy, dict(temperature=0.9, top_k=20, top_p=0.9))


def test_requests_with_other_policies_or_sampling_get_their_own_batch(model, cases):
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, steps_per_dispatch=2)
    rows = prompts(batch=3)
    engine.submit(rows[0], 5, cases["snapkv"].policy, eos_token_id=-1)
    engine.submit(rows[1], 5, cases["quest"].policy, eos_token_id=-1)
    engine.submit(rows[2], 5, cases["quest"].policy, eos_token_id=-1, temperature=0.5)
    seen_batches = set()
    while engine.has_work:
        engine.step()
        seen_batches |= set(engine.batches)
    assert len(seen_batches) == 3 and all(len(r.tokens) == 5 for r in engine.requests.values())


def test_stop_from_the_callback_and_eos_end_a_request(model):
    rows = prompts(batch=2)
    first = kvjax.generate(model, [rows[1]], 6, page_size=PAGE_SIZE, capacity=CAPACITY, eos_token_id=-1)[0]
    stop_at = next(j for j in range(1, 6) if first[j] not in first[:j])  # its first occurrence ends the request
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, steps_per_dispatch=2)
    eos_id = engine.submit(rows[1], 6, eos_token_id=int(first[stop_at]))
    seen = []
    abort_id = engine.submit(rows[0], 20, eos_token_id=-1, on_tokens=lambda r, t: seen.append(t) or len(r.tokens) >= 5)
    out = engine.run()
    assert out[eos_id].finish_reason == "stop" and out[eos_id].tokens == first[: stop_at + 1].tolist()
    assert out[abort_id].finish_reason == "abort" and 5 <= len(out[abort_id].tokens) < 20
    assert sum(len(t) for t in seen) == len(out[abort_id].tokens)


def test_bad_requests_are_refused_by_name(model):
    engine = BatchEngine(model, capacity=64, page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="exceeds the engine's capacity"):
        engine.submit(list(range(60)), 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit([1, 2, 3], 0)
    with pytest.raises(ValueError, match="top_p"):
        engine.submit([1, 2, 3], 4, top_p=0.0)


def test_a_pool_too_small_for_one_request_is_an_error_naming_pool_pages(model):
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, pool_pages=4)
    engine.submit(prompts(1)[0], 4)
    with pytest.raises(kvjax.CacheCapacityError, match="pool_pages"):
        engine.run()


def test_a_long_prefill_interleaves_with_decoding(model):
    """With `prefill_chunks_per_step=1`, a 100-token prompt (7 chunks of 16) arriving beside a short one
    does not stall it: the short one gets tokens between the long prompt's chunks; both still equal
    `generate`."""
    rng = np.random.default_rng(1)
    short, long = rng.integers(0, VOCAB, size=20).tolist(), rng.integers(0, VOCAB, size=100).tolist()
    engine = BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=16, steps_per_dispatch=1,
                         prefill_chunks_per_step=1)
    prefilling_when_decoded = []
    first = engine.submit(short, 12, eos_token_id=-1,
                          on_tokens=lambda r, t: prefilling_when_decoded.append(getattr(engine.prefilling, "request_id", None)))
    second = engine.submit(long, 6, eos_token_id=-1)
    out = engine.run()
    assert prefilling_when_decoded.count(second) >= 5  # a dispatch between (nearly) every pair of its chunks
    for rid, prompt, n in ((first, short, 12), (second, long, 6)):
        tokens = kvjax.generate(model, [prompt], n, chunk_size=16, page_size=PAGE_SIZE, capacity=CAPACITY,
                                eos_token_id=-1)
        assert out[rid].tokens == np.asarray(tokens)[0].tolist()
    assert engine.leaked_pages == 0
