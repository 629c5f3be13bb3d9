"""Several decode steps per dispatch (`kvjax.engine.decode_loop`) give what a host loop of one step per token gives.

The reference is the loop `generate` ran before: sample on the host's schedule (split the key, sample, write
the token unless the row is done, stop when every row is done), one `decode_step` per token. Tokens,
log-probabilities and the -1 fill must be equal for every dispatch size, with sampling, EOS and policies
that select pages or evict while decoding.
"""

import jax
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.util.compile_count import count_compiles
from kvjax.engine.sampling import sample_tokens


@pytest.fixture(scope="module")
def model(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


def host_loop(model, prompt, max_new, policy=None, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, eos=()):
    """One decode step per token, sampled and tested for EOS on the host: (tokens, log-probabilities)."""
    B = len(prompt)
    state, logits = kvjax.prefill(model, prompt, policy, max_new_tokens=max_new)
    out, out_lp = np.full((B, max_new), -1, np.int32), np.full((B, max_new), np.nan, np.float32)
    done = np.zeros(B, bool)
    key = jax.random.PRNGKey(seed)
    for t in range(max_new):
        key, step_key = jax.random.split(key)
        tokens, lp = (np.asarray(x) for x in sample_tokens(logits, step_key, temperature, top_k, top_p))
        out[~done, t], out_lp[~done, t] = tokens[~done], lp[~done]
        done |= np.isin(tokens, np.asarray(eos, np.int32))
        if done.all():
            break
        logits, state = kvjax.decode_step(model, state, tokens, policy)
    return out, out_lp


CASES = {
    "greedy": dict(),
    "sampled": dict(temperature=0.9, top_k=20, top_p=0.9, seed=5),
    "quest": dict(policy=("quest", dict(token_budget=32, dense_layers=0))),
    "h2o": dict(policy=("h2o", dict(token_budget=24))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_sizes_equal_the_host_loop(model, case):
    options = dict(CASES[case])
    spec = options.pop("policy", None)
    policy = None if spec is None else kvjax.make_policy(spec[0], **spec[1])
    prompt = random_tokens(70, (3, 40))
    want, want_lp = host_loop(model, prompt, 20, policy, **options)
    # greedy: one step a dispatch and every step in one dispatch; the others: 7 (dispatches of 7, 7, 5), which
    # crosses dispatch boundaries mid-generation (each size is its own program: compiles cost)
    for steps in (1, 64) if case == "greedy" else (7,):
        got, got_lp = kvjax.generate(model, prompt, 20, policy, return_logprobs=True, steps_per_dispatch=steps,
                                     **options)
        np.testing.assert_array_equal(got, want, err_msg=f"steps_per_dispatch={steps}")
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, err_msg=f"steps_per_dispatch={steps}")


def test_eos_inside_a_dispatch_fills_minus_one(model):
    prompt = random_tokens(71, (3, 30))
    free = kvjax.generate(model, prompt, 24)
    eos = (int(free[0, 5]), int(free[2, 9]))  # rows stop at different steps inside one 16-step dispatch
    want, want_lp = host_loop(model, prompt, 24, eos=eos)
    assert (want == -1).any(), "the chosen EOS tokens never stopped a row"
    for steps in (7, 16):
        got, got_lp = kvjax.generate(model, prompt, 24, eos_token_id=eos, return_logprobs=True, steps_per_dispatch=steps)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.isnan(got_lp), got == -1)
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)


def test_one_program_whatever_the_length(model):
    prompt = random_tokens(72, (2, 20))
    kvjax.generate(model, prompt, 5, steps_per_dispatch=7)
    with count_compiles() as again:
        kvjax.generate(model, prompt, 30, steps_per_dispatch=7)
        kvjax.generate(model, prompt, 2, steps_per_dispatch=7)
    assert again.of("decode_steps") == 0, f"the decode loop recompiled for a new max_new_tokens: {again}"


def test_bad_dispatch_size_is_refused(model):
    with pytest.raises(ValueError, match="steps_per_dispatch"):
        kvjax.generate(model, random_tokens(73, (1, 10)), 4, steps_per_dispatch=0)
