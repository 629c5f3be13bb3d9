"""Sparse and dense paged decode: every backend against the pure-jnp reference (Pallas in interpret mode).

Inputs are fresh random pools per case, with unused pages and slots past each head's length set to NaN,
so a stray read turns the output NaN and fails the comparison.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import pallas_kernels as pk
from kvjax.pallas_kernels.testing import make_paged_inputs, random_selection
from policy_cases import quick_params

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")
TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@functools.cache
def jitted(fn, **kwargs):
    """One jitted function per (kernel, static kwargs), so equal shapes compile once per session."""
    return jax.jit(functools.partial(fn, **kwargs))


def assert_close(actual, expected, dtype):
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)), np.asarray(jnp.asarray(expected, jnp.float32)), **TOLERANCE[dtype]
    )


def assert_decode_matches(result, expected, dtype):
    out, row_max, row_sum = result
    ref_out, ref_max, ref_sum = expected
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "output has NaN/inf: a kernel read an invalid slot"
    assert_close(out, ref_out, dtype)
    np.testing.assert_allclose(row_max, ref_max, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(row_sum, ref_sum, rtol=1e-5, atol=1e-5)


# (dtype, page_size, query heads, kv heads, selection per kv head, K) — covers page sizes 16/32/64,
# groups 1/4/8, both dtypes and both selection granularities without the full product.
SPARSE_CASES = [
    (jnp.float32, 16, 4, 4, False, 3),
    (jnp.float32, 32, 8, 2, True, 4),
    (jnp.bfloat16, 64, 8, 1, False, 2),
    (jnp.bfloat16, 16, 8, 2, False, 5),
    (jnp.float32, 16, 16, 2, True, 6),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(SPARSE_CASES)))
def test_sparse_decode_matches_reference(backend, case):
    dtype, page_size, num_q_heads, num_kv_heads, per_kv_head, k = SPARSE_CASES[case]
    rng = np.random.default_rng([case, BACKENDS.index(backend), 11])
    inputs = make_paged_inputs(
        rng, batch=2, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=128,
        page_size=page_size, max_pages=6,
    )
    num_sel_heads = num_kv_heads if per_kv_head else num_q_heads
    selected = jnp.asarray(random_selection(rng, inputs, num_sel_heads, k))
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax(dtype)
    args = (q, k_pages, v_pages, page_table, selected, lengths)
    expected = jitted(pk.sparse_paged_decode_reference, return_stats=True)(*args)
    result = jitted(pk.sparse_paged_decode, backend=backend, return_stats=True)(*args)
    assert_decode_matches(result, expected, dtype)


DENSE_SHAPE = dict(batch=2, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, max_pages=7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_decode_matches_reference(backend, dtype):
    rng = np.random.default_rng([21, BACKENDS.index(backend), dtype == jnp.bfloat16])
    inputs = make_paged_inputs(rng, **DENSE_SHAPE)
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax(dtype)
    args = (q, k_pages, v_pages, page_table, lengths)
    expected = jitted(pk.paged_decode_reference, return_stats=True)(*args)
    result = jitted(pk.paged_decode, backend=backend, return_stats=True)(*args)
    assert_decode_matches(result, expected, dtype)


@pytest.mark.parametrize("backend", ("reference",) + BACKENDS)
def test_bfloat16_pages_held_as_bits_decode_as_bfloat16_pages(backend):
    """uint16 pools (bfloat16 bit patterns, kvjax's CPU layout) give exactly what the bfloat16 pools give,
    dense and sparse: the XLA path bitcasts each gathered block, the other backends the pool."""
    rng = np.random.default_rng([41, backend != "xla"])
    q, k_pages, v_pages, _, _, page_table, lengths = make_paged_inputs(rng, **DENSE_SHAPE).as_jax(jnp.bfloat16)
    k_bits, v_bits = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k_pages, v_pages))
    dense = jitted(pk.paged_decode, backend=backend, return_stats=True)
    for got, want in zip(dense(q, k_bits, v_bits, page_table, lengths), dense(q, k_pages, v_pages, page_table, lengths)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    selected = jnp.asarray(np.stack([rng.permutation(7)[:3] for _ in range(16)]).reshape(2, 8, 3), jnp.int32)
    sparse = jitted(pk.sparse_paged_decode, backend=backend)
    np.testing.assert_array_equal(np.asarray(sparse(q, k_bits, v_bits, page_table, selected, lengths), np.float32),
                                  np.asarray(sparse(q, k_pages, v_pages, page_table, selected, lengths), np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_selecting_every_page_equals_dense_decode(backend, per_kv_head):
    rng = np.random.default_rng([31, BACKENDS.index(backend), per_kv_head])
    inputs = make_paged_inputs(rng, **DENSE_SHAPE)  # the dense test's shapes: its compile is reused
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    num_sel_heads = 2 if per_kv_head else 8
    # every logical page, in a random order per row (the current page included: it must count once)
    every_page = np.stack([rng.permutation(7) for _ in range(2 * num_sel_heads)]).reshape(2, num_sel_heads, 7)
    sparse = jitted(pk.sparse_paged_decode, backend=backend, return_stats=True)(
        q, k_pages, v_pages, page_table, jnp.asarray(every_page, jnp.int32), lengths
    )
    dense = jitted(pk.paged_decode, backend=backend, return_stats=True)(q, k_pages, v_pages, page_table, lengths)
    assert_decode_matches(sparse, dense, jnp.float32)


@pytest.mark.parametrize(
    "backend, tuning",
    [
        ("xla", dict(pages_per_block=1)),
        ("xla", dict(formulation="einsum", pages_per_block=2)),
        ("xla", dict(formulation="mulsum_barrier", pages_per_block=3)),
        ("pallas_tpu", dict(pages_per_block=2, num_splits=3)),
        ("pallas_gpu", dict(pages_per_block=1, num_splits=4)),
    ],
)
def test_block_and_split_settings_do_not_change_results(backend, tuning):
    rng = np.random.default_rng([41, len(tuning), BACKENDS.index(backend)])
    inputs = make_paged_inputs(
        rng, batch=1, num_q_heads=4, num_kv_heads=1, head_dim=128, page_size=16, max_pages=12
    )
    selected = jnp.asarray(random_selection(rng, inputs, 4, 9))
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    args = (q, k_pages, v_pages, page_table, selected, lengths)
    expected = jitted(pk.sparse_paged_decode_reference, return_stats=True)(*args)
    result = jitted(pk.sparse_paged_decode, backend=backend, return_stats=True, **tuning)(*args)
    assert_decode_matches(result, expected, jnp.float32)
    dense_args = (q, k_pages, v_pages, page_table, lengths)
    dense_expected = jitted(pk.paged_decode_reference, return_stats=True)(*dense_args)
    dense = jitted(pk.paged_decode, backend=backend, return_stats=True, **tuning)(*dense_args)
    assert_decode_matches(dense, dense_expected, jnp.float32)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(1, 64), min_size=2, max_size=2),
    per_kv_head=st.booleans(),
)
def test_property_normalized_selection_is_distinct_and_packed(seed, lengths, per_kv_head):
    """Cleaned selections list each readable page once, in a prefix, and keep the selection's page set."""
    from kvjax.pallas_kernels import _pages

    rng = np.random.default_rng(seed)
    lengths = np.array([lengths], np.int32)  # [1, 2]: page size 16, up to 4 pages
    num_sel_heads = 2 if per_kv_head else 4
    selected = rng.integers(-2, 6, size=(1, num_sel_heads, 6)).astype(np.int32)
    cleaned = np.asarray(jitted(_pages.normalize_selection, page_size=16)(jnp.asarray(selected), jnp.asarray(lengths)))
    for h in range(num_sel_heads):
        length = lengths[0, h // (num_sel_heads // 2)]
        used, current = -(-length // 16), (length - 1) // 16
        expected = sorted({p for p in selected[0, h] if 0 <= p < used and p != current})
        row = list(cleaned[0, h])
        assert row == expected + [-1] * (6 - len(expected))


def test_stats_recover_attention_probabilities():
    rng = np.random.default_rng(51)
    inputs = make_paged_inputs(rng, batch=1, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16, max_pages=3)
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    scale = 0.3
    out, row_max, row_sum = jitted(pk.paged_decode, sm_scale=scale, return_stats=True, backend="xla")(
        q, k_pages, v_pages, page_table, lengths
    )
    length = int(inputs.lengths[0, 0])
    keys = inputs.k_pages[inputs.page_table[0, 0]].reshape(-1, 64)[:length]
    values = inputs.v_pages[inputs.page_table[0, 0]].reshape(-1, 64)[:length]
    logits = inputs.q[0] @ keys.T * scale  # [Hq, length]
    probs = np.exp(logits - np.asarray(row_max)[0, :, None]) / np.asarray(row_sum)[0, :, None]
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(probs @ values, np.asarray(out)[0], rtol=1e-5, atol=1e-5)


def test_nan_poison_catches_a_stray_read():
    """The poisoning is live: reading one slot past a head's length turns the reference output NaN."""
    rng = np.random.default_rng(61)
    inputs = make_paged_inputs(rng, batch=1, num_q_heads=1, num_kv_heads=1, head_dim=32, page_size=16,
                               max_pages=2, lengths=[[5]])
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    reference = jitted(pk.paged_decode_reference)
    assert np.all(np.isfinite(reference(q, k_pages, v_pages, page_table, lengths)))
    assert np.all(np.isnan(reference(q, k_pages, v_pages, page_table, lengths + 1)))


def test_default_backend_on_cpu_is_the_xla_path():
    from kvjax.pallas_kernels._backend import resolve_backend

    assert jax.default_backend() != "cpu" or resolve_backend(None) == "xla"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=jnp.zeros((2, 8), jnp.float32)), r"q must have shape \[B, Hq, D\]"),
        (dict(q=jnp.zeros((2, 6, 32), jnp.float32)), r"q.shape\[1\] \(query heads, 6\) must be a multiple"),
        (dict(v_pages=jnp.zeros((9, 16, 16), jnp.float32)), r"v_pages must have shape"),
        (dict(page_table=jnp.zeros((2, 4, 3), jnp.float32)), "page_table must be int32"),
        (dict(lengths=jnp.ones((2, 3), jnp.int32)), r"lengths must have shape \[B=2, KVH=4\]"),
        (dict(selected=jnp.zeros((2, 3, 2), jnp.int32)), r"selected must have shape \[B=2, Hq=8 or KVH=4, K\]"),
        (dict(k_pages=jnp.zeros((9, 16, 16), jnp.int32)), "k_pages must be float32 or bfloat16"),
    ],
)
def test_bad_inputs_raise_errors_naming_the_argument(change, message):
    args = dict(
        q=jnp.zeros((2, 8, 32), jnp.float32),
        k_pages=jnp.zeros((9, 16, 32), jnp.float32),
        v_pages=jnp.zeros((9, 16, 32), jnp.float32),
        page_table=jnp.zeros((2, 4, 3), jnp.int32),
        selected=jnp.zeros((2, 8, 2), jnp.int32),
        lengths=jnp.ones((2, 4), jnp.int32),
    )
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        pk.sparse_paged_decode(**args, backend="xla")


