"""The Mosaic GPU decode kernel (`backend="pallas_mosaic_gpu"`) against the reference, under Mosaic GPU's
interpret mode on CPU (`InterpretGPUParams`: GMEM/SMEM, TMA copies and barriers simulated).

Nothing here runs on a GPU. Under interpretation the kernel drops its register-layout annotations
(`plgpu.load(layout=...)`, `layout_cast`), which the interpreter does not implement; copies, barriers and
arithmetic are the same as on the GPU. Lowering for CUDA is tested in test_kernels_lowering.py.
Inputs are NaN-poisoned (unused pages, slots past each length) as in test_kernels_decode.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import pallas_kernels as pk
from kvjax.pallas_kernels.decode_mosaic_gpu import gpu_interpret_params, has_mosaic_gpu
from kvjax.pallas_kernels.testing import make_paged_inputs, random_selection
from test_kernels_decode import assert_decode_matches, jitted

pytestmark = [
    pytest.mark.skipif(not has_mosaic_gpu(), reason="this JAX has no jax.experimental.pallas.mosaic_gpu"),
    pytest.mark.skipif(
        has_mosaic_gpu() and gpu_interpret_params() is None, reason="this JAX has no Mosaic GPU interpret mode"
    ),
]


@pytest.fixture(autouse=True)
def reset_interpreter():
    """After an exception inside GPU interpret mode its global state must be reset (JAX's docs)."""
    yield
    try:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
    except ImportError:
        return
    reset_gpu_interpret_mode_state()


# (dtype, page_size, head_dim, query heads, kv heads, lengths [B=2, KVH], selection rows Hsel (sparse) or
# None (dense), num_splits): ragged lengths incl. a partial first page, one full page and a page boundary.
CASES = [
    (jnp.float32, 16, 64, 4, 2, [[5, 70], [96, 33]], None, None),
    (jnp.float32, 16, 128, 8, 2, [[80, 17], [1, 64]], 8, 2),  # sparse per query head, split in two
    (jnp.bfloat16, 16, 128, 4, 2, [[41, 96], [16, 7]], None, None),
    (jnp.bfloat16, 32, 64, 8, 1, [[150], [33]], 1, None),  # G = 8, per kv head, page size 32
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_mosaic_gpu_decode_matches_reference_in_interpret_mode(case):
    dtype, page_size, head_dim, num_q_heads, num_kv_heads, lengths, sel_heads, num_splits = CASES[case]
    rng = np.random.default_rng([case, 71])
    inputs = make_paged_inputs(
        rng, batch=2, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, max_pages=6, lengths=lengths,
    )
    q, k_pages, v_pages, _, _, page_table, lengths = inputs.as_jax(dtype)
    kwargs = dict(backend="pallas_mosaic_gpu", interpret=True, return_stats=True, num_splits=num_splits)
    if sel_heads is None:
        args = (q, k_pages, v_pages, page_table, lengths)
        expected = jitted(pk.paged_decode_reference, return_stats=True)(*args)
        result = jitted(pk.paged_decode, **kwargs)(*args)
    else:
        selected = jnp.asarray(random_selection(rng, inputs, sel_heads, 4))
        args = (q, k_pages, v_pages, page_table, selected, lengths)
        expected = jitted(pk.sparse_paged_decode_reference, return_stats=True)(*args)
        result = jitted(pk.sparse_paged_decode, **kwargs)(*args)
    assert_decode_matches(result, expected, dtype)


def test_mosaic_gpu_rejects_what_it_does_not_support():
    q = jnp.zeros((1, 2, 64), jnp.float32)
    pages = jnp.zeros((4, 16, 64), jnp.float32)
    table, lengths = jnp.zeros((1, 1, 2), jnp.int32), jnp.ones((1, 1), jnp.int32)
    decode = pk.paged_decode
    with pytest.raises(ValueError, match="pages_per_block must be None or 4"):
        decode(q, pages, pages, table, lengths, backend="pallas_mosaic_gpu", interpret=True, pages_per_block=2)
    with pytest.raises(ValueError, match="head_dim a multiple of 32"):
        decode(q[..., :48], pages[..., :48], pages[..., :48], table, lengths, backend="pallas_mosaic_gpu")
    scales = jnp.ones((4, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match="int8"):
        decode(q, pages.astype(jnp.int8), pages.astype(jnp.int8), table, lengths, backend="pallas_mosaic_gpu",
               k_scale=scales, v_scale=scales)
