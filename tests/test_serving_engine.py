"""The continuous-batching engine over the Jenga allocator: greedy parity with kvjax.generate (full
attention) and with a dense reference (alternating sliding/full layers), logits parity with transformers'
MistralForCausalLM (every layer windowed), prefix hits read from the pool, rejection of requests larger
than the pool, and waiting/preemption in a full pool without corruption or leaks.

Engines use buckets="max" (two compiles per geometry) to keep the tests fast.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import kvjax
from conftest import VOCAB, random_tokens
from kvjax.models import CausalLM, unrolled
from kvjax.rope import rope_frequencies
from kvjax.serving import RequestTooLargeError
from kvjax.serving.engine import Engine
from kvjax.serving.model_groups import FULL_GROUP, alternating_windows, sliding_group_name

TOL = 1e-4
PROMPT_LENGTHS = (5, 40, 23, 70)
MAX_NEW = 8


@pytest.fixture(scope="module")
def llama(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


@pytest.fixture(scope="module")
def prompts():
    return [random_tokens(10 + i, (n,)).tolist() for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def generate_reference(llama, prompts):
    tokens, logprobs = kvjax.generate(llama, prompts, MAX_NEW, return_logprobs=True)
    return np.asarray(tokens), np.asarray(logprobs)


REFERENCE_LENGTH = 96  # sequences are right-padded to it: one compile per window list


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "windows"))
def _dense_forward(params, tokens, *, cfg, dtype, windows):
    T = tokens.shape[1]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]

    def attend(layer, inputs, carry):
        mask = j <= i
        if windows[layer] is not None:
            mask = mask & (i - j < windows[layer])
        k = jnp.repeat(inputs.k, cfg.group_size, axis=2)
        v = jnp.repeat(inputs.v, cfg.group_size, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", inputs.q, k) / np.sqrt(cfg.head_dim)
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v), carry

    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)
    logits, _ = CausalLM(cfg, dtype).apply(
        {"params": params}, tokens, positions, rope_frequencies(cfg, False), unrolled(attend, cfg.num_layers), None,
        method=CausalLM.hidden_and_logits,
    )
    return logits


def dense_logits(model, windows, tokens):
    """Reference: a dense forward over `tokens` (one sequence) where layer l's query at i sees keys j with
    j <= i and i - j < windows[l] (every j <= i when None). Returns f32[T, V]. Right padding does not
    change the logits of earlier positions (causal)."""
    padded = np.zeros((1, REFERENCE_LENGTH), np.int32)
    padded[0, : len(tokens)] = tokens
    logits = _dense_forward(model.params, jnp.asarray(padded), cfg=model.cfg, dtype=model.dtype, windows=tuple(windows))
    return np.asarray(logits[0, : len(tokens)])


def assert_matches_dense(model, windows, prompt, output):
    """output.logits (teacher forced on its own tokens) match the dense reference, and greedy holds."""
    sequence = list(prompt) + output.token_ids.tolist()
    reference = dense_logits(model, windows, sequence[:-1])[len(prompt) - 1 :]
    np.testing.assert_allclose(output.logits, reference, atol=TOL, rtol=0)
    np.testing.assert_array_equal(output.token_ids, reference.argmax(-1))


def log_softmax_at(logits, tokens):
    logits = logits - logits.max(-1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[np.arange(len(tokens)), tokens]


# ---------------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------------
def test_concurrent_ragged_requests_match_generate(llama, prompts, generate_reference):
    engine = Engine(llama, pool_bytes=1 << 20, tokens_per_page=8, chunk_size=16, max_num_seqs=4,
                    max_num_batched_tokens=64, record_logits=True, buckets="max")
    ids = [engine.submit(p, MAX_NEW) for p in prompts]
    outputs = engine.run()
    tokens, logprobs = generate_reference
    for row, rid in enumerate(ids):
        np.testing.assert_array_equal(outputs[rid].token_ids, tokens[row])
        np.testing.assert_allclose(log_softmax_at(outputs[rid].logits, tokens[row]), logprobs[row], atol=TOL)
        assert outputs[rid].finish_reason == "length"
    assert engine.metrics.peak_running == len(prompts)  # all four ran at once
    assert engine.metrics.model_calls > engine.metrics.steps  # decode and prefill rows in the same steps


def test_alternating_sliding_and_full_layers_match_dense_reference(llama):
    windows = alternating_windows(llama.cfg.num_layers, 8)  # layer 0: window 8, layer 1: full
    engine = Engine(llama, windows=windows, pool_bytes=1 << 16, tokens_per_page=4, chunk_size=8,
                    max_num_seqs=2, record_logits=True, buckets="max")
    assert [s.name for s in engine.allocator.specs] == [FULL_GROUP, sliding_group_name(8)]
    prompts = [random_tokens(20, (30,)).tolist(), random_tokens(21, (19,)).tolist()]
    ids = [engine.submit(p, 12) for p in prompts]
    released = False
    while engine.has_unfinished:
        engine.step()
        for rid in engine.allocator.request_ids:  # out-of-window blocks are released while running
            table = engine.allocator.block_tables(rid)
            released |= table[sliding_group_name(8)][0] == -1 and table[FULL_GROUP][0] >= 0
    assert released
    for rid, prompt in zip(ids, prompts):
        assert_matches_dense(llama, windows, prompt, engine.finished[rid])


def test_every_layer_windowed_matches_transformers_mistral(mistral):
    hf, model = mistral
    assert model.cfg.sliding_window == 12
    engine = Engine(model, pool_bytes=1 << 16, tokens_per_page=4, chunk_size=8, max_num_seqs=2,
                    record_logits=True, buckets="max")  # windows default to the config's, on every layer
    assert [s.name for s in engine.allocator.specs] == [sliding_group_name(12)]
    prompt = random_tokens(30, (30,)).tolist()  # > window, prefilled in 4 chunks
    rid = engine.submit(prompt, 10)
    output = engine.run()[rid]
    sequence = torch.tensor([prompt + output.token_ids.tolist()[:-1]])
    with torch.no_grad():
        reference = hf(sequence).logits[0, len(prompt) - 1 :].float().numpy()
        full_attention = transformers.MistralForCausalLM(hf.config.__class__(**{**hf.config.to_dict(), "sliding_window": None}))
        full_attention.load_state_dict(hf.state_dict())
        unwindowed = full_attention.eval()(sequence).logits[0, len(prompt) - 1 :].float().numpy()
    assert np.abs(unwindowed - reference).max() > 1e-2  # the window matters at these lengths
    np.testing.assert_allclose(output.logits, reference, atol=TOL, rtol=0)
    np.testing.assert_array_equal(output.token_ids, reference.argmax(-1))


# ---------------------------------------------------------------------------------------------------
# Prefix caching
# ---------------------------------------------------------------------------------------------------
def test_prefix_hit_reads_cached_pages_and_matches_a_cold_run(llama):
    windows = alternating_windows(llama.cfg.num_layers, 8)
    options = dict(windows=windows, pool_bytes=1 << 16, tokens_per_page=4, chunk_size=8, max_num_seqs=2,
                   record_logits=True, buckets="max")
    document = random_tokens(40, (37,)).tolist()
    first, second = document + random_tokens(41, (5,)).tolist(), document + random_tokens(42, (9,)).tolist()

    engine = Engine(llama, **options)
    rid = engine.submit(first, 6)
    engine.step()
    while engine.allocator.num_computed_tokens(rid) < len(first):
        engine.step()
    document_pages = engine.allocator.block_tables(rid)[FULL_GROUP][: 36 // 4]
    engine.run()
    hit_rid = engine.submit(second, 6)
    engine.step()  # admitted: its tables start with the first request's cached pages
    tables = engine.allocator.block_tables(hit_rid)
    assert tables[FULL_GROUP][:9] == document_pages
    sliding = tables[sliding_group_name(8)]
    assert sliding[:7] == (-1,) * 7 and min(sliding[7:9]) >= 0  # only the last window's blocks are reused
    engine.run()
    hit = engine.finished[hit_rid]
    assert hit.cached_prompt_tokens == 36 and engine.metrics.hit_tokens == 36

    cold = Engine(llama, enable_prefix_caching=False, **options)
    cold_rid = cold.submit(second, 6)
    cold_output = cold.run()[cold_rid]
    assert cold_output.cached_prompt_tokens == 0
    np.testing.assert_array_equal(hit.token_ids, cold_output.token_ids)
    np.testing.assert_allclose(hit.logits, cold_output.logits, atol=TOL, rtol=0)
    assert_matches_dense(llama, windows, second, hit)


# ---------------------------------------------------------------------------------------------------
# Admission control, waiting, preemption
# ---------------------------------------------------------------------------------------------------
def test_request_larger_than_the_pool_is_rejected_at_submit(llama):
    engine = Engine(llama, pool_bytes=12 * 4096, tokens_per_page=8)  # 12 pages of 8 tokens
    with pytest.raises(RequestTooLargeError, match=r"request 'big' \(100 prompt \+ 8 new tokens\) needs up to 14 large pages .* pool has 12"):
        engine.submit(random_tokens(50, (100,)), 8, request_id="big")
    assert not engine.has_unfinished
    engine.submit(random_tokens(51, (80,)), 8)  # 87 cached tokens: 11 pages, fits alone
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        engine.submit([1, 2], 0)


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "alternating"])
def test_full_pool_waits_and_preempts_without_corruption_or_leaks(llama, prompts, generate_reference, windowed):
    windows = alternating_windows(llama.cfg.num_layers, 8) if windowed else None
    # The largest request (77 cached tokens) fits alone, not all four: full attention, 12 pages of 4096 B
    # (needs 10; all four 22); alternating, 20 pages of 2048 B (needs 10 full + 6 sliding; all four ~40).
    engine = Engine(llama, windows=windows, pool_bytes=12 * 4096 if not windowed else 20 * 2048,
                    tokens_per_page=8, chunk_size=16, max_num_seqs=4, record_logits=True, buckets="max")
    ids = [engine.submit(p, MAX_NEW) for p in prompts]
    waited = False
    while engine.has_unfinished:
        engine.step()
        waited |= bool(engine.waiting) and bool(engine.running)
        engine.allocator.check_invariants()
    assert waited and engine.metrics.preemptions > 0
    tokens, _ = generate_reference
    for row, rid in enumerate(ids):
        if windowed:
            assert_matches_dense(llama, windows, prompts[row], engine.finished[rid])
        else:
            np.testing.assert_array_equal(engine.finished[rid].token_ids, tokens[row])
    # No leak: nothing is held by a request; everything left is evictable prefix cache.
    assert engine.allocator.request_ids == ()
    engine.allocator.reset_prefix_cache()
    assert engine.allocator.num_free_large_pages() == engine.layout.num_large_pages