def test_pallas_backends_reject_unsupported_page_sizes():
    q = jnp.zeros((1, 1, 32), jnp.float32)
    pages = jnp.zeros((4, 8, 32), jnp.float32)
    table, lengths = jnp.zeros((1, 1, 2), jnp.int32), jnp.ones((1, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"page_size\) must be one of \(16, 32, 64\)"):
        pk.paged_decode(q, pages, pages, table, lengths, backend="pallas_tpu")
    jitted(pk.paged_decode, backend="xla")(q, pages, pages, table, lengths)  # any page size on the XLA path


# Property tests: fixed shapes (one compile per backend), random ragged lengths, page placement and
# selections drawn by hypothesis.
PROPERTY_SHAPE = dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=128, page_size=16, max_pages=5)


@st.composite
def paged_case(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    capacity = PROPERTY_SHAPE["max_pages"] * PROPERTY_SHAPE["page_size"]
    lengths = draw(st.lists(st.integers(1, capacity), min_size=4, max_size=4))
    per_kv_head = draw(st.booleans())
    return seed, np.array(lengths).reshape(2, 2), per_kv_head


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_case())
def test_property_sparse_decode_matches_reference(backend, case):
    seed, lengths, per_kv_head = case
    rng = np.random.default_rng(seed)
    inputs = make_paged_inputs(rng, lengths=lengths, spare_pages=2, **PROPERTY_SHAPE)
    num_sel_heads = 2 if per_kv_head else 4
    selected = jnp.asarray(random_selection(rng, inputs, num_sel_heads, 4))
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    # pad the pool to a fixed size so every example has the same shapes
    pad = 2 * 2 * 5 + 2 - k_pages.shape[0]
    k_pages = jnp.pad(k_pages, ((0, pad), (0, 0), (0, 0)), constant_values=np.nan)
    v_pages = jnp.pad(v_pages, ((0, pad), (0, 0), (0, 0)), constant_values=np.nan)
    args = (q, k_pages, v_pages, page_table, selected, lengths)
    expected = jitted(pk.sparse_paged_decode_reference, return_stats=True)(*args)
    result = jitted(pk.sparse_paged_decode, backend=backend, return_stats=True)(*args)
    assert_decode_matches(result, expected, jnp.float32)


