"""The benchmarks' one decode timer (`eval.lib.timing`): it decodes what `generate` decodes, times the compiling
first step apart, and visits runs round-robin."""

import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.eval.lib import timing


@pytest.fixture(scope="module")
def tiny_model():
    return kvjax.load_model("tiny")


def test_a_decode_run_steps_the_model_greedily_and_times_each_step(tiny_model):
    prompt = random_tokens(3, (2, 40), tiny_model.cfg.vocab_size)
    policy = kvjax.make_policy("quest", token_budget=32, dense_layers=1)
    run = timing.DecodeRun.prefilled(tiny_model, prompt, policy, max_new_tokens=8)
    result = run.run(4)
    want = kvjax.generate(tiny_model, prompt, 5, policy)
    np.testing.assert_array_equal(np.stack(run.tokens, axis=1), np.asarray(want)[:, :5])
    assert len(run.times) == 4 and result["decode_step_s"] == np.median(run.times)
    assert result["decode_tokens_per_s"] == 2 / result["decode_step_s"]
    assert result["prefill_compile_s"] > 0 and result["decode_compile_s"] > 0  # the compiles, timed apart


def test_round_robin_visits_every_run_once_per_step():
    order = []

    class Run:
        def __init__(self, name):
            self.name = name

        def step(self):
            order.append(self.name)

        def result(self):
            return self.name

    assert timing.round_robin([Run("a"), Run("b")], 3) == ["a", "b"]
    assert order == ["a", "b"] * 3


def test_the_large_read_reports_the_faster_library():
    read = timing.large_read(4 * 2**20, repeats=3, warmup=1)
    assert read["bytes"] == 4 * 2**20 and read["gbps"] == read["median_gbps"] > 0
