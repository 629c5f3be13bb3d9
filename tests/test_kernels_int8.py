"""int8 KV pages in the decode kernels: every backend against the pure-jnp reference on the same int8 pages
(dequantised on the fly there too), and the reference on int8 pages against float32 pages within the
quantisation error. Scales of slots that are not valid are NaN, so a kernel that reads one fails."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import pallas_kernels as pk
from kvjax.pallas_kernels.testing import make_paged_inputs, random_selection
from test_kernels_decode import BACKENDS, assert_decode_matches, jitted

SHAPE = dict(batch=2, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_pages=6)
# int8 pages against float32 pages (unit-normal keys and values): the output moves by a fraction of the
# per-value rounding error (scale / 2 = max|x| / 254, about 1% of a value of this size)
INT8_TOLERANCE = dict(rtol=0.0, atol=0.03)


def test_quantize_round_trip_error_is_at_most_half_a_step():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 16, 64)) * 3, jnp.float32)
    q, scale = pk.quantize_int8(x)
    assert q.dtype == jnp.int8 and scale.shape == (5, 16) and scale.dtype == jnp.float32
    error = np.abs(np.asarray(pk.dequantize(q, scale) - x))
    assert np.all(error <= np.asarray(scale)[..., None] / 2 + 1e-6)
    zero_q, zero_scale = pk.quantize_int8(jnp.zeros((2, 4)))
    assert np.all(np.asarray(pk.dequantize(zero_q, zero_scale)) == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_int8_decode_matches_reference(backend, sparse):
    rng = np.random.default_rng([7, BACKENDS.index(backend), sparse])
    inputs = make_paged_inputs(rng, **SHAPE)
    q, _, _, _, _, page_table, lengths = inputs.as_jax()
    k8, v8, k_scale, v_scale = inputs.as_int8()
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if sparse:
        selected = jnp.asarray(random_selection(rng, inputs, 8, 3))
        args = (q, k8, v8, page_table, selected, lengths)
        expected = jitted(pk.sparse_paged_decode_reference, return_stats=True)(*args, **scales)
        result = jitted(pk.sparse_paged_decode, backend=backend, return_stats=True)(*args, **scales)
    else:
        args = (q, k8, v8, page_table, lengths)
        expected = jitted(pk.paged_decode_reference, return_stats=True)(*args, **scales)
        result = jitted(pk.paged_decode, backend=backend, return_stats=True)(*args, **scales)
    assert_decode_matches(result, expected, jnp.float32)


def test_int8_pages_stay_within_quantisation_error_of_float32_pages():
    inputs = make_paged_inputs(np.random.default_rng(3), **SHAPE)
    q, k32, v32, _, _, page_table, lengths = inputs.as_jax()
    k8, v8, k_scale, v_scale = inputs.as_int8()
    exact = pk.paged_decode_reference(q, k32, v32, page_table, lengths)
    quantized = pk.paged_decode_reference(q, k8, v8, page_table, lengths, k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_allclose(np.asarray(quantized), np.asarray(exact), **INT8_TOLERANCE)
    assert not np.allclose(np.asarray(quantized), np.asarray(exact), rtol=0, atol=1e-6)  # really int8


def test_int8_inputs_are_checked_by_name():
    inputs = make_paged_inputs(np.random.default_rng(4), **SHAPE)
    q, k32, v32, _, _, page_table, lengths = inputs.as_jax()
    k8, v8, k_scale, v_scale = inputs.as_int8()
    with pytest.raises(ValueError, match="int8 pages need k_scale"):
        pk.paged_decode(q, k8, v8, page_table, lengths)
    with pytest.raises(ValueError, match="v_scale must have shape"):
        pk.paged_decode(q, k8, v8, page_table, lengths, k_scale=k_scale, v_scale=v_scale[:, :4])
    with pytest.raises(ValueError, match="are for int8 pages"):
        pk.paged_decode(q, k32, v32, page_table, lengths, k_scale=k_scale, v_scale=v_scale)
