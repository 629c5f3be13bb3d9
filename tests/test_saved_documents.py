"""A saved document served to concurrent questions (kvjax.serving.saved_documents, `BatchEngine.submit_question`):
the rows read one copy of the document's whole pages, copy only the pages they write, pin it in the LRU while
they read it and free it after; a decode-time evictor's layers stay private."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.engine.saved_state import generate_from_state, load_state, save_state
from kvjax.jenga import FullAttentionSpec, JengaAllocator
from kvjax.serving.batch_engine import BatchEngine
from kvjax.serving.saved_documents import SavedDocuments
from kvjax.util.lru import BytesLRU

PAGE = 8
DOC = np.random.default_rng(48).integers(3, 120, 90).tolist()  # 11 whole pages and 2 slots of a 12th
QUESTIONS = [[7, 19, 33, 5, 61], [44, 2, 90]]
NEW = 6
ENGINE = dict(max_rows=2, capacity=256, page_size=PAGE, chunk_size=32, steps_per_dispatch=4)
PAGE_FIELDS = ("k_pages", "v_pages", "kmin", "kmax", "slot_pos", "slot_score")


@pytest.fixture(scope="module")
def tiny():
    return kvjax.load_model("tiny")


def _saved(model, policy, folder):
    """The document prefilled with room for the longest question and the answer, saved as `folder/doc`."""
    room = max(map(len, QUESTIONS)) + NEW
    state, logits = kvjax.prefill(model, [DOC], policy, page_size=PAGE, max_new_tokens=room)
    save_state(state, folder / "doc", model=model, policy=policy, logits=logits, model_name="tiny")
    return load_state(folder / "doc", model)


def _alone(model, folder) -> list[list[int]]:
    """Each question's answer from an engine serving it alone."""
    answers = []
    for question in QUESTIONS:
        engine = BatchEngine(model, **ENGINE)
        rid = SavedDocuments(folder, model, engine.cache, PAGE).submit(engine, "doc", question, NEW, eos_token_id=[])
        answers.append(engine.run()[rid].tokens)
    return answers


def _together(model, folder):
    """Both questions submitted at once to one engine: after its first step (both rows placed and fed), the
    batch, the engine and the documents; then run to the end. Returns (batch, engine, documents, tokens)."""
    engine = BatchEngine(model, **ENGINE)
    documents = SavedDocuments(folder, model, engine.cache, PAGE)
    ids = [documents.submit(engine, "doc", q, NEW, eos_token_id=[]) for q in QUESTIONS]
    engine.step()
    (batch,) = engine.batches.values()
    return batch, engine, documents, ids


def _shared_pages(batch, saved) -> tuple[np.ndarray, np.ndarray]:
    """(bool[L, H, P]: the logical pages where both rows' tables hold the same device page; those device
    pages, and the saved state's pages at the same logical pages, `int32[S]` each)."""
    first, second = batch.tables[:, 0], batch.tables[:, 1]
    shared = (first >= 0) & (first == second)
    table = np.asarray(saved.state.page_table)[:, 0]  # [L, H, P'], P' <= the batch's P
    assert not shared[..., table.shape[-1]:].any()
    mask = shared[..., : table.shape[-1]]
    return shared, np.stack([first[..., : table.shape[-1]][mask], table[mask]])


def _pages_equal(batch, saved, pages) -> bool:
    """Whether the batch pool's `pages[0]` hold what the saved state's `pages[1]` hold (K/V, min/max,
    positions, scores)."""
    return all(np.array_equal(np.asarray(getattr(batch.state, f))[pages[0]], np.asarray(getattr(saved.state, f))[pages[1]])
               for f in PAGE_FIELDS)


