"""The disk tier under the byte-bounded LRU (kvjax.util.disk_tier): what the memory budget evicts is written
to a directory within a disk budget and comes back equal on a hit, for the batch engine's prefix carries and
RAG's chunk store."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.state import gather_layer
from kvjax.rag import ChunkStore
from kvjax.serving.batch_engine import BatchEngine
from kvjax.serving.prefix_states import PrefixStates
from kvjax.util.disk_tier import DiskTier
from kvjax.util.lru import BytesLRU
from test_batch_engine import CAPACITY, CHUNK, PAGE_SIZE, cases, model  # noqa: F401
from test_prefix_states import _at, _prefill, shared_prompts


def test_evicted_entries_spill_to_disk_within_its_budget_and_come_back(tmp_path):
    disk = DiskTier(2500, tmp_path)
    lru = BytesLRU(1000, disk=disk)
    entries = {i: {"k": jnp.full((250,), i, jnp.float32), "tokens": np.arange(i, dtype=np.int32), "n": i}
               for i in range(4)}
    for i, value in entries.items():
        lru.put(i, value, 1000)
    assert list(lru.keys()) == [3] and sorted(disk.keys()) == [1, 2]  # entry 0 went past the disk budget
    assert disk.bytes == sum(1000 + 4 * i for i in (1, 2)) <= disk.max_bytes and len(os.listdir(tmp_path)) == 2
    back = lru.get(1)  # read back into memory, entry 3 spilled in its place
    assert isinstance(back["k"], jnp.ndarray) and isinstance(back["tokens"], np.ndarray) and back["n"] == 1
    np.testing.assert_array_equal(np.asarray(back["k"]), np.asarray(entries[1]["k"]))
    np.testing.assert_array_equal(back["tokens"], entries[1]["tokens"])
    assert list(lru.keys()) == [1] and 3 in lru and 1 not in disk
    assert lru.get(0) is None
    assert (disk.stats.hits, disk.stats.misses, disk.stats.hit_rate) == (1, 1, 0.5)
    lru.remove_if(lambda key: True)
    assert len(disk) == 0 and not os.listdir(tmp_path)


def test_prefix_carries_spilled_to_disk_resume_a_prefill_as_from_memory(model, cases, tmp_path):
    snapkv = cases["snapkv"].policy
    first, second = shared_prompts(2)
    disk = DiskTier(1 << 30, tmp_path)
    cache = PrefixStates(lru=BytesLRU(1, disk=disk))  # no carry fits memory: each goes to disk
    _prefill(model, first, snapkv, on_chunk=lambda carry: cache.store("k", _at(first), carry))
    assert len(disk) == len(first) // CHUNK and disk.bytes > 0 and len(cache.lru) == 0
    resume = cache.lookup("k", _at(second), len(second))
    assert resume is not None and resume.tokens == 2 * CHUNK and disk.stats.hits == 1
    state, logits = _prefill(model, second, snapkv, resume=resume)
    scratch_state, scratch_logits = _prefill(model, second, snapkv)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(scratch_logits))
    for got, want in zip(gather_layer(state, 1), gather_layer(scratch_state, 1)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_engine_reports_its_disk_tier_and_serves_like_generate(model, cases, tmp_path):
    policy = cases["full"].policy
    rows = shared_prompts(3)
    disk = DiskTier(1 << 30, tmp_path)
    engine = BatchEngine(model, max_rows=1, capacity=CAPACITY, page_size=PAGE_SIZE, chunk_size=CHUNK,
                         steps_per_dispatch=4, prefix_cache_bytes=1, disk_cache=disk)  # every carry to disk
    ids = [engine.submit(r, 4, policy, eos_token_id=-1) for r in rows]
    out = engine.run()
    for rid, row in zip(ids, rows):
        tokens = kvjax.generate(model, [row], 4, policy, page_size=PAGE_SIZE, capacity=CAPACITY, chunk_size=CHUNK,
                                eos_token_id=-1)[0]
        assert out[rid].tokens == tokens.tolist()
    assert engine.cache.disk is disk and disk.stats.hits >= 1 and disk.stats.spilled_bytes > 0
    assert engine.prefix.stats.hit_tokens >= 2 * CHUNK


def test_chunk_store_spills_chunks_to_disk(model, tmp_path):
    rng = np.random.default_rng(3)
    prefix, chunks = rng.integers(0, 90, 8).tolist(), [rng.integers(0, 90, 12).tolist() for _ in range(3)]
    one = ChunkStore(model).chunks(prefix, chunks[:1])[0].nbytes
    store = ChunkStore(model, max_bytes=one, disk=DiskTier(1 << 30, tmp_path))
    first = store.chunks(prefix, chunks)
    assert len(store.lru.disk) == 2
    again = store.chunks(prefix, chunks)
    assert store.hits == 3 and store.lru.disk.stats.hits >= 2
    for a, b in zip(first, again):
        for x, y in zip(a.kv(), b.kv()):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
