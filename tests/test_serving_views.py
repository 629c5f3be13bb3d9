"""Typed jnp views of the flat pool: each group reads its pages at the layout's byte offsets, and writes
through one group's view leave every other byte of the pool unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.jenga import (
    FullAttentionSpec,
    JengaAllocator,
    PageCopy,
    PoolLayout,
    QuestMetadataSpec,
    SlidingWindowSpec,
)
from kvjax.jenga.views import apply_page_copies, make_pool, read_typed_pages, typed_view, write_typed_pages

KV = FullAttentionSpec(name="kv", num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", tokens_per_page=4)  # 256 B
QUEST = QuestMetadataSpec(name="quest", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", tokens_per_page=16)  # 128 B
LOCAL = SlidingWindowSpec(name="local", num_layers=1, num_kv_heads=3, head_dim=4, dtype="float32", tokens_per_page=4, window=8)  # 384 B


def random_pages(spec, count, seed):
    values = jax.random.normal(jax.random.PRNGKey(seed), (count, *spec.page_shape), jnp.float32)
    return values.astype(jnp.dtype(spec.dtype))


def test_typed_view_shapes_and_offsets():
    layout = PoolLayout.from_pool_bytes([KV, QUEST, LOCAL], 8 * 768)
    assert layout.large_page_bytes == 768  # lcm(256, 128, 384)
    # bytes below 0x7f: no float element is a NaN, whose payload XLA:CPU may canonicalise when it copies the
    # view (the elemental emitters the suite compiles with do: 0x7fbf read back as 0x7fc0)
    pool = jnp.asarray(np.random.default_rng(0).integers(0, 127, layout.pool_bytes, dtype=np.uint8))
    for spec in (KV, QUEST, LOCAL):
        view = typed_view(pool, layout, spec.name)
        assert view.shape == (layout.num_pages(spec.name), *spec.page_shape)
        assert view.dtype == jnp.dtype(spec.dtype)
        host = np.asarray(pool)
        for page in (0, 1, layout.num_pages(spec.name) - 1):
            start = layout.byte_offset(spec.name, page)
            expected = host[start : start + spec.page_bytes].view(np.dtype(jnp.dtype(spec.dtype))).reshape(spec.page_shape)
            np.testing.assert_array_equal(np.asarray(view[page]).view(np.uint8), expected.view(np.uint8))


def test_writes_through_one_view_touch_only_that_groups_pages():
    alloc = JengaAllocator([KV, QUEST, LOCAL], pool_bytes=8 * 768, enable_prefix_caching=False)
    alloc.allocate("a", list(range(20)))
    alloc.allocate("b", list(range(9)))
    layout = alloc.layout
    tables = {rid: alloc.block_tables(rid) for rid in ("a", "b")}
    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8))
    before = np.asarray(pool).copy()
    others_before = {name: np.asarray(typed_view(pool, layout, name)) for name in ("quest", "local")}

    kv_pages = np.array(tables["a"]["kv"] + tables["b"]["kv"])
    values = random_pages(KV, len(kv_pages), seed=2)
    pool = write_typed_pages(pool, layout, "kv", kv_pages, values)

    after = np.asarray(pool)
    written = np.zeros(layout.pool_bytes, bool)
    for page in kv_pages:
        start = layout.byte_offset("kv", int(page))
        written[start : start + KV.page_bytes] = True
    assert np.array_equal(after[~written], before[~written])  # nothing else moved
    np.testing.assert_array_equal(
        np.asarray(read_typed_pages(pool, layout, "kv", kv_pages)).view(np.uint16), np.asarray(values).view(np.uint16)
    )
    # The other groups' allocated pages read back exactly as before.
    for name in ("quest", "local"):
        pages = np.array(tables["a"][name] + tables["b"][name])
        now = np.asarray(typed_view(pool, layout, name))[pages]
        assert np.array_equal(now.view(np.uint8), others_before[name][pages].view(np.uint8))
    # And the groups' pages never share a large page.
    larges = {name: {layout.locate(name, p)[0] for rid in tables for p in tables[rid][name]} for name in ("kv", "quest", "local")}
    assert not (larges["kv"] & larges["quest"]) and not (larges["kv"] & larges["local"]) and not (larges["quest"] & larges["local"])


def test_tail_slack_is_never_written():
    odd = FullAttentionSpec(name="odd", num_layers=1, num_kv_heads=3, head_dim=5, dtype="float32", tokens_per_page=4)  # 480 B
    layout = PoolLayout((KV, odd), large_page_bytes=1024, num_large_pages=3)  # 2 odd pages + 64 B slack
    assert layout.tail_slack_bytes("odd") == 64
    pool = make_pool(layout)
    pages = np.arange(layout.num_pages("odd"))
    pool = write_typed_pages(pool, layout, "odd", pages, jnp.ones((len(pages), *odd.page_shape), jnp.float32))
    host = np.asarray(pool).reshape(3, 1024)
    assert np.all(host[:, 960:] == 0)
    np.testing.assert_array_equal(np.asarray(typed_view(pool, layout, "odd")), np.ones((6, *odd.page_shape), np.float32))


def test_apply_page_copies_and_input_checks():
    layout = PoolLayout.from_pool_bytes([KV], 4 * KV.page_bytes)
    pool = write_typed_pages(make_pool(layout), layout, "kv", np.array([0, 1]), random_pages(KV, 2, seed=3))
    copied = apply_page_copies(pool, layout, [PageCopy("kv", 0, 2), PageCopy("kv", 1, 3)])
    view = np.asarray(typed_view(copied, layout, "kv")).view(np.uint16)
    assert np.array_equal(view[2], view[0]) and np.array_equal(view[3], view[1])
    with pytest.raises(ValueError, match=r"pages for group 'kv' must be bfloat16\[k, 2, 2, 4, 2, 4\]"):
        write_typed_pages(pool, layout, "kv", np.array([0]), jnp.zeros((1, 2, 2, 4, 2, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"pool must be uint8\[1024\]"):
        typed_view(jnp.zeros((10,), jnp.uint8), layout, "kv")


def test_view_is_jittable():
    layout = PoolLayout.from_pool_bytes([KV, QUEST], 4 * 256)
    gather = jax.jit(lambda pool, ids: read_typed_pages(pool, layout, "kv", ids))
    pool = write_typed_pages(make_pool(layout), layout, "kv", np.array([3]), random_pages(KV, 1, seed=4))
    out = gather(pool, jnp.array([3, 3], jnp.int32))
    assert out.shape == (2, *KV.page_shape)
    np.testing.assert_array_equal(np.asarray(out[0]).view(np.uint16), np.asarray(out[1]).view(np.uint16))
