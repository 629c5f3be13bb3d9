"""The Pallas kernels lower for their native platforms from this CPU machine.

Nothing here runs on a GPU or TPU: `lower(lowering_platforms=...)` runs the Pallas -> Triton (GPU) and
Pallas -> Mosaic (TPU, for a simulated TPU v5e) lowerings, which reject unsupported operations, block
shapes and memory spaces. Final compilation (ptxas, libtpu) happens only on the device.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

from kvjax import pallas_kernels as pk

B, HQ, KVH, D, PS, P, N, K = 2, 8, 2, 128, 16, 64, 300, 7


def abstract_args(dtype, per_kv_head, page_dtype=None):
    """Abstract inputs; `page_dtype` int8 gives int8 pages with float32 per-slot scales (queries in `dtype`)."""
    s = jax.ShapeDtypeStruct
    page_dtype = page_dtype or dtype
    args = dict(
        q=s((B, HQ, D), dtype),
        k_pages=s((N, PS, D), page_dtype),
        v_pages=s((N, PS, D), page_dtype),
        kmin=s((N, D), dtype),
        kmax=s((N, D), dtype),
        page_table=s((B, KVH, P), jnp.int32),
        selected=s((B, KVH if per_kv_head else HQ, K), jnp.int32),
        lengths=s((B, KVH), jnp.int32),
    )
    if page_dtype == jnp.int8:
        args.update(k_scale=s((N, PS), jnp.float32), v_scale=s((N, PS), jnp.float32))
    return args


def _scales(a):
    return dict(k_scale=a.get("k_scale"), v_scale=a.get("v_scale"))


def kernels(backend):
    return {
        "sparse_paged_decode": lambda a: pk.sparse_paged_decode(
            a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["selected"], a["lengths"],
            backend=backend, interpret=False, return_stats=True, **_scales(a)),
        "paged_decode": lambda a: pk.paged_decode(
            a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["lengths"], backend=backend, interpret=False,
            **_scales(a)),
        "quest_page_scores": lambda a: pk.quest_page_scores(
            a["q"], a["kmin"], a["kmax"], a["page_table"], a["lengths"], page_size=PS, backend=backend,
            interpret=False),
    }


def lower_text(kernel, backend, args, platform):
    """`kernel` of `backend` lowered for `platform`, as text, once its lowered program is checked to return what
    the XLA path (the kernels' reference) returns for the same inputs: the same outputs, shapes and dtypes."""
    lowered = jax.jit(kernels(backend)[kernel]).trace(args).lower(lowering_platforms=(platform,))
    expected = jax.eval_shape(kernels("xla")[kernel], args)
    assert jax.tree.structure(lowered.out_info) == jax.tree.structure(expected), kernel
    for got, want in zip(jax.tree.leaves(lowered.out_info), jax.tree.leaves(expected)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{kernel} on {backend}: {got} != {want}"
    return lowered.as_text()


def assert_one_mosaic_kernel(text, kernel):
    """One Mosaic custom call, and it is `kernel`'s own (not another kernel's, not the XLA path)."""
    assert text.count("tpu_custom_call") == 1 and f'kernel_name = "{kernel}"' in text, kernel


@pytest.mark.parametrize("kernel", ["sparse_paged_decode", "paged_decode", "quest_page_scores"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernels_lower_to_triton(simulated_gpu, kernel, dtype):
    from kvjax.pallas_kernels._backend import triton_compiler_params

    if triton_compiler_params() is None:
        pytest.skip("this JAX has no Pallas Triton backend")
    text = lower_text(kernel, "pallas_gpu", abstract_args(dtype, per_kv_head=False), "cuda")
    assert "triton" in text


@pytest.mark.parametrize("kernel", ["sparse_paged_decode", "paged_decode", "quest_page_scores"])
@pytest.mark.parametrize("dtype, per_kv_head", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_tpu_kernels_lower_to_mosaic(simulated_tpu, kernel, dtype, per_kv_head):
    text = lower_text(kernel, "pallas_tpu", abstract_args(dtype, per_kv_head), "tpu")
    assert_one_mosaic_kernel(text, kernel)


@pytest.mark.parametrize("kernel", ["sparse_paged_decode", "paged_decode"])
def test_int8_decode_kernels_lower_to_triton(simulated_gpu, kernel):
    from kvjax.pallas_kernels._backend import triton_compiler_params

    if triton_compiler_params() is None:
        pytest.skip("this JAX has no Pallas Triton backend")
    text = lower_text(kernel, "pallas_gpu", abstract_args(jnp.float32, False, jnp.int8), "cuda")
    assert "triton" in text


@pytest.mark.parametrize("kernel", ["sparse_paged_decode", "paged_decode"])
@pytest.mark.parametrize("dtype, per_kv_head", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_int8_decode_kernels_lower_to_mosaic(simulated_tpu, kernel, dtype, per_kv_head):
    text = lower_text(kernel, "pallas_tpu", abstract_args(dtype, per_kv_head, jnp.int8), "tpu")
    assert_one_mosaic_kernel(text, kernel)


@pytest.mark.parametrize("kernel", ["sparse_paged_decode", "paged_decode"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_kernels_lower_to_mosaic_gpu(simulated_gpu, kernel, dtype):
    """The Mosaic GPU (TMA) decode kernel: the full Pallas -> Mosaic GPU lowering for CUDA (no ptxas)."""
    from kvjax.pallas_kernels.decode_mosaic_gpu import has_mosaic_gpu

    if not has_mosaic_gpu():
        pytest.skip("this JAX has no jax.experimental.pallas.mosaic_gpu")
    text = lower_text(kernel, "pallas_mosaic_gpu", abstract_args(dtype, per_kv_head=False), "cuda")
    assert "mosaic_gpu" in text