def test_concurrent_questions_read_one_copy_of_the_document(tiny, tmp_path):
    policy = kvjax.make_policy("quest", token_budget=32, dense_layers=1)  # selects by page min/max, never rewrites
    saved = _saved(tiny, policy, tmp_path)
    expected = [generate_from_state(tiny, saved, q, NEW, eos_token_id=[])[0].tolist() for q in QUESTIONS]
    alone = _alone(tiny, tmp_path)
    batch, engine, documents, ids = _together(tiny, tmp_path)

    shared, pages = _shared_pages(batch, saved)
    whole = np.asarray(saved.state.lengths)[:, 0] // PAGE  # [L, H] each head's whole pages
    # every whole page of every head, and nothing else, is one device page both rows' tables point at
    np.testing.assert_array_equal(shared, np.arange(shared.shape[-1]) < whole[..., None])
    assert _pages_equal(batch, saved, pages)
    assert engine.shared_pages == whole.sum()  # the second row's: the first copied the document in
    held = [set(batch.tables[:, row][batch.tables[:, row] >= 0].tolist()) for row in (0, 1)]
    # the pool holds the document's whole pages once, and each row's own pages (partial last page and growth)
    assert batch.pool.live_pages() == len(held[0] | held[1]) == whole.sum() + sum(len(h) - whole.sum() for h in held)

    key, filler = ("saved_document", "doc"), ("filler",)
    engine.cache.put(filler, None, engine.cache.max_bytes)  # pushes out the least recently used unpinned entry
    assert list(engine.cache.keys()) == [key]  # the document pinned while the rows read it: the filler went
    done = engine.run()
    assert [done[rid].tokens for rid in ids] == alone == expected
    kept = engine.cache.get(key)  # the LRU's state, read by both rows: still whole and as loaded
    assert not kept.once and all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(kept.state), jax.tree.leaves(saved.state)))
    engine.cache.put(filler, None, engine.cache.max_bytes)
    assert list(engine.cache.keys()) == [filler]  # unpinned once both finished
    assert engine.leaked_pages == 0 and batch.pool.live_pages() == 0 and not batch.documents
    assert (documents.stats.loads, documents.stats.lookups) == (1, 2)
    with pytest.raises(ValueError, match="needs a question"):
        engine.submit_question(saved.state, None, [], NEW, policy, document="doc")
    with pytest.raises(ValueError, match="capacity of 256"):
        engine.submit_question(saved.state, saved.logits, [5] * 200, NEW, policy, document="doc")


def test_a_decode_time_evictor_reads_its_compressed_layers_from_its_own_pages(tiny, tmp_path):
    # H2O adds every step's attention to its slots' scores and evicts a slot a step in its compressed layers
    policy = kvjax.make_policy("h2o", token_budget=32, dense_layers=1)
    saved = _saved(tiny, policy, tmp_path)
    alone = _alone(tiny, tmp_path)  # the engine's saved-state answers equal generate_from_state's: the test above
    batch, engine, _, ids = _together(tiny, tmp_path)
    shared, pages = _shared_pages(batch, saved)
    whole = np.asarray(saved.state.lengths)[:, 0] // PAGE
    assert (shared[0].sum(axis=-1) == whole[0]).all() and not shared[1:].any()  # the dense layer alone is shared
    done = engine.run()
    assert [done[rid].tokens for rid in ids] == alone  # neither row's evictions reached the other
    assert _pages_equal(batch, saved, pages)  # the shared pages as saved after both answers
    assert engine.leaked_pages == 0 and batch.pool.live_pages() == 0


def test_shared_pages_are_refcounted_and_pins_hold_entries():
    alloc = JengaAllocator([FullAttentionSpec(name="full", tokens_per_page=4, num_layers=1, num_kv_heads=1,
                                              head_dim=1, dtype="float32")], 8 * 4 * 8 * 2)
    pages = alloc.reserve("first", {"full": 3}).new_pages["full"]
    alloc.share("second", {"full": pages[:2]})
    alloc.reserve("second", {"full": 3})  # its third page is its own
    assert alloc.block_tables("second")["full"][:2] == pages[:2]
    assert alloc.block_tables("second")["full"][2] not in pages
    alloc.free("first")
    assert [alloc.page_refcount("full", p) for p in pages] == [1, 1, 0]  # still read by the second
    with pytest.raises(ValueError, match="not held by a live request"):
        alloc.share("third", {"full": pages[2:]})
    alloc.free("second")
    assert sum(alloc.num_live_pages().values()) == 0

    lru = BytesLRU(10)
    lru.put("doc", "pages", 6)
    assert lru.pin("doc") and lru.pin("doc") and not lru.pin("absent")
    lru.put("other", "pages", 6)  # over the budget: the one unpinned entry goes, newest or not
    assert list(lru.keys()) == ["doc"]
    lru.unpin("doc")
    lru.put("other", "pages", 6)
    assert list(lru.keys()) == ["doc"]  # one pin left
    lru.unpin("doc")
    lru.put("other", "pages", 6)
    assert list(lru.keys()) == ["other"]