@pytest.mark.parametrize("pages, row_groups", quick_params([("float32", 2), ("float32", 3), ("int8", 2), ("int8", 3)],
                                                          [("int8", 3)], ids=lambda v: f"{v[0]}-{v[1]}"))
def test_xla_row_groups_do_not_change_results(pages, row_groups):
    """The XLA path cut into several groups of rows (uneven with 3) equals the reference:
    dense, sparse per query head (rows of one query head) and per kv head (grouped rows)."""
    rng = np.random.default_rng([43, row_groups, pages == "int8"])
    inputs = make_paged_inputs(rng, **DENSE_SHAPE)
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    scales = {}
    if pages == "int8":
        k_pages, v_pages, k_scale, v_scale = inputs.as_int8()
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    for num_sel_heads in (8, 2):
        selected = jnp.asarray(random_selection(rng, inputs, num_sel_heads, 5))
        args = (q, k_pages, v_pages, page_table, selected, lengths)
        expected = pk.sparse_paged_decode_reference(*args, return_stats=True, **scales)
        result = jitted(pk.sparse_paged_decode, backend="xla", return_stats=True, row_groups=row_groups)(*args, **scales)
        assert_decode_matches(result, expected, jnp.float32)
    dense_args = (q, k_pages, v_pages, page_table, lengths)
    expected = pk.paged_decode_reference(*dense_args, return_stats=True, **scales)
    result = jitted(pk.paged_decode, backend="xla", return_stats=True, row_groups=row_groups)(*dense_args, **scales)
    assert_decode_matches(result, expected, jnp.float32)


