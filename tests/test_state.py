"""Paged state invariants, capacity errors and bad input."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from conftest import VOCAB, random_tokens
from kvjax.cache.state import allocate_for_append, append_to_layer, init_state


@pytest.fixture(scope="module")
def llama(hf_models):
    return kvjax.load_model(hf_models("llama_gqa_llama3")[1])


def check_invariants(state):
    table = np.asarray(state.page_table)
    lengths = np.asarray(state.lengths)
    ps = state.page_size
    num_free = int(state.num_free)
    free = np.asarray(state.free_pages)[:num_free]
    used = []
    for idx in np.ndindex(*lengths.shape):
        n_pages = -(-int(lengths[idx]) // ps)
        pages = table[idx][:n_pages]
        assert np.all(pages >= 0), f"{idx}: a page below the length is unallocated"
        assert np.all(table[idx][n_pages:] == -1), f"{idx}: a page past the length is mapped"
        used += pages.tolist()
    assert len(set(used)) == len(used), "a page is used twice"
    assert len(set(free.tolist())) == len(free), "a page is free twice"
    assert not set(used) & set(free.tolist()), "a page is both free and used"
    assert len(used) + num_free == state.num_pages, "a page is neither free nor used (leak)"
    refcount = np.asarray(state.refcount)
    assert np.all(refcount[used] == 1)
    # metadata equals the min/max over valid slots
    keys = state.read_k(np.arange(state.num_pages))  # the keys attention reads (dequantised int8 pages)
    k, kmin, kmax, slot_pos = (np.asarray(x) for x in (keys, state.kmin, state.kmax, state.slot_pos))
    holes = np.asarray(state.hole)
    for idx in np.ndindex(*lengths.shape):
        n = int(lengths[idx])
        hole = int(holes[idx])
        assert -1 <= hole < n, f"{idx}: hole {hole} outside [0, {n})"
        for p in range(-(-n // ps)):
            page = table[idx][p]
            valid = np.arange(ps) < n - p * ps
            if 0 <= hole - p * ps < ps:
                valid[hole - p * ps] = False
                assert slot_pos[page, hole - p * ps] == -1, f"{idx}: the hole holds a position"
            if valid.any():
                np.testing.assert_array_equal(kmin[page], k[page][valid].min(0))
                np.testing.assert_array_equal(kmax[page], k[page][valid].max(0))
            assert np.all(slot_pos[page][valid] >= 0) and np.all(slot_pos[page][np.arange(ps) >= n - p * ps] == -1)


# each example of a new batch size, page size or page dtype compiles anew: 6 in the quick suite, 20 in CI's set
@settings(max_examples=20 if os.environ.get("KVJAX_TEST_HEAVY") == "1" else 3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 45), min_size=1, max_size=3),
    chunk=st.just(16),
    page_size=st.sampled_from([4, 16]),
    decode_steps=st.integers(0, 5),
    kv_dtype=st.sampled_from(["float32", "bfloat16", "int8"]),
)
def test_state_invariants_under_random_prompts(llama, lengths, chunk, page_size, decode_steps, kv_dtype):
    prompts = [random_tokens(n, (n,)).tolist() for n in lengths]
    llama = llama.with_kv_dtype(kv_dtype)
    # a fixed capacity keeps state shapes (and so compiles) shared across examples
    state, _ = kvjax.prefill(llama, prompts, chunk_size=chunk, page_size=page_size, capacity=64)
    check_invariants(state)
    for step in range(decode_steps):
        _, state = kvjax.decode_step(llama, state, np.full(len(lengths), step % VOCAB))
    check_invariants(state)
    assert np.asarray(state.lengths)[0, :, 0].tolist() == [n + decode_steps for n in lengths]


def test_pool_overflow_writes_nothing_and_is_reported(llama):
    cfg = llama.cfg
    state = init_state(cfg, batch=1, capacity=64, page_size=16, num_pages=cfg.num_layers * cfg.num_kv_heads * 2)
    k = jnp.ones((1, 16, cfg.num_kv_heads, cfg.head_dim))
    state, ok = allocate_for_append(state, jnp.asarray([16], jnp.int32), 16)
    assert bool(ok)
    before = np.asarray(state.page_table).copy()
    # lengths are still 0 (nothing appended): 40 slots need 3 pages per head, the one each head already has
    # in its table counts (pages placed ahead are used as they are), so 2 new ones, 8 in all, and 4 are free
    state, ok = allocate_for_append(state, jnp.asarray([40], jnp.int32), 40)
    assert not bool(ok)
    np.testing.assert_array_equal(np.asarray(state.page_table), before)
    error = kvjax.cache.state.overflow_error(state)
    assert isinstance(error, kvjax.CacheCapacityError)
    assert error.pages_needed == 2 * cfg.num_layers * cfg.num_kv_heads and error.pages_available == 4
    assert "needed 8 new pages" in str(error) and "4 of 8 were free" in str(error)
    # a write after a failed allocation with num_new forced to 0 changes nothing
    after = append_to_layer(state, 0, k, k, jnp.zeros((1, 16), jnp.int32), jnp.asarray([0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(after.k_pages), np.asarray(state.k_pages))


def test_prompt_longer_than_capacity_raises_before_work(llama, monkeypatch):
    import kvjax.engine.generation as gen

    def no_work(*args, **kwargs):
        raise AssertionError("a step ran before the capacity check")

    monkeypatch.setattr(gen, "LOCAL_BACKEND", gen.LOCAL_BACKEND._replace(append_chunk=no_work, append_token=no_work, compress_step=no_work))
    with pytest.raises(kvjax.CacheCapacityError, match="needs 40 tokens .* capacity is 32 tokens") as info:
        kvjax.generate(llama, random_tokens(0, (1, 30)), max_new_tokens=10, capacity=32)
    assert info.value.pages_needed == 3 and info.value.pages_available == 2
    with pytest.raises(kvjax.CacheCapacityError, match="pages per"):
        kvjax.prefill(llama, random_tokens(0, (1, 30)), capacity=16)


def test_decode_past_capacity_raises(llama):
    state, _ = kvjax.prefill(llama, random_tokens(1, (1, 15)), capacity=16)
    _, state = kvjax.decode_step(llama, state, [3])  # the 16th slot fits
    with pytest.raises(kvjax.CacheCapacityError, match="outgrew its page table"):
        kvjax.decode_step(llama, state, [4])


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "is empty"),
        ([[1, 2], []], r"prompt_ids\[1\] is empty"),
        ([[1, VOCAB]], f"token id {VOCAB} at position 1 outside the vocabulary"),
        ([[-1, 2]], "token id -1 at position 0"),
        ([[1.5, 2.0]], "integer token ids"),
    ],
)
def test_bad_prompts_raise_clear_errors(llama, prompt, message):
    with pytest.raises(ValueError, match=message):
        kvjax.generate(llama, prompt, max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(decode_last=5), "decode_last"),
        (dict(page_size=12), "power of two"),
    ],
)
def test_bad_generation_options(llama, kwargs, message):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        kvjax.generate(llama, [[1, 2, 3, 4, 5]], **kwargs)


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown policy 'nope'; registered: .*full"):
        kvjax.make_policy("nope")
    with pytest.raises(ValueError, match="no option"):
        kvjax.make_policy("full", token_budget=3)


def test_bfloat16_pages_on_cpu_are_held_as_bits_and_match_bfloat16(llama):
    """On CPU, bfloat16 pages are held as uint16 bit patterns (XLA:CPU converted a bfloat16 pool to float32 and
    back around every scatter) with float32 metadata. The first layer's stored keys and values are exactly the
    float32 run's rounded to bfloat16 (its inputs do not depend on the cache), and decoding from those pages
    gives the same logits and tokens as decoding from the same pages held as bfloat16 (the layout a GPU or TPU
    uses, which the reference backend reads after bitcasting the pool)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the uint16 layout is the CPU one")
    state = init_state(llama.cfg, batch=1, capacity=32, dtype=jnp.bfloat16)
    assert state.k_pages.dtype == jnp.uint16 and state.page_dtype == jnp.bfloat16 and state.kmin.dtype == jnp.float32
    model = llama.with_kv_dtype("bfloat16")
    prompt = random_tokens(7, (2, 40))
    bits_state, logits = kvjax.prefill(model, prompt, chunk_size=16, capacity=64)
    check_invariants(bits_state)
    float_state, _ = kvjax.prefill(llama, prompt, chunk_size=16, capacity=64)
    for read in ("read_k", "read_v"):
        ours, theirs = (layer_values(s, 0, read) for s in (bits_state, float_state))
        assert ours.dtype == jnp.bfloat16
        np.testing.assert_array_equal(ours, theirs.astype(jnp.bfloat16), err_msg=read)
    # the same pages held as bfloat16: the pool bitcast, its metadata in bfloat16 (exact: min/max of bfloat16 keys)
    as_bf16 = lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16)  # noqa: E731
    bf16_state = bits_state.replace(k_pages=as_bf16(bits_state.k_pages), v_pages=as_bf16(bits_state.v_pages),
                                    kmin=bits_state.kmin.astype(jnp.bfloat16), kmax=bits_state.kmax.astype(jnp.bfloat16))
    bits_state = jax.tree.map(jnp.copy, bits_state)  # decode_step donates its state
    token = np.asarray(logits).argmax(-1)
    for _ in range(4):
        bits_logits, bits_state = kvjax.decode_step(model, bits_state, token)
        bf16_logits, bf16_state = kvjax.decode_step(model, bf16_state, token)
        assert bits_state.k_pages.dtype == jnp.uint16 and bf16_state.k_pages.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(bits_logits), np.asarray(bf16_logits), rtol=0, atol=1e-6)
        token = np.asarray(bits_logits).argmax(-1)
        assert (token == np.asarray(bf16_logits).argmax(-1)).all()
    np.testing.assert_array_equal(layer_values(bits_state, 1, "read_k"), layer_values(bf16_state, 1, "read_k"))


