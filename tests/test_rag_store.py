"""The chunk store: content-hash keys, one encoding per chunk, and chunks from another model or tokenizer
rejected with a clear error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax.rag import AuxScorer, ChunkMismatchError, ChunkStore, assemble, rag_prefill
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
    assert not np.allclose(np.asarray(other.v[1]), np.asarray(first[0].v[1]))
    assert store.prefix(prefix).start == 0 and first[0].start == len(prefix)


def test_a_byte_budget_evicts_the_least_recently_used_chunks(model):
    prefix, chunks, _ = request(2, num_chunks=3, chunk_len=8)
    size = ChunkStore(model).chunks(prefix, chunks[:1])[0]
    one = size.k.nbytes + size.v.nbytes + size.tokens.nbytes
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
    with pytest.raises(ValueError, match="query_tokens is empty"):
        assemble(model, ChunkStore(model), prefix, chunks, [])
    with pytest.raises(ValueError, match="unknown RAG method 'blend'"):
        rag_prefill(model, ChunkStore(model), prefix, chunks, query, "blend")
