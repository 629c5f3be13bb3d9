"""The kernels compiled natively on the GPU or TPU this runs on, against their pure-jnp references.

Skipped on a CPU (where the other kernel tests interpret them). On a GPU every Pallas GPU backend the
installed JAX has (Triton, Mosaic GPU on Hopper or newer) runs with `interpret=False`; on a TPU the Mosaic
kernels do. `kvjax bench device` runs this file first, then the whole decode step on the device through
the default kernels, which fall back to the XLA path with a warning where a kernel does not compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import pallas_kernels as pk
from kvjax.pallas_kernels.sketch_scores import pack_int4
from kvjax.pallas_kernels.testing import make_paged_inputs, random_selection

PLATFORM = jax.default_backend()
pytestmark = pytest.mark.skipif(PLATFORM == "cpu", reason="native kernels need a GPU or TPU (kvjax bench device)")
TOLERANCE = {jnp.float32: dict(rtol=2e-3, atol=2e-3), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def native_backends() -> list[str]:
    if PLATFORM == "tpu":
        return ["pallas_tpu"]
    backends = []
    if pk._backend.triton_compiler_params() is not None:
        backends.append("pallas_gpu")
    from kvjax.pallas_kernels.decode_mosaic_gpu import has_mosaic_gpu

    capability = getattr(jax.devices()[0], "compute_capability", "0")
    if has_mosaic_gpu() and float(capability) >= 9.0:
        backends.append("pallas_mosaic_gpu")
    return backends


def inputs_for(seed, dtype, num_q_heads=8, num_kv_heads=2, page_size=16):
    rng = np.random.default_rng(seed)
    inputs = make_paged_inputs(rng, batch=2, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=128,
                               page_size=page_size, max_pages=8)
    return rng, inputs, inputs.as_jax(dtype)


def close(actual, expected, dtype):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    assert np.isfinite(actual).all(), "NaN/inf: the kernel read an invalid slot"
    np.testing.assert_allclose(actual, np.asarray(jnp.asarray(expected, jnp.float32)), **TOLERANCE[dtype])


@pytest.mark.parametrize("backend", native_backends())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("groups", [(8, 2), (4, 4), (32, 8)])
def test_dense_decode_native(backend, dtype, groups):
    _, _, (q, k_pages, v_pages, _, _, page_table, lengths) = inputs_for(1, dtype, *groups)
    args = (q, k_pages, v_pages, page_table, lengths)
    out = jax.jit(lambda *a: pk.paged_decode(*a, backend=backend, interpret=False))(*args)
    close(out, pk.paged_decode_reference(*args), dtype)


@pytest.mark.parametrize("backend", native_backends())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_sparse_decode_native(backend, dtype, per_kv_head):
    rng, inputs, (q, k_pages, v_pages, _, _, page_table, lengths) = inputs_for(2, dtype)
    selected = jnp.asarray(random_selection(rng, inputs, 2 if per_kv_head else 8, 4))
    args = (q, k_pages, v_pages, page_table, selected, lengths)
    out = jax.jit(lambda *a: pk.sparse_paged_decode(*a, backend=backend, interpret=False))(*args)
    close(out, pk.sparse_paged_decode_reference(*args), dtype)


@pytest.mark.parametrize("backend", [b for b in native_backends() if b != "pallas_mosaic_gpu"])
def test_int8_decode_native(backend):
    _, inputs, (q, _, _, _, _, page_table, lengths) = inputs_for(3, jnp.float32)
    k_pages, v_pages, k_scale, v_scale = inputs.as_int8()
    args = (q, k_pages, v_pages, page_table, lengths)
    out = jax.jit(lambda *a: pk.paged_decode(*a, backend=backend, interpret=False, k_scale=k_scale,
                                             v_scale=v_scale))(*args)
    close(out, pk.paged_decode_reference(*args, k_scale=k_scale, v_scale=v_scale), jnp.float32)


@pytest.mark.parametrize("backend", [b for b in native_backends() if b != "pallas_mosaic_gpu"])
def test_quest_scores_native(backend):
    _, _, (q, _, _, kmin, kmax, page_table, lengths) = inputs_for(4, jnp.float32)
    args = (q, kmin, kmax, page_table, lengths)
    out = jax.jit(lambda *a: pk.quest_page_scores(*a, page_size=16, backend=backend, interpret=False))(*args)
    expected = pk.quest_page_scores_reference(*args, page_size=16)
    np.testing.assert_array_equal(np.isinf(out), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(np.asarray(out)[finite], np.asarray(expected)[finite], rtol=2e-3, atol=2e-3)


def sketch_case(backend, codes_kind, interpret=False):
    """(kernel scores, reference scores) of `sketch_page_scores` (loki's float rows, key_int4's packed 4-bit
    codes) on 8 query heads over 2 kv heads, 64-wide sketches, 8 pages of 16 slots."""
    rng = np.random.default_rng([5, len(backend), len(codes_kind)])
    inputs = make_paged_inputs(rng, batch=2, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_pages=8,
                               poison=0.0)
    if codes_kind == "int4":
        codes = pack_int4(jnp.asarray(rng.integers(-8, 8, size=inputs.k_pages.shape[:2] + (64,))))
    else:  # the Mosaic GPU scorer takes bfloat16 bit patterns; the Triton one float32 rows as well
        codes = jnp.asarray(inputs.k_pages)
        codes = pk.bfloat16_bits(codes) if backend == "pallas_mosaic_gpu" else codes
    args = (jnp.asarray(inputs.q), codes, jnp.asarray(inputs.page_table), jnp.asarray(inputs.lengths))
    options = dict(page_size=16, codes_kind=codes_kind)
    out = jax.jit(lambda *a: pk.sketch_page_scores(*a, **options, backend=backend, interpret=interpret))(*args)
    return np.asarray(out), np.asarray(pk.sketch_page_scores_reference(*args, **options))


@pytest.mark.parametrize("backend", native_backends())
@pytest.mark.parametrize("codes_kind", ["float", "int4"])
def test_sketch_scores_native(backend, codes_kind):
    """loki's and key_int4's page scorer compiled natively: the same -inf pages, finite scores within TF32's
    rounding of the float32 reference (norm-wise)."""
    out, expected = sketch_case(backend, codes_kind)
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert np.isfinite(out[finite]).all()
    error = np.linalg.norm(out[finite] - expected[finite]) / np.linalg.norm(expected[finite])
    assert error < 2e-3, f"relative error {error:.2e}"


def test_default_kernels_decode_a_model_on_the_device():
    """The whole step on the device with the default kernels: tokens equal the XLA path's."""
    import kvjax
    from kvjax.models.config import ModelConfig
    from kvjax.models.loading import Model, init_params

    cfg = ModelConfig(model_type="llama", max_position_embeddings=4096, vocab_size=512, hidden_size=256,
                      intermediate_size=320, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=128)
    model = Model(cfg, init_params(cfg, seed=0, std=0.08))
    prompt = (np.arange(90)[None] * 5 % 500).astype(np.int32)
    policy = kvjax.make_policy("quest", token_budget=32, page_size=16, dense_layers=1)
    native = kvjax.generate(model, prompt, 6, policy)
    with pk.target_platform("cpu"):  # the XLA path, still on the device
        xla = kvjax.generate(model, prompt, 6, policy)
    np.testing.assert_array_equal(native, xla)
