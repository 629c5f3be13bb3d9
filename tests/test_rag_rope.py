"""Chunk keys moved to new positions: re-rotation by a delta is correct for every RoPE type in the registry,
the two storage forms agree, and moves that cannot be done by a delta are refused."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from kvjax.rag import ChunkStore, RopeShiftError, assemble, rotate_keys, shift_keys
from kvjax.models.rope import ROPE_REGISTRY, apply_rope, rope_frequencies
from rag_helpers import CONFIG_FOR_ROPE, random_model, request, rope_config


def test_every_registered_rope_type_is_covered():
    assert set(CONFIG_FOR_ROPE) == set(ROPE_REGISTRY)


def _keys(cfg, seed=0, T=40):
    return jax.random.normal(jax.random.PRNGKey(seed), (2, T, cfg.num_kv_heads, cfg.head_dim))


def _rotate_float64(k_pre, positions, cfg, long_rope):
    """RoPE in float64 numpy: the exact answer both float32 paths approximate."""
    inv_freq, factor = rope_frequencies(cfg, long_rope)
    x = np.asarray(k_pre, np.float64)
    angles = np.asarray(positions, np.float64)[..., None] * inv_freq.astype(np.float64)  # [B, T, R/2]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, :, None] * factor
    sin = np.sin(np.concatenate([angles, angles], -1))[:, :, None] * factor
    R, half = 2 * inv_freq.shape[0], inv_freq.shape[0]
    rot = x[..., :R]
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
    return np.concatenate([rot * cos + rotated * sin, x[..., R:] * 1.0], -1)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("rope_type", sorted(CONFIG_FOR_ROPE))
def test_shift_equals_rotation_at_the_new_position(rope_type, partial):
    cfg = rope_config(rope_type)
    rope = dataclasses.replace(cfg.rope, partial_rotary_factor=partial)
    if rope.short_factor is not None:  # LongRoPE has one factor per rotated pair
        half = int(cfg.head_dim * partial) // 2
        rope = dataclasses.replace(rope, short_factor=rope.short_factor[:half], long_factor=rope.long_factor[:half])
    cfg = dataclasses.replace(cfg, rope=rope)
    k_pre = _keys(cfg)
    rng = np.random.default_rng(1)
    old = rng.integers(0, 300, (2, 40)).astype(np.int32)
    delta = rng.integers(-200, 900, (2, 40)).astype(np.int32)
    delta = np.maximum(delta, -old)
    for long_rope in ([False, True] if rope_type == "longrope" else [False]):
        moved = np.asarray(shift_keys(rotate_keys(k_pre, old, cfg, long_rope), delta, cfg, long_rope))
        direct = np.asarray(rotate_keys(k_pre, old + delta, cfg, long_rope))
        exact = _rotate_float64(k_pre, old + delta, cfg, long_rope)
        # float32 angles near position 1000 carry ~1e-4 rad of rounding either way: the shift must be about
        # as accurate as rotating at the new position directly
        shift_error, direct_error = np.abs(moved - exact).max(), np.abs(direct - exact).max()
        assert shift_error <= 3 * direct_error + 1e-5, (shift_error, direct_error)
        if partial < 1.0:  # the unrotated dims pass through (scaled once by the attention factor)
            rotary = cfg.rotary_dim
            np.testing.assert_allclose(moved[..., rotary:], direct[..., rotary:], rtol=1e-6)


@pytest.mark.parametrize("rope_type", ["yarn", "longrope"])
def test_attention_factor_is_not_applied_twice(rope_type):
    """Re-rotating with the scaled table (apply_rope with YaRN's mscale) would scale keys twice."""
    cfg = rope_config(rope_type)
    inv_freq, factor = rope_frequencies(cfg)
    assert abs(factor - 1.0) > 0.05  # otherwise this test could not tell
    k_pre = _keys(cfg)
    old = np.full((2, 40), 3, np.int32)
    delta = np.full((2, 40), 17, np.int32)
    rotated = rotate_keys(k_pre, old, cfg)
    naive = apply_rope(rotated, delta, inv_freq, factor)
    good = shift_keys(rotated, delta, cfg)
    direct = rotate_keys(k_pre, old + delta, cfg)
    np.testing.assert_allclose(np.asarray(good), np.asarray(direct), atol=2e-5)
    assert not np.allclose(np.asarray(naive), np.asarray(direct), atol=1e-3)


def test_longrope_shift_across_the_factor_switch_is_refused():
    cfg = rope_config("longrope")
    k = rotate_keys(_keys(cfg), np.zeros((2, 40), np.int32), cfg, long_rope=False)
    with pytest.raises(RopeShiftError, match="short factors.*passes.*long ones.*pre_rope"):
        shift_keys(k, np.ones((2, 40), np.int32), cfg, long_rope=False, target_long_rope=True)
    shift_keys(k, np.ones((2, 40), np.int32), cfg, long_rope=False, target_long_rope=False)


@pytest.mark.parametrize("rope_type", ["yarn", "longrope"])
def test_stored_forms_assemble_the_same_keys(rope_type):
    """pre-RoPE entries rotated at the new positions == post-RoPE entries re-rotated by the delta."""
    model = random_model(rope_config(rope_type, max_position_embeddings=256))
    prefix, chunks, query = request(0, num_chunks=2, chunk_len=8)
    contexts = {form: assemble(model, ChunkStore(model, form=form), prefix, chunks, query, max_new_tokens=4)
                for form in ("pre_rope", "rotated")}
    a, b = contexts["pre_rope"], contexts["rotated"]
    assert a.long_rope is False  # 5 + 16 + 4 + 4 < 32: LongRoPE's short factors
    np.testing.assert_array_equal(a.positions, np.arange(a.num_slots))
    for layer in range(model.cfg.num_layers):
        (ka, va), (kb, vb) = a.layer_kv(layer), b.layer_kv(layer)
        np.testing.assert_allclose(np.asarray(ka), np.asarray(kb), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))


def test_longrope_rotated_store_refuses_a_long_assembly_and_pre_rope_accepts_it():
    model = random_model(rope_config("longrope"))
    prefix, chunks, query = request(1, num_chunks=2, chunk_len=12)
    with pytest.raises(RopeShiftError, match="LongRoPE"):
        assemble(model, ChunkStore(model, form="rotated"), prefix, chunks, query, max_new_tokens=64)
    ctx = assemble(model, ChunkStore(model, form="pre_rope"), prefix, chunks, query, max_new_tokens=64)
    assert ctx.long_rope is True
