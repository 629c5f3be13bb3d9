"""The whole decode step exports for a GPU and a TPU from this CPU, and a default kernel that fails to compile
falls back to the XLA path with one warning.

Nothing here runs on a GPU or TPU. `target_platform(...)` makes the step pick the platform's natively
compiled kernels, and `jax.export` lowers the whole jitted step (projections, paged attention, page
allocation, the policy's selection) for `cuda` (Pallas Triton kernels) or `tpu` (Mosaic, for a simulated
TPU v5e), so a step that stops lowering fails here before a user's device sees it. The fallback test runs
the step with TPU kernels chosen on this CPU, where they cannot compile: a real compile failure.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import simulate
from kvjax.models.config import ModelConfig
from kvjax.engine.api import policy_or_full
from kvjax.models.loading import Model, init_params
from kvjax.pallas_kernels import target_platform
from kvjax.pallas_kernels._backend import triton_compiler_params
from kvjax.engine.decode import append_token

# head_dim 128: the TPU kernels' blocks need a lane-sized last axis
CFG = ModelConfig(
    model_type="llama", max_position_embeddings=4096, vocab_size=512, hidden_size=256, intermediate_size=320,
    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=128,
)
PROMPT = (np.arange(70)[None] * 5 % 500).astype(np.int32)
# kernel calls in one decode step: full reads every page (one scanned segment: 1 call); Quest with one dense
# layer: the dense layer's decode, then in the scanned selecting segment the page scores and the sparse decode
KERNEL_CALLS = {"full": 1, "quest": 3}


@pytest.fixture(scope="module")
def model():
    return Model(CFG, init_params(CFG, seed=0, std=0.08))


def policy_for(name):
    if name == "full":
        return policy_or_full(None)
    return kvjax.make_policy("quest", token_budget=32, page_size=16, dense_layers=1)


def abstract_decode_args(model, policy):
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
    args = (model.params, state, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), logits)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


@pytest.mark.parametrize("name", sorted(KERNEL_CALLS))
def test_decode_step_exports_for_tpu(model, name):
    policy = policy_for(name)
    args = abstract_decode_args(model, policy)
    with simulate("tpu"), target_platform("tpu", check_compiles=False):
        exported = jax.export.export(append_token, platforms=["tpu"])(
            *args, cfg=CFG, dtype=jnp.float32, policy=policy
        )
    assert exported.platforms == ("tpu",)
    assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == KERNEL_CALLS[name]


@pytest.mark.parametrize("name", sorted(KERNEL_CALLS))
def test_decode_step_exports_for_cuda(model, name):
    if triton_compiler_params() is None:
        pytest.skip("this JAX has no Pallas Triton backend")
    policy = policy_for(name)
    args = abstract_decode_args(model, policy)
    triton = "__gpu$xla.gpu.triton"
    with simulate("cuda"), target_platform("cuda", check_compiles=False):
        exported = jax.export.export(
            append_token, platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
        )(*args, cfg=CFG, dtype=jnp.float32, policy=policy)
    assert exported.platforms == ("cuda",)
    assert exported.mlir_module().count(f"stablehlo.custom_call @{triton}") == KERNEL_CALLS[name]


def test_a_kernel_that_fails_to_compile_falls_back_to_xla(model):
    policy = policy_for("quest")
    expected = kvjax.generate(model, PROMPT, 4, policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with target_platform("tpu"):  # TPU kernels, compiled natively, on this CPU: they cannot compile
            tokens = kvjax.generate(model, PROMPT, 4, policy)
            again = kvjax.generate(model, PROMPT, 4, policy)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(again, expected)
    messages = sorted({str(w.message) for w in caught if "failed to compile" in str(w.message)})
    kernels = sorted(m.split()[2] for m in messages)
    assert set(kernels) == {"paged_decode", "quest_page_scores", "sparse_paged_decode"}
    assert all("(pallas_tpu)" in m and "using the XLA path" in m and "\n" not in m for m in messages)
    assert len(messages) == 3  # one warning per kernel


def test_the_fallback_warns_once_per_kernel_and_shapes():
    from kvjax import pallas_kernels as pk
    from kvjax.pallas_kernels.testing import make_paged_inputs

    inputs = make_paged_inputs(np.random.default_rng(0), batch=1, num_q_heads=4, num_kv_heads=2, head_dim=128,
                               page_size=16, max_pages=4, poison=0.0)
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax()
    expected = pk.paged_decode(q, k_pages, v_pages, page_table, lengths, backend="xla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with target_platform("tpu"):
            outs = [pk.paged_decode(q, k_pages, v_pages, page_table, lengths) for _ in range(2)]
            outs.append(pk.paged_decode(q[:, :2], k_pages, v_pages, page_table[:, :1], lengths[:, :1]))
    for out in outs[:2]:
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert [str(w.message).split()[2] for w in caught] == ["paged_decode", "paged_decode"]  # two shapes
