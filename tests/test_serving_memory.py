"""What the batch engine's pages hold (`kvjax.serving.memory`), sampled between dispatches, against the
definitions: full attention keeps every token seen in every layer and head, a row holds ceil(kept / page)
pages per head, prefix pages shared by live rows count once, a compressing policy holds less than uniform
paging would, and a page table shared by a layer's heads (Jenga's groups) holds at least what single-head
pages hold."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from _sharding_worker import VOCAB, tiny_model
from kvjax.serving.batch_engine import BatchEngine
from kvjax.serving.memory import grouped_slots, uniform_slots, waste

PAGE, CAPACITY, CHUNK = 8, 128, 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _engine(model, **kw):
    return BatchEngine(model, max_rows=2, capacity=CAPACITY, page_size=PAGE, chunk_size=CHUNK, steps_per_dispatch=4,
                       memory_every=1, **kw)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def _row_pages_slots(sample):
    return sum(int((-(-kept // PAGE) * PAGE).sum()) for kept in sample.kept)


def test_full_attention_keeps_every_token_seen(model):
    engine = _engine(model)
    engine.submit(_prompt(21, 0), 10, eos_token_id=-1)
    engine.run()
    assert len(engine.memory_samples) == engine.dispatches >= 2
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    for sample in engine.memory_samples:
        (seen,) = sample.seen_tokens
        (kept,) = sample.kept
        assert kept.shape == (L, H) and (kept == seen).all()
        assert sample.kept_slots == sample.row_kept_slots == seen * L * H
        assert sample.held_slots == -(-seen // PAGE) * PAGE * L * H == _row_pages_slots(sample)
        # with one group of every layer and full attention, every scheme holds the same pages
        assert uniform_slots(sample, PAGE) == grouped_slots(sample, PAGE) == sample.held_slots
    assert [s.seen_tokens[0] for s in engine.memory_samples][:2] == [25, 29]  # 21 prompt + 4 a dispatch


def test_shared_prefix_pages_count_once(model):
    engine = _engine(model)
    prefix = _prompt(2 * CHUNK, 1)
    engine.submit(prefix + _prompt(5, 2), 12, eos_token_id=-1)
    engine.submit(prefix + _prompt(7, 3), 12, eos_token_id=-1)
    engine.run()
    assert engine.shared_pages > 0
    both = [s for s in engine.memory_samples if len(s.seen_tokens) == 2]
    assert both
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    shared = 2 * CHUNK * L * H  # the prefix's whole pages, held once
    for sample in both:
        assert sample.row_held_slots - sample.held_slots == shared
        assert sample.row_kept_slots - sample.kept_slots == shared


@pytest.mark.parametrize("name", ["snapkv", "ada_snapkv"])
def test_compression_holds_less_than_uniform_paging(model, name):
    engine = _engine(model)
    policy = kvjax.make_policy(name, token_budget=24, window=8)
    engine.submit(_prompt(60, 4), 9, policy, eos_token_id=-1)
    engine.run()
    for sample in engine.memory_samples:
        (seen,) = sample.seen_tokens
        (kept,) = sample.kept
        assert (kept < seen).any()
        assert sample.held_slots == _row_pages_slots(sample)  # ceil(kept / page) pages per head, no more
        assert sample.kept_slots <= int(kept.sum())  # a slot freed by eviction is below a length, not a token
        assert grouped_slots(sample, PAGE) >= sample.held_slots
        assert uniform_slots(sample, PAGE) > grouped_slots(sample, PAGE)
        assert waste(sample.held_slots, sample.kept_slots) < waste(uniform_slots(sample, PAGE), sample.kept_slots)
    if name == "ada_snapkv":  # per-head budgets differ: a page table shared by a layer's heads holds more
        assert any(grouped_slots(s, PAGE) > s.held_slots for s in engine.memory_samples)


def test_memory_sampling_is_off_by_default_and_checked(model):
    engine = BatchEngine(model, max_rows=1, capacity=CAPACITY, page_size=PAGE, chunk_size=CHUNK)
    engine.submit(_prompt(10, 5), 3, eos_token_id=-1)
    engine.run()
    assert engine.memory_samples == []
    with pytest.raises(ValueError, match="memory_every"):
        BatchEngine(model, memory_every=-1)
