"""Cached generation: chunked prefill + decode equals the dense forward; greedy tokens equal transformers'."""

import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.util.compile_count import count_compiles

TOL = 1e-4


@pytest.fixture(scope="module")
def llama(hf_models):
    """A random HF Llama (GQA, llama3 RoPE) and kvjax's load of it; skips without torch."""
    hf, path = hf_models("llama_gqa_llama3")
    return hf, kvjax.load_model(path)


@pytest.fixture(scope="module", params=["tiny", "llama_gqa_llama3"])
def model(request):
    """The cache checks run on the shipped model (no torch needed) and on the random HF Llama."""
    if request.param == "tiny":
        return kvjax.load_model("tiny")
    return request.getfixturevalue("llama")[1]


@pytest.fixture(scope="module")
def tiny():
    return kvjax.load_model("tiny")


def test_chunked_prefill_then_decode_matches_dense(model):
    tokens = random_tokens(10, (2, 70))
    dense = np.asarray(kvjax.forward_logits(model, tokens))
    # chunk 16 over a 50-token prompt: 4 chunks, the last one padded; page size 16 puts pages across chunks
    state, last = kvjax.prefill(model, tokens[:, :50], chunk_size=16, max_new_tokens=20)
    np.testing.assert_allclose(np.asarray(last), dense[:, 49], atol=TOL, rtol=0)
    for t in range(50, 70):
        logits, state = kvjax.decode_step(model, state, tokens[:, t])
        np.testing.assert_allclose(np.asarray(logits), dense[:, t], atol=TOL, rtol=0)
    assert np.asarray(state.lengths).min() == 70 and np.asarray(state.next_position).tolist() == [70, 70]


def test_ragged_prefill_matches_each_sequence_alone(model):
    a, b = random_tokens(11, (37,)), random_tokens(12, (58,))
    state, last = kvjax.prefill(model, [a.tolist(), b.tolist()], chunk_size=16, page_size=8)
    np.testing.assert_allclose(np.asarray(last[0]), np.asarray(kvjax.forward_logits(model, a[None]))[0, -1], atol=TOL)
    np.testing.assert_allclose(np.asarray(last[1]), np.asarray(kvjax.forward_logits(model, b[None]))[0, -1], atol=TOL)
    lengths = np.asarray(state.lengths)                                      # [L, B, H]
    assert lengths.shape[0] == model.cfg.num_layers
    assert (lengths[:, 0] == 37).all() and (lengths[:, 1] == 58).all()


def _hf_greedy(hf, prompt, steps):
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=steps, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].numpy()
    margins = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def test_greedy_tokens_match_transformers_generate(llama):
    hf, model = llama
    prompts = [random_tokens(20, (29,)), random_tokens(21, (45,))]
    steps = 32
    ours = kvjax.generate(model, [p.tolist() for p in prompts], max_new_tokens=steps, chunk_size=16)
    assert ours.shape == (2, steps) and ours.dtype == np.int32
    compared = 0
    for row, prompt in zip(ours, prompts):
        ref, margins = _hf_greedy(hf, prompt, steps)
        for t in range(steps):
            if row[t] != ref[t]:
                # random weights give near-ties; a difference is acceptable only there, and ends the comparison
                assert margins[t] < 1e-3, f"token {t} differs ({row[t]} vs {ref[t]}) with top-2 margin {margins[t]}"
                break
            compared += 1
    assert compared >= 48, f"only {compared} tokens compared"


def test_decode_does_not_recompile(tiny):
    model = tiny
    prompt = random_tokens(30, (2, 20))
    with count_compiles() as first:
        kvjax.generate(model, prompt, max_new_tokens=3)
    assert first.of("append_chunk") <= 1 and first.of("decode_steps") <= 1, f"one prefill and one decode program expected: {first}"
    with count_compiles() as again:
        kvjax.generate(model, prompt, max_new_tokens=12)
        kvjax.generate(model, random_tokens(31, (2, 25)), max_new_tokens=7)  # same chunk bucket and capacity class
    assert again.of("append_chunk") + again.of("decode_steps") == 0, f"recompiled: {again}"


def test_decode_last_feeds_the_tail_as_decode_steps(tiny):
    model = tiny
    prompt = random_tokens(40, (2, 30))
    plain, lp_plain = kvjax.generate(model, prompt, max_new_tokens=6, return_logprobs=True)
    tail, lp_tail = kvjax.generate(model, prompt, max_new_tokens=6, decode_last=5, return_logprobs=True)
    np.testing.assert_array_equal(plain, tail)
    np.testing.assert_allclose(lp_plain, lp_tail, atol=1e-4)
    assert np.all(lp_plain <= 0)