def test_xla_row_groups_share_one_loop():
    """Grouped rows' row groups are folded block by block in one loop, each group as operations of its own.
    Separate loops ran one after another on XLA:CPU: their temporaries shared one buffer, which orders the
    loops (docs/kernels.md, "Row groups"). Rows of one query head keep a loop per group. Traced only."""
    q, k_pages, v_pages, _, _, page_table, lengths = make_paged_inputs(np.random.default_rng(44), **DENSE_SHAPE).as_jax()
    decode = jax.jit(functools.partial(pk.paged_decode, backend="xla", row_groups=3))  # 4 query heads a row
    assert decode.lower(q, k_pages, v_pages, page_table, lengths).as_text().count("stablehlo.while") == 1
    selected = jnp.zeros(q.shape[:2] + (2,), jnp.int32)  # per query head: rows of one query head
    decode = jax.jit(functools.partial(pk.sparse_paged_decode, backend="xla", row_groups=3))
    assert decode.lower(q, k_pages, v_pages, page_table, selected, lengths).as_text().count("stablehlo.while") == 3


def test_default_row_groups_split_only_large_calls(monkeypatch):
    from kvjax.pallas_kernels import decode_xla

    monkeypatch.setattr(decode_xla.jax, "default_backend", lambda: "cpu")  # the CPU's rule, also on a GPU
    monkeypatch.setattr(decode_xla.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert decode_xla.default_row_groups(32, 1 << 20) == 4  # 32 MiB of K: one group per core, at most 4
    assert decode_xla.default_row_groups(3, 8 << 20) == 3  # at most one group per row
    assert decode_xla.default_row_groups(32, 1 << 10) == 1  # 32 KiB: one group
    monkeypatch.setattr(decode_xla.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert decode_xla.default_row_groups(32, 1 << 20) == 1
    monkeypatch.setattr(decode_xla.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(decode_xla.jax, "default_backend", lambda: "gpu")
    assert decode_xla.default_row_groups(32, 1 << 20) == 1  # groups would run one after another there
