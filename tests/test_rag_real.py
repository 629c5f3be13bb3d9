"""Cross-chunk RAG requests in real text (`kvjax.tasks.rag_real`): every kind puts its facts where it says,
chunks keep their length, `after_boundary` names the asked fact's tokens after the cut, and a seed gives
the same requests. Uses test_real_tasks' corpus and small trained BPE (no download)."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.tasks import rag_real
from test_real_tasks import corpus, tokenizer  # noqa: F401  (fixtures)

CHUNKS, CHUNK_LEN = 4, 96


def _requests(tokenizer, corpus, kind, seed=0, n=3):
    return rag_real.rag_requests(tokenizer, kind, n, seed, num_chunks=CHUNKS, chunk_len=CHUNK_LEN, corpus=corpus)


def _text(tokenizer, ids) -> str:
    return tokenizer.decode([int(t) for t in ids])


@pytest.mark.parametrize("kind", rag_real.KINDS)
def test_every_kind_places_its_facts(tokenizer, corpus, kind):
    for r in _requests(tokenizer, corpus, kind):
        assert [len(c) for c in r.chunks] == [CHUNK_LEN] * CHUNKS
        fact = f"The secret code of {r.name} is {r.answer}."
        texts = [_text(tokenizer, c) for c in r.chunks]
        joined = _text(tokenizer, np.concatenate(r.chunks))
        assert len(r.answer) == 7 and r.correct(f"it is {r.answer}.") and not r.correct("1234567"[:6])
        assert r.name in _text(tokenizer, r.query) and "documents" in _text(tokenizer, r.prefix)
        if kind == "inside":
            assert sum(fact in t for t in texts) == 1 and r.after_boundary is None
        elif kind == "two_hop":
            locker = [t for t in texts if f"{r.name} left the code in locker" in t]
            assert len(locker) == 1 and r.after_boundary is None
            number = locker[0].split(f"{r.name} left the code in locker ")[1].split(".")[0]
            holder = [i for i, t in enumerate(texts) if f"Locker {number} holds the code {r.answer}." in t]
            assert len(holder) == 1 and holder[0] > texts.index(locker[0])  # the second hop comes later
        else:  # the fact crosses exactly one boundary, and after_boundary are its tokens after it
            assert fact in joined and not any(fact in t for t in texts)
            slots = r.after_boundary - len(r.prefix)
            c = slots[0] // CHUNK_LEN
            assert slots[0] == c * CHUNK_LEN and list(slots) == list(range(slots[0], slots[0] + len(slots)))
            tail = _text(tokenizer, r.chunks[c][: len(slots)])
            assert fact.endswith(tail.strip()) and fact in _text(tokenizer, np.concatenate(r.chunks[c - 1 : c + 1]))
            if kind == "split":
                assert tail.strip() == f"{r.answer}."  # the value, and only it, after the boundary


def test_a_seed_gives_the_same_requests(tokenizer, corpus):
    a, b = _requests(tokenizer, corpus, "straddle", seed=3), _requests(tokenizer, corpus, "straddle", seed=3)
    assert all(np.array_equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra.chunks, rb.chunks))
    assert [r.answer for r in a] == [r.answer for r in b]
    assert [r.answer for r in _requests(tokenizer, corpus, "straddle", seed=4)] != [r.answer for r in a]


def test_bad_settings_name_themselves(tokenizer, corpus):
    with pytest.raises(ValueError, match="unknown kind"):
        rag_real.rag_requests(tokenizer, "sideways", 1, 0, corpus=corpus)
    with pytest.raises(ValueError, match="num_chunks"):
        rag_real.rag_requests(tokenizer, "straddle", 1, 0, num_chunks=1, corpus=corpus)
    with pytest.raises(ValueError, match="no room"):
        rag_real.rag_requests(tokenizer, "two_hop", 1, 0, num_chunks=2, chunk_len=8, corpus=corpus)


def test_queries_of_a_kind_share_one_length(tokenizer, corpus):
    for kind in ("straddle", "two_hop"):
        lengths = {len(r.query) for r in _requests(tokenizer, corpus, kind, n=6)}
        assert len(lengths) == 1, lengths  # one compile per kind in the RAG pipeline
