"""Selectors beyond Quest's bound (`oracle_page`, `oracle_token`, `loki`, `key_int4`) and their page-score
kernel, against numpy statements of their definitions; each equals full attention when its budget covers
the context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import pallas_kernels as pk
from kvjax.pallas_kernels.sketch_scores import pack_int4, sketch_page_scores, unpack_int4, unpack_int4_x16
from kvjax.engine.decode import page_view
from kvjax.pallas_kernels.testing import make_paged_inputs
from kvjax.policies.base import PageView
from policy_cases import quick_params


def numpy_page_scores(q, rows, page_table, lengths, page_size):
    """Definition: page p of kv head h scores max over its slots s of q . rows[page, s] for each query head
    of h; -inf at the current page and past the used pages. `rows [N, ps, R']` are decoded codes."""
    B, Hq, _ = q.shape
    KVH, P = page_table.shape[1:]
    out = np.full((B, Hq, P), -np.inf, np.float32)
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // KVH)
            length = lengths[b, h]
            for p in range(-(-length // page_size)):
                if p != (length - 1) // page_size:
                    out[b, hq, p] = max(float(q[b, hq] @ rows[page_table[b, h, p], s]) for s in range(page_size))
    return out


def int4_values(packed):
    """numpy decode of `pack_int4`: byte j holds channel j (low nibble) and j + R (high), signed."""
    x = packed.astype(np.int32)
    low, high = x & 15, (x >> 4) & 15
    low, high = np.where(low > 7, low - 16, low), np.where(high > 7, high - 16, high)
    return np.concatenate([low, high], axis=-1).astype(np.float32)


def sketch_inputs(rng, codes_kind, page_size=8, width=16):
    inputs = make_paged_inputs(rng, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=width, page_size=page_size,
                               max_pages=5, poison=0.0)
    if codes_kind == "int4":
        values = rng.integers(-8, 8, size=inputs.k_pages.shape[:2] + (width,))
        codes = np.asarray(pack_int4(jnp.asarray(values)))
        rows = int4_values(codes)
        q = rng.standard_normal((2, 4, width), dtype=np.float32)
    else:
        codes = rows = inputs.k_pages
        q = inputs.q
    return q, codes, rows, inputs.page_table, inputs.lengths


def test_int4_packing_round_trips():
    values = np.arange(-8, 8).repeat(4).reshape(2, 32)
    packed = pack_int4(jnp.asarray(values))
    assert packed.dtype == jnp.int8 and packed.shape == (2, 16)
    np.testing.assert_array_equal(int4_values(np.asarray(packed)), values)
    low, high = unpack_int4(packed)
    np.testing.assert_array_equal(np.concatenate([low, high], -1), values)
    np.testing.assert_array_equal(unpack_int4_x16(packed), 16 * values)  # the XLA path's int8 rows
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_int4_x16(packed[:, :6])


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("codes_kind", ["float", "int4"])
def test_sketch_scores_match_definition(backend, codes_kind):
    rng = np.random.default_rng([3, len(backend), len(codes_kind)])
    q, codes, rows, table, lengths = sketch_inputs(rng, codes_kind)
    expected = numpy_page_scores(q, rows, table, lengths, codes.shape[1])
    actual = np.asarray(sketch_page_scores(jnp.asarray(q), jnp.asarray(codes), jnp.asarray(table),
                                           jnp.asarray(lengths), page_size=codes.shape[1], codes_kind=codes_kind,
                                           backend=backend, interpret=True if backend != "xla" else None))
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("codes_kind", ["float", "int4"])
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_xla_scores_in_blocks_equal_the_reference(codes_kind, per_kv_head):
    """The CPU path's scan over blocks of pages (2 pages a block over 5 logical pages: a padded last block)
    against the reference, which scores every slot at once; bfloat16 bit-pattern codes for the float kind."""
    rng = np.random.default_rng([7, len(codes_kind), per_kv_head])
    q, codes, _, table, lengths = sketch_inputs(rng, codes_kind)
    if codes_kind == "float":
        codes = pk.bfloat16_bits(jnp.asarray(codes))
    args = (jnp.asarray(q), jnp.asarray(codes), jnp.asarray(table), jnp.asarray(lengths))
    options = dict(page_size=codes.shape[1], codes_kind=codes_kind)
    expected = pk.sketch_page_scores_reference(*args, **options, per_kv_head=per_kv_head)
    from kvjax.pallas_kernels.quest_scores_xla import finish_scores
    from kvjax.pallas_kernels.sketch_scores import sketch_page_scores_xla

    for pages_per_block in (2, None):
        blocked = finish_scores(sketch_page_scores_xla(*args, **options, pages_per_block=pages_per_block), per_kv_head)
        np.testing.assert_allclose(np.asarray(blocked), np.asarray(expected), rtol=1e-6, atol=1e-5)
    if codes_kind == "int4":  # one query head a kv head: float32 rows, not the grouped int8 product
        mha = (args[0][:, ::2],) + args[1:]
        np.testing.assert_allclose(
            np.asarray(finish_scores(sketch_page_scores_xla(*mha, **options, pages_per_block=2), per_kv_head)),
            np.asarray(pk.sketch_page_scores_reference(*mha, **options, per_kv_head=per_kv_head)), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sketch_page_scores(*args, **options, per_kv_head=per_kv_head, backend="xla")),
                               np.asarray(expected), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("group", [1, 2])
def test_xla_scores_do_not_decode_the_whole_context(group):
    """4-bit codes of 4 kv heads x 16384 slots decode to 32 MiB of float32 rows (8 MiB as the int8 rows that
    grouped queries' products read): the reference holds them all at once, the XLA path (the CPU default) about
    one block, 2 MiB of float32 rows (one query head a kv head) or 1 MiB of int8 rows (XLA's own buffer
    accounting of the compiled step)."""
    s = jax.ShapeDtypeStruct
    args = (s((1, 4 * group, 128), jnp.float32), s((4 * 1024, 16, 64), jnp.int8), s((1, 4, 1024), jnp.int32),
            s((1, 4), jnp.int32))
    int8_rows = 4 * 16384 * 128

    def temp_bytes(backend):
        fn = lambda *a: sketch_page_scores(*a, page_size=16, codes_kind="int4", backend=backend)  # noqa: E731
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    if group == 1:
        assert temp_bytes("reference") >= 4 * int8_rows  # the check can tell the two apart
    assert temp_bytes(None) < int8_rows // 3


@pytest.mark.parametrize("codes_kind, page_size, width", [("float", 16, 16), ("int4", 16, 32), ("float", 32, 64)])
def test_mosaic_gpu_sketch_scores_match_definition(codes_kind, page_size, width):
    """The Mosaic GPU scorer under Mosaic GPU's interpret mode (TMA copies and barriers simulated on CPU):
    one block of 64 slots (4 or 2 pages) per CUDA block, 5 logical pages per head (a padded last block)."""
    from kvjax.pallas_kernels.decode_mosaic_gpu import gpu_interpret_params, has_mosaic_gpu

    if not has_mosaic_gpu() or gpu_interpret_params() is None:
        pytest.skip("this JAX has no Mosaic GPU interpret mode")
    rng = np.random.default_rng([11, page_size, width])
    q, codes, rows, table, lengths = sketch_inputs(rng, codes_kind, page_size=page_size, width=width)
    if codes_kind == "float":
        codes = np.asarray(pk.bfloat16_bits(jnp.asarray(codes)))
        rows = np.asarray(pk.page_values(jnp.asarray(codes)), np.float32)
    expected = numpy_page_scores(q, rows, table, lengths, page_size)
    actual = np.asarray(sketch_page_scores(jnp.asarray(q), jnp.asarray(codes), jnp.asarray(table), jnp.asarray(lengths),
                                           page_size=page_size, codes_kind=codes_kind, backend="pallas_mosaic_gpu",
                                           interpret=True))
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-5, atol=1e-4)


def test_sketch_scores_lower_for_tpu_and_gpu():
    from conftest import simulate
    from kvjax.pallas_kernels._backend import triton_compiler_params
    from kvjax.pallas_kernels.decode_mosaic_gpu import has_mosaic_gpu

    s = jax.ShapeDtypeStruct
    for kind, codes in (("float", s((40, 16, 64), jnp.bfloat16)), ("int4", s((40, 16, 32), jnp.int8))):
        args = (s((2, 8, 64), jnp.float32), codes, s((2, 2, 9), jnp.int32), s((2, 2), jnp.int32))
        for backend, platform, mark in (("pallas_tpu", "tpu", "tpu_custom_call"), ("pallas_gpu", "cuda", "triton"),
                                        ("pallas_mosaic_gpu", "cuda", "mosaic_gpu")):
            if backend == "pallas_gpu" and triton_compiler_params() is None or \
                    backend == "pallas_mosaic_gpu" and not has_mosaic_gpu():
                continue
            fn = lambda *a, backend=backend, kind=kind: sketch_page_scores(
                *a, page_size=16, codes_kind=kind, backend=backend, interpret=False)
            with simulate(platform):
                assert mark in jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# ------------------------------------------------------------------------------------------- policies


def view_of(inputs_rng):
    inputs = make_paged_inputs(inputs_rng, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                               max_pages=6, lengths=[[21, 9], [24, 13]], poison=0.0)
    q, k_pages, _, kmin, kmax, table, lengths = inputs.as_jax()
    view = PageView(layer=jnp.int32(0), num_layers=1, lengths=lengths, q=q, page_table=table, kmin=kmin, kmax=kmax,
                    page_size=4, k_pages=k_pages)
    return inputs, view


def test_oracle_page_scores_pages_by_their_exact_best_key():
    inputs, view = view_of(np.random.default_rng(0))
    policy = kvjax.make_policy("oracle_page", token_budget=12)
    expected = numpy_page_scores(inputs.q, inputs.k_pages, inputs.page_table, inputs.lengths, 4)
    np.testing.assert_allclose(np.asarray(policy.page_bounds(view)), expected, rtol=1e-5, atol=1e-5)
    chosen = np.asarray(policy.select_pages(view))  # top 2 pages per query head
    np.testing.assert_array_equal(np.sort(chosen, -1), np.sort(np.argsort(-expected, -1, kind="stable")[..., :2], -1))


def test_oracle_token_selects_each_heads_top_slots():
    inputs, view = view_of(np.random.default_rng(1))
    policy = kvjax.make_policy("oracle_token", token_budget=8)
    chosen = np.asarray(policy.select_pages(view))  # [B, Hq, 7] slots in logical order
    for b in range(2):
        for hq in range(4):
            h, length = hq // 2, inputs.lengths[b, hq // 2]
            keys = np.stack([inputs.k_pages[inputs.page_table[b, h, s // 4], s % 4] for s in range(length - 1)])
            top = np.argsort(-(keys @ inputs.q[b, hq]), kind="stable")[:7]  # the newest slot is read anyway
            assert set(chosen[b, hq][chosen[b, hq] >= 0]) == set(top)


def numpy_loki(keys, q, rank):
    """Definition: the top-`rank` right singular vectors P of the head's keys; q.k ~ (q P) . (k P)."""
    _, _, vt = np.linalg.svd(keys, full_matrices=False)
    basis = vt[:rank].T
    return (keys @ basis) @ (q @ basis)


def numpy_int4(keys, q, quantile):
    """Definition: scale_d = quantile of |k_d| / 7; codes round(k / scale) in [-8, 7]; score (q * scale) . codes."""
    scale = np.quantile(np.abs(keys), quantile, axis=0) / 7
    return np.clip(np.round(keys / scale), -8, 7) @ (q * scale)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("name, options, reference", [
    ("loki", dict(rank=3), lambda k, q: numpy_loki(k, q, 3)),
    ("key_int4", dict(clip_quantile=0.9), lambda k, q: numpy_int4(k, q, 0.9)),
])
def test_sketch_selectors_score_as_defined(name, options, reference, kv_dtype):
    """Prefill a tiny model with the selector, then score every page of a layer from the state's sketch and
    compare with the numpy definition applied to the same layer's keys, as attention reads them (bfloat16
    pages held as bit patterns, int8 pages dequantised)."""
    from kvjax.cache.state import gather_layer
    from kvjax.engine.api import prefill

    model = tiny_model().with_kv_dtype(kv_dtype)
    policy = kvjax.make_policy(name, token_budget=32, dense_layers=0, **options)
    prompt = np.random.default_rng(2).integers(5, model.cfg.vocab_size, size=(1, 70))
    state, _ = prefill(model, prompt, policy, page_size=16, max_new_tokens=4)
    layer = 1
    keys, _, _, valid = gather_layer(state, layer)
    q = np.random.default_rng(3).standard_normal((1, model.cfg.num_heads, model.cfg.head_dim)).astype(np.float32)
    view = page_view(state, jnp.int32(layer), model.cfg.num_layers, jnp.asarray(q))
    actual = np.asarray(policy.page_bounds(view))  # [1, Hq, P]
    G = model.cfg.num_heads // model.cfg.num_kv_heads
    for hq in range(model.cfg.num_heads):
        k = np.asarray(keys[0, hq // G])[: int(valid[0, hq // G].sum())]
        slot = reference(k.astype(np.float64), q[0, hq].astype(np.float64))
        pages = [slot[i * 16 : (i + 1) * 16].max() for i in range(len(k) // 16)]  # 4 full pages, the 5th current
        scale = np.abs(slot).max()
        np.testing.assert_allclose(actual[0, hq, :4], pages, rtol=2e-2, atol=2e-2 * scale)


def tiny_model():
    return kvjax.load_model("tiny")


@pytest.mark.parametrize("name, kv_dtype", quick_params(
    [(n, d) for d in ("float32", "bfloat16", "int8") for n in ("oracle_page", "oracle_token", "loki", "key_int4")],
    [("oracle_token", "float32"), ("key_int4", "int8")],  # slot selection; int8 pages (Loki: the compose test)
    ids=lambda v: f"{v[0]}-{v[1]}"))
def test_selector_equals_full_attention_when_budget_covers_context(name, kv_dtype):
    model = tiny_model().with_kv_dtype(kv_dtype)
    prompt = np.random.default_rng(4).integers(5, model.cfg.vocab_size, size=(2, 60))
    policy = kvjax.make_policy(name, token_budget=128, dense_layers=0)
    if kv_dtype == "int8" and name.startswith("oracle"):  # the oracles score float keys (evaluation only)
        with pytest.raises(NotImplementedError, match="not int8"):
            kvjax.generate(model, prompt, 4, policy=policy, decode_last=6)
        return
    full = kvjax.generate(model, prompt, 4, decode_last=6)
    np.testing.assert_array_equal(kvjax.generate(model, prompt, 4, policy=policy, decode_last=6), full)


@pytest.mark.parametrize("evict, select", quick_params(
    [("snapkv", "loki"), ("h2o", "key_int4"), ("tova", "loki"), ("streaming", "key_int4"), ("snapkv", "key_int4"),
     ("h2o", "loki")], [("snapkv", "loki"), ("h2o", "key_int4")], ids=lambda v: f"{v[0]}-{v[1]}"))
def test_sketch_selector_composes_with_an_evictor(evict, select):
    """Compose(evict=..., select=loki | key_int4): the sketch is fitted on the compressed state (and written
    for every decoded token, into H2O's refilled holes too); when the selection's budget covers every
    kept slot, tokens and log-probabilities equal the evictor alone, and at a small budget it selects."""
    model = tiny_model()
    prompt = np.random.default_rng(5).integers(5, model.cfg.vocab_size, size=(2, 300))
    evictor = kvjax.make_policy(evict, token_budget=64, dense_layers=0)
    alone, lp_alone = kvjax.generate(model, prompt, 6, policy=evictor, return_logprobs=True)
    covering = kvjax.make_policy("compose", evict=evictor,
                                 select=kvjax.make_policy(select, token_budget=128, dense_layers=0))
    tokens, lp = kvjax.generate(model, prompt, 6, policy=covering, return_logprobs=True)
    np.testing.assert_array_equal(tokens, alone)
    # the selection reads the kept pages through the sparse kernel, in another order: float32 rounding
    np.testing.assert_allclose(lp, lp_alone, atol=1e-4)
    state, _ = kvjax.prefill(model, prompt, policy=covering, max_new_tokens=6)
    assert state.key_sketch is not None
    narrow = kvjax.make_policy("compose", evict=evictor,
                               select=kvjax.make_policy(select, token_budget=32, dense_layers=0))
    _, lp_narrow = kvjax.generate(model, prompt, 6, policy=narrow, return_logprobs=True)
    assert not np.allclose(lp_narrow, lp_alone, atol=1e-4)
