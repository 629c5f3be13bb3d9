"""Multi-document RAG prompts on the shipped model's synthetic records, for CacheClip (docs/cacheclip.md).

Notes: docs/modules.md (`kvjax/tasks/rag_records.py`)."""

from __future__ import annotations

import numpy as np

from kvjax.tasks import synthetic

SYSTEM_PREFIX = "read the context document below and answer the question ."
RECORD_LEN = len(synthetic.record_words("key", "1234"))  # key, 4 digits, "."


def _filler_ending_at_sentence_end(rng, n: int) -> list[str]:
    """`n` filler words continuing the cycle so that they end with a sentence's '.' (records follow a '.',
    as in training); they may start mid-sentence."""
    ends = [i for i, w in enumerate(synthetic.FILLER_WORDS) if w == "."]
    end = int(rng.choice(ends))
    offset = (end + 1 - n) % len(synthetic.FILLER_WORDS)
    return synthetic.filler_words(n, offset)


def rag_sample(rng, num_chunks: int, chunk_len: int, num_records: int, straddle: bool):
    """(chunks as word lists, question, answer, start, split): the asked record starts at document token
    `start` and straddles a chunk boundary (split = its tokens before the boundary, 1..5) or lies inside
    one chunk (split = 0)."""
    records = synthetic.multikey_records(rng, num_records)
    words = [synthetic.record_words(k, v) for k, v in records]
    size = RECORD_LEN
    total = num_chunks * chunk_len
    if straddle:
        boundary = chunk_len * int(rng.integers(1, num_chunks))
        split = int(rng.integers(1, size))
        asked_start = boundary - split
    else:
        split, chunk = 0, int(rng.integers(num_chunks))
        asked_start = chunk * chunk_len + int(rng.integers(16, chunk_len - size - 16))
    starts = [asked_start]
    while len(starts) < num_records:  # the others anywhere, at least 12 tokens from each other
        start = int(rng.integers(12, total - size))
        if all(abs(start - s) >= size + 12 for s in starts):
            starts.append(start)
    order = np.argsort(starts)
    doc, cursor = [], 0
    for i in order:
        doc += _filler_ending_at_sentence_end(rng, starts[i] - cursor) + words[i]
        cursor = starts[i] + size
    doc += synthetic.filler_words(total - cursor)
    chunks = [doc[c * chunk_len : (c + 1) * chunk_len] for c in range(num_chunks)]
    key, value = records[0]
    return chunks, synthetic.MULTIKEY_QUESTION.format(key=key), value, asked_start, split


def encode_words(tokenizer, words, bos: bool = False) -> np.ndarray:
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    if len(ids) != len(words):
        raise ValueError(f"expected one token per word (the shipped word-level tokenizer), got {len(ids)} for {len(words)}")
    return np.asarray(([tokenizer.bos_token_id] if bos else []) + ids, np.int32)


def rag_prompt(tokenizer, rng, num_chunks: int, chunk_len: int, num_records: int, straddle: bool):
    """One request as token ids: `(prefix, chunks, question, meta)`; meta holds the answer, the split and
    the slots (in the assembled context: prefix, then the chunks) of the asked record's tokens after the
    chunk boundary (None inside a chunk)."""
    prefix = encode_words(tokenizer, SYSTEM_PREFIX.split(), bos=True)
    chunks, question, value, start, split = rag_sample(rng, num_chunks, chunk_len, num_records, straddle)
    after = len(prefix) + np.arange(start + split, start + RECORD_LEN) if split else None
    meta = {"answer": value, "split": split, "after_boundary": after}
    return prefix, [encode_words(tokenizer, c) for c in chunks], encode_words(tokenizer, question.split()), meta