@pytest.mark.parametrize("temperature", [0.0, 3.0])
def test_tails_fed_in_the_decode_loop_equal_feeding_them_one_step_a_call(tiny, temperature):
    """Ragged tails (5, 2 and 0 tokens) fed inside `decode_steps` give the tokens and log-probabilities of
    feeding them one `append_token` call at a time (`feed_tokens`), then sampling; across three dispatches of
    one program, with no `append_token` compiled on its own."""
    from kvjax.engine.generation import continue_rows, feed_tokens

    model = tiny
    rows = random_tokens(41, (3, 20))
    tails = [rows[0, 13:], rows[1, 18:], rows[2, 20:]]
    heads = [rows[0, :13], rows[1, :18], rows[2, :20]]
    sampling = dict(temperature=temperature, seed=5, return_logprobs=True, steps_per_dispatch=4)

    def prefilled():
        state, logits = kvjax.prefill(model, rows[:, :13], max_new_tokens=24)
        return feed_tokens(model, state, logits, [h[13:] for h in heads], kvjax.make_policy("full"))

    state, logits = prefilled()
    with count_compiles() as compiled:
        fed, lp_fed = continue_rows(model, state, logits, tails, 10, kvjax.make_policy("full"), **sampling)
    state, logits = prefilled()
    state, logits = feed_tokens(model, state, logits, tails, kvjax.make_policy("full"))
    reference, lp_reference = continue_rows(model, state, logits, [np.zeros(0, np.int32)] * 3, 10,
                                            kvjax.make_policy("full"), **sampling)
    np.testing.assert_array_equal(fed, reference)
    np.testing.assert_allclose(lp_fed, lp_reference, atol=1e-5)
    assert compiled.of("decode_steps") == 1 and compiled.of("append_token") == 0, compiled


def test_a_first_generate_builds_four_programs():
    """A first `generate` (a config, batch and prompt no other test uses, so nothing comes from JAX's caches)
    builds the empty state, the prefill chunk, the first token's sample and the decode loop, and nothing
    else: a host array put with `jnp.asarray` (a program per shape in JAX 0.10), a key split or a
    `jnp.zeros` outside them would each add one (and reading each costs a warm start)."""
    from kvjax.models.config import ModelConfig
    from kvjax.models.loading import Model, init_params

    cfg = ModelConfig(model_type="llama", max_position_embeddings=256, vocab_size=89, hidden_size=24,
                      intermediate_size=40, num_layers=2, num_heads=3, num_kv_heads=1, head_dim=8)
    model = Model(cfg, init_params(cfg, seed=0))
    with count_compiles() as built:
        kvjax.generate(model, random_tokens(43, (3, 29), vocab=89), max_new_tokens=3)
    assert dict(built.by_name) == {"_empty_state": 1, "append_chunk": 1, "sample_first_tokens": 1,
                                   "decode_steps": 1}, built


def test_eos_stops_and_fills_minus_one(tiny):
    model = tiny
    prompt = random_tokens(50, (2, 12))
    free = kvjax.generate(model, prompt, max_new_tokens=10)
    eos = int(free[0, 3])
    out = kvjax.generate(model, prompt, max_new_tokens=10, eos_token_id=eos)
    first = int(np.flatnonzero(free[0] == eos)[0])
    np.testing.assert_array_equal(out[0, : first + 1], free[0, : first + 1])
    assert np.all(out[0, first + 1 :] == -1)
    hits = np.flatnonzero(free[1] == eos)
    end = int(hits[0]) + 1 if hits.size else 10
    np.testing.assert_array_equal(out[1, :end], free[1, :end])
    assert np.all(out[1, end:] == -1)


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny):
    model = tiny
    prompt = random_tokens(60, (2, 16))
    a = kvjax.generate(model, prompt, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    b = kvjax.generate(model, prompt, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    c = kvjax.generate(model, prompt, max_new_tokens=8, temperature=5.0, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    greedy = kvjax.generate(model, prompt, max_new_tokens=8)
    np.testing.assert_array_equal(kvjax.generate(model, prompt, max_new_tokens=8, temperature=0.7, top_k=1, seed=9), greedy)


def test_top_p_keeps_only_the_nucleus():
    import jax
    import jax.numpy as jnp

    from kvjax.engine.sampling import sample_tokens

    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        tok, _ = sample_tokens(logits, jax.random.PRNGKey(seed), temperature=1.0, top_p=0.75)
        seen.add(int(tok[0]))
    assert seen == {0, 1}


def test_prefill_over_several_page_blocks_matches_dense(model):
    """Small pages put the prompt in several 32-page blocks of the blocked prefill attention."""
    tokens = random_tokens(13, (2, 230))
    dense = np.asarray(kvjax.forward_logits(model, tokens))
    state, last = kvjax.prefill(model, [tokens[0, :230].tolist(), tokens[1, :170].tolist()], chunk_size=64,
                                page_size=2, max_new_tokens=3)
    np.testing.assert_allclose(np.asarray(last[0]), dense[0, 229], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(last[1]), dense[1, 169], atol=TOL, rtol=0)