def layer_values(state, layer, read):
    """`read` ("read_k" / "read_v") of every slot `layer` maps, in page-table order: [B, H, pages * ps, D]."""
    table = np.asarray(state.page_table)[layer]
    pages = np.where(table >= 0, table, 0)
    values = np.asarray(getattr(state, read)(pages))  # [B, H, P, ps, D]
    mapped = (table >= 0)[..., None, None]
    return np.where(mapped, values, 0).reshape(*table.shape[:2], -1, values.shape[-1]).astype(values.dtype)


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.int8])
def test_write_slots_overwrites_exactly_those_slots_and_keeps_metadata_exact(llama, kv_dtype):
    """A RAG context recomputes some of its slots in place: `write_slots` must change those slots of every head
    and nothing else, and leave kmin/kmax the exact bounds of what attention reads."""
    from kvjax.cache.state import gather_layer, write_slots

    cfg = llama.cfg
    H, D, S = cfg.num_kv_heads, cfg.head_dim, 21
    rng = np.random.default_rng(0)
    k0, v0, k1, v1 = (rng.normal(size=(2, S, H, D)).astype(np.float32) * 3 for _ in range(4))
    state = init_state(cfg, 2, 48, page_size=8, dtype=kv_dtype)
    state, ok = allocate_for_append(state, jnp.full((2,), S, jnp.int32), S)
    assert bool(ok)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
    for layer in range(cfg.num_layers):
        state = append_to_layer(state, layer, k0, v0, positions, jnp.full((2,), S, jnp.int32))
    slots = np.array([[0, 7, 8, 20], [3, 4, 15, 16]], np.int32)
    picked = k1[np.arange(2)[:, None], slots], v1[np.arange(2)[:, None], slots]  # [2, 4, H, D]
    written = jax.jit(write_slots, static_argnums=1)(state, 1, jnp.asarray(slots), *picked)
    check_invariants(written)
    before, after = gather_layer(state, 1), gather_layer(written, 1)
    for old, new, fresh in zip(before[:2], after[:2], picked):
        old, new = np.asarray(old)[:, :, :S], np.asarray(new)[:, :, :S]  # [2, H, S, D]
        for b in range(2):
            others = np.setdiff1d(np.arange(S), slots[b])
            np.testing.assert_array_equal(new[b][:, others], old[b][:, others])
            tol = 0.05 if kv_dtype == jnp.int8 else 0
            np.testing.assert_allclose(new[b][:, slots[b]], np.swapaxes(fresh[b], 0, 1), atol=tol * 3 * 4)
    for layer in set(range(cfg.num_layers)) - {1}:  # other layers untouched
        np.testing.assert_array_equal(np.asarray(gather_layer(written, layer)[0]), np.asarray(gather_layer(state, layer)[0]))
    np.testing.assert_array_equal(np.asarray(written.lengths), np.asarray(state.lengths))
    np.testing.assert_array_equal(np.asarray(written.slot_pos), np.asarray(state.slot_pos))


def test_a_copied_state_is_a_new_state_by_one_program():
    """`kvjax.util.trees.copied` (a saved state's copy per question, a shared prefill's per use): equal arrays
    in buffers of their own, so a step may donate the copy, by one program (a copy per leaf built ten)."""
    from kvjax.util.compile_count import count_compiles
    from kvjax.util.trees import copied

    state = init_state(kvjax.load_model("tiny").cfg, 2, 48, 16, num_pages=23)
    with count_compiles() as built:
        copy = copied(state)
    assert built.total == 1, built
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(a, b)
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
