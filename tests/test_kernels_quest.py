"""Quest page scores and top-page selection against their references (Pallas in interpret mode)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import pallas_kernels as pk
from kvjax.pallas_kernels.testing import make_paged_inputs

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")


@functools.cache
def jitted(fn, *args, **kwargs):
    """One jitted function per (function, static arguments): equal shapes compile once per session."""
    return jax.jit(functools.partial(fn, *args, **kwargs))


def assert_scores_match(actual, expected, rtol):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert np.all(np.isfinite(actual[finite])), "a scoreable page got a NaN/inf score"
    # scores are sums of D terms of either sign: compare against the magnitude of those terms
    scale = np.max(np.abs(expected[finite]), initial=1.0)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=rtol, atol=rtol * scale)


# (dtype, page_size, query heads, kv heads, max_pages)
SCORE_CASES = [
    (jnp.float32, 16, 4, 4, 9),
    (jnp.float32, 32, 8, 2, 6),
    (jnp.bfloat16, 64, 8, 1, 5),
    (jnp.bfloat16, 16, 16, 2, 7),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(SCORE_CASES)))
def test_quest_scores_match_reference(backend, case):
    dtype, page_size, num_q_heads, num_kv_heads, max_pages = SCORE_CASES[case]
    rng = np.random.default_rng([case, BACKENDS.index(backend), 7])
    inputs = make_paged_inputs(
        rng, batch=2, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=128,
        page_size=page_size, max_pages=max_pages,
    )
    q, _, _, kmin, kmax, page_table, lengths = inputs.as_jax(dtype)
    expected = jitted(both_granularities, pk.quest_page_scores_reference, page_size)(q, kmin, kmax, page_table, lengths)
    actual = jitted(both_granularities, pk.quest_page_scores, page_size, backend=backend)(
        q, kmin, kmax, page_table, lengths
    )
    for heads, scores, reference in zip((num_q_heads, num_kv_heads), actual, expected):
        assert scores.shape == (2, heads, max_pages)
        assert_scores_match(scores, reference, rtol=1e-5)


def both_granularities(scores_fn, page_size, *args, **kwargs):
    """Per-query-head and per-kv-head scores in one jit (one compile per case)."""
    return tuple(scores_fn(*args, page_size=page_size, per_kv_head=per_kv, **kwargs) for per_kv in (False, True))


def test_scores_mask_the_current_page_and_unused_pages():
    rng = np.random.default_rng(3)
    inputs = make_paged_inputs(rng, batch=1, num_q_heads=2, num_kv_heads=1, head_dim=16, page_size=16,
                               max_pages=6, lengths=[[49]])  # pages 0-2 full, page 3 current (1 slot)
    q, _, _, kmin, kmax, page_table, lengths = inputs.as_jax()
    scores = np.asarray(jitted(pk.quest_page_scores, page_size=16)(q, kmin, kmax, page_table, lengths))
    assert np.all(np.isfinite(scores[..., :3]))
    assert np.all(np.isneginf(scores[..., 3:]))


def test_scores_bound_every_key_of_the_page():
    """Quest's score is an upper bound of q.k over the page's valid keys."""
    rng = np.random.default_rng(4)
    inputs = make_paged_inputs(rng, batch=1, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                               max_pages=5, lengths=[[80, 70]])
    q, _, _, kmin, kmax, page_table, lengths = inputs.as_jax()
    scores = np.asarray(jitted(pk.quest_page_scores, page_size=16)(q, kmin, kmax, page_table, lengths))
    for hq in range(4):
        for p in range(4):  # pages 0..3 are full and scoreable for both heads (page 4 is current)
            keys = inputs.k_pages[inputs.page_table[0, hq // 2, p]]
            assert scores[0, hq, p] >= np.max(keys @ inputs.q[0, hq]) - 1e-4


def test_top_pages_match_reference_and_drop_minus_inf():
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((2, 3, 10)).astype(np.float32)
    scores[0, 0, 4:] = -np.inf  # only 4 pages scoreable
    scores = jnp.asarray(scores)
    for k in (1, 3, 6, 12):
        chosen = np.asarray(pk.select_top_pages(scores, k))
        np.testing.assert_array_equal(chosen, np.asarray(pk.select_top_pages_reference(scores, k)))
        assert chosen.shape == (2, 3, k) and chosen.dtype == np.int32
    chosen = np.asarray(pk.select_top_pages(scores, 6))
    assert sorted(chosen[0, 0, :4]) == [0, 1, 2, 3] and np.all(chosen[0, 0, 4:] == -1)
    assert np.all(np.asarray(pk.select_top_pages(scores, 12))[..., 10:] == -1)
    approx = np.asarray(pk.select_top_pages(scores, 3, approx=True))
    np.testing.assert_array_equal(np.sort(approx, -1), np.sort(np.asarray(pk.select_top_pages(scores, 3)), -1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_quest_pipeline_matches_reference_pipeline(backend):
    """Scores -> top pages -> sparse decode, per kv head, equals the same pipeline on the references."""
    rng = np.random.default_rng([6, BACKENDS.index(backend)])
    inputs = make_paged_inputs(rng, batch=2, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, max_pages=8)
    q, k_pages, v_pages, kmin, kmax, page_table, lengths = inputs.as_jax()

    def pipeline(scores_fn, decode_fn, **backend_kwargs):
        @jax.jit
        def run(q, k_pages, v_pages, kmin, kmax, page_table, lengths):
            scores = scores_fn(q, kmin, kmax, page_table, lengths, page_size=16, per_kv_head=True, **backend_kwargs)
            selected = pk.select_top_pages(scores, 3)
            return decode_fn(q, k_pages, v_pages, page_table, selected, lengths, **backend_kwargs), selected

        return run(q, k_pages, v_pages, kmin, kmax, page_table, lengths)

    expected, expected_sel = pipeline(pk.quest_page_scores_reference, pk.sparse_paged_decode_reference)
    actual, actual_sel = pipeline(pk.quest_page_scores, pk.sparse_paged_decode, backend=backend)
    np.testing.assert_array_equal(np.asarray(actual_sel), np.asarray(expected_sel))
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 96), min_size=3, max_size=3))
def test_property_scores_match_reference(backend, seed, lengths):
    rng = np.random.default_rng(seed)
    inputs = make_paged_inputs(rng, batch=1, num_q_heads=6, num_kv_heads=3, head_dim=128, page_size=16,
                               max_pages=6, lengths=[lengths], spare_pages=2)
    q, _, _, kmin, kmax, page_table, lengths = inputs.as_jax()
    pad = 3 * 6 + 2 - kmin.shape[0]  # fixed pool size: one compile
    kmin = jnp.pad(kmin, ((0, pad), (0, 0)), constant_values=np.nan)
    kmax = jnp.pad(kmax, ((0, pad), (0, 0)), constant_values=np.nan)
    expected = jitted(pk.quest_page_scores_reference, page_size=16)(q, kmin, kmax, page_table, lengths)
    actual = jitted(pk.quest_page_scores, page_size=16, backend=backend)(q, kmin, kmax, page_table, lengths)
    assert_scores_match(actual, expected, rtol=1e-5)


def test_bad_score_inputs_raise_errors_naming_the_argument():
    q = jnp.zeros((1, 4, 32), jnp.float32)
    kmin = jnp.zeros((5, 32), jnp.float32)
    table, lengths = jnp.zeros((1, 2, 3), jnp.int32), jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"kmax must have shape \(5, 32\)"):
        pk.quest_page_scores(q, kmin, kmin[:4], table, lengths, page_size=16)
    with pytest.raises(ValueError, match=r"kmin must have shape \[num_pages, head_dim=32\]"):
        pk.quest_page_scores(q, kmin[:, :16], kmin[:, :16], table, lengths, page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        pk.quest_page_scores(q, kmin, kmin, table, lengths, page_size=0)
    with pytest.raises(ValueError, match="scores must have shape"):
        pk.select_top_pages(jnp.zeros((3, 4)), 2)
