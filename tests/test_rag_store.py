"""The chunk store: content-hash keys, one encoding per chunk, and chunks from another model or tokenizer
rejected with a clear error."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache.state import KVState
from kvjax.rag import AuxScorer, ChunkMismatchError, ChunkStore, assemble, rag_prefill
from kvjax.rag.cache_state import kv_from_state, state_from_kv
from rag_helpers import random_model, request, rope_config, word_tokenizer

WORDS = ["<unk>"] + [f"w{i}" for i in range(96)]


@pytest.fixture(scope="module")
def model():
    return random_model(rope_config("default"), tokenizer=word_tokenizer(WORDS))


def test_chunks_are_encoded_once_and_keyed_by_content(model):
    prefix, chunks, query = request(0, num_chunks=2, chunk_len=8)
    store = ChunkStore(model)
    first = store.chunks(prefix, [chunks[0], chunks[1], chunks[0]])
    assert len(store) == 2 and store.misses == 2 and store.hits == 1
    assert first[0] is first[2] and first[0].key != first[1].key
    again = store.chunks(prefix, chunks)
    assert again[0] is first[0] and store.hits == 3
    # the same tokens after another prefix are another chunk cache (its K/V differ)
    other = store.chunks(prefix[:-1], chunks[:1])[0]
    assert other.key != first[0].key
    assert not np.allclose(np.asarray(other.kv()[1][1]), np.asarray(first[0].kv()[1][1]))
    assert store.prefix(prefix).start == 0 and first[0].start == len(prefix)


def test_kv_from_state_reads_back_exactly_what_state_from_kv_wrote(model):
    cfg = model.cfg
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, 2, 13, cfg.num_kv_heads, cfg.head_dim)  # 13 slots: the last page part-filled
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    state = state_from_kv(cfg, k, v, np.arange(13)[None].repeat(2, 0) + 5, capacity=13, page_size=4)
    assert state.num_pages == cfg.num_layers * 2 * cfg.num_kv_heads * 4  # 4 pages of 4 hold 13 slots: no spare
    k_back, v_back = kv_from_state(state, 13)
    np.testing.assert_array_equal(np.asarray(k_back), k)
    np.testing.assert_array_equal(np.asarray(v_back), v)


def test_a_chunk_cache_is_a_paged_state_equal_to_the_prefill_of_its_prompt(model):
    """The rotated form holds what `kvjax.prefill` of prefix + chunk holds at the chunk's slots; the
    pre-RoPE form the same values and the keys before rotation, at the same positions."""
    prefix, chunks, _ = request(4, num_chunks=1, chunk_len=11)
    P, T = len(prefix), len(chunks[0])
    rotated = ChunkStore(model, form="rotated").chunks(prefix, chunks)[0]
    pre_rope = ChunkStore(model).chunks(prefix, chunks)[0]
    assert isinstance(rotated.state, KVState) and rotated.state.page_table.shape[1] == 1
    np.testing.assert_array_equal(np.asarray(rotated.state.next_position), [P + T])
    state, _ = kvjax.prefill(model, [np.concatenate([prefix, chunks[0]])], capacity=P + T)
    k_full, v_full = kv_from_state(state, P + T)  # [L, 1, P + T, H, D]
    k, v = rotated.kv()  # [L, T, H, D]
    np.testing.assert_allclose(np.asarray(k), np.asarray(k_full[:, 0, P:]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(v), np.asarray(v_full[:, 0, P:]), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(pre_rope.kv()[1]), np.asarray(v))
    assert not np.allclose(np.asarray(pre_rope.kv()[0]), np.asarray(k))  # keys before RoPE
    assert rotated.nbytes == sum(x.nbytes for x in jax.tree.leaves(rotated.state)) + rotated.tokens.nbytes


def test_a_byte_budget_evicts_the_least_recently_used_chunks(model):
    prefix, chunks, _ = request(2, num_chunks=3, chunk_len=8)
    size = ChunkStore(model).chunks(prefix, chunks[:1])[0]
    one = size.nbytes
    store = ChunkStore(model, max_bytes=2 * one)
    first = store.chunks(prefix, chunks)  # three chunks into room for two: every one returned all the same
    assert len(first) == 3 and len(store) == 2 and store.lru.bytes <= 2 * one
    assert store.get(first[0].key) is None and store.get(first[2].key) is first[2]
    store.chunks(prefix, chunks[:1])  # encoded again: it was the coldest
    assert store.misses == 4 and store.get(first[1].key) is None  # ... and pushed out the next coldest


def test_chunks_share_the_batch_engines_budget_with_prefix_carries(model):
    from kvjax.serving.batch_engine import BatchEngine

    engine = BatchEngine(model, max_rows=1, capacity=64, page_size=8, chunk_size=16, prefix_cache_bytes=1 << 30)
    store = ChunkStore(model, lru=engine.cache)
    prefix, chunks, _ = request(3, num_chunks=2, chunk_len=8)
    store.chunks(prefix, chunks)
    engine.submit(list(range(1, 40)), 2, eos_token_id=-1)
    engine.run()
    assert len(store) == 2 and len(engine.prefix) == 2  # 39 tokens: carries after 16 and 32
    assert engine.cache.bytes == store.lru.bytes == sum(engine.cache.size_of(k) for k in engine.cache.keys())
    with pytest.raises(ValueError, match="not both"):
        ChunkStore(model, max_bytes=1, lru=engine.cache)


def test_chunks_from_another_model_are_rejected(model):
    prefix, chunks, query = request(1, num_chunks=2, chunk_len=8)
    other = random_model(rope_config("default"), seed=5, tokenizer=model.tokenizer)
    with pytest.raises(ChunkMismatchError, match="another model"):
        assemble(other, ChunkStore(model), prefix, chunks, query)
    foreign = ChunkStore(other).chunks(prefix, chunks[:1])[0]
    with pytest.raises(ChunkMismatchError, match="another model"):
        ChunkStore(model).put(foreign)


def test_chunks_from_another_tokenizer_are_rejected(model):
    prefix, chunks, query = request(2, num_chunks=2, chunk_len=8)
    retokenized = dataclasses.replace(model, tokenizer=word_tokenizer(WORDS[:1] + WORDS[:0:-1]))
    with pytest.raises(ChunkMismatchError, match="another tokenizer") as error:
        assemble(retokenized, ChunkStore(model), prefix, chunks, query)
    assert "another model" not in str(error.value)  # same weights: only the tokenizer is named
    with pytest.raises(ChunkMismatchError, match="auxiliary model.*another tokenizer"):
        rag_prefill(model, ChunkStore(model), prefix, chunks, query, "cacheclip",
                    aux=AuxScorer(retokenized), aux_store=ChunkStore(retokenized))


def test_bad_inputs_name_themselves(model):
    prefix, chunks, query = request(3, num_chunks=1, chunk_len=8)
    with pytest.raises(ValueError, match="form"):
        ChunkStore(model, form="rope")
    with pytest.raises(ValueError, match="chunk 1"):
        ChunkStore(model).chunks(prefix, [chunks[0], []])
    vocab = model.cfg.vocab_size  # an id past the vocabulary would embed as NaN: refused, not cached
    with pytest.raises(ValueError, match=rf"chunk 1 has token id {vocab} at position 2 outside the vocabulary"):
        ChunkStore(model).chunks(prefix, [chunks[0], [1, 2, vocab]])
    with pytest.raises(ValueError, match="prefix_tokens has token id -1"):
        ChunkStore(model).prefix([-1, 2])
    with pytest.raises(ValueError, match=rf"query_tokens has token id {vocab + 3}"):
        assemble(model, ChunkStore(model), prefix, chunks, [vocab + 3])
    with pytest.raises(ValueError, match="query_tokens is empty"):
        assemble(model, ChunkStore(model), prefix, chunks, [])
    with pytest.raises(ValueError, match="unknown RAG method 'blend'"):
        rag_prefill(model, ChunkStore(model), prefix, chunks, query, "blend")
