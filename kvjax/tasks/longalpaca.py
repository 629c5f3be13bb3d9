"""LongAlpaca-format rows (`{"instruction": document + question, "output": answer}`) built from kvjax's tasks.

Notes: docs/modules.md (`kvjax/tasks/longalpaca.py`)."""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from kvjax.tasks import needles, real_text
from kvjax.tasks.synthetic import digits, multikey_sample

REAL_TEXT_KINDS = ("continue", "next")
MIN_CUE = 6  # tokens of a sentence quoted in a `continue` question, at least
MAX_TRIES = 50
PREAMBLE = "Below is a text. Memorize the text and answer my question after the text."
TEMPLATE = "{preamble}\nThe text begins.\n{document}\nNow the text ends.\n{question}"
QUESTIONS = {
    "continue": 'In the text above, a sentence begins "{quote}". Continue it word for word from there.',
    "next": 'In the text above, which sentence comes right after "{quote}"? Quote it word for word.',
}


def multikey_rows(rng: np.random.Generator, num_rows: int, lengths: tuple[int, ...], num_records: int = 4) -> list[dict]:
    """`num_rows` rows whose documents are about `lengths` tokens long (cycled)."""
    rows = []
    for i in range(num_rows):
        sample = multikey_sample(rng, lengths[i % len(lengths)], num_records)
        rows.append({"instruction": sample.prompt, "output": digits(sample.answer)})
    return rows


def _sentences(window: real_text.Window) -> list[tuple[int, int]]:
    """(start, end) token offsets of the window's whole sentences (the last one ends at the window's end)."""
    bounds = [int(s) for s in window.sentence_starts] + [window.length]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _word_cut(tokenizer, ids: np.ndarray, cut: int, last: int) -> int:
    """The first offset in [cut, last] whose token starts a word (decodes with leading whitespace), so a
    quote ends between words; `cut` when none does (e.g. a tokenizer without word-initial spaces)."""
    for j in range(cut, last + 1):
        if tokenizer.decode([int(ids[j])])[:1].isspace():
            return j
    return cut


def _span_question(tokenizer, window: real_text.Window, document: str, kind: str, rng: np.random.Generator,
                   min_answer: int, max_answer: int) -> tuple[str, str] | None:
    """(question, answer) of one `kind` on `window`, or None when no sentence qualifies."""
    decode = lambda ids: tokenizer.decode([int(t) for t in ids], skip_special_tokens=True).strip()
    sentences = _sentences(window)
    if kind == "continue":
        candidates = [(a, _word_cut(tokenizer, window.ids, a + max(MIN_CUE, (b - a) // 2), b - min_answer), b)
                      for a, b in sentences if b - a >= MIN_CUE + min_answer]
    else:  # next: the quoted sentence, then the one after it as the answer
        candidates = [(a, b, c) for (a, b), (_, c) in zip(sentences[:-1], sentences[1:]) if c - b >= min_answer]
    for j in rng.permutation(len(candidates)):
        start, cut, end = candidates[j]
        quote, answer = decode(window.ids[start:cut]), decode(window.ids[cut : min(end, cut + max_answer)])
        if quote and answer and document.count(quote) == 1 and answer in document:
            return QUESTIONS[kind].format(quote=quote), answer
    return None


def real_text_row(tokenizer, index: int, length: int, seed: int = 0, kinds: Sequence[str] = REAL_TEXT_KINDS,
                  corpus: real_text.Corpus | real_text.TokenizedCorpus | None = None, min_answer: int = 8,
                  max_answer: int = 64) -> dict:
    """Row `index` of the real-text recipe (module docstring): `instruction`, `output`, and the provenance
    fields `kind`, `window_start` and `length` (which LongAlpaca readers ignore)."""
    if not kinds or any(k not in QUESTIONS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {sorted(QUESTIONS)}, got {list(kinds)}")
    if not 1 <= min_answer <= max_answer:
        raise ValueError(f"need 1 <= min_answer <= max_answer, got min_answer={min_answer}, max_answer={max_answer}")
    tc = corpus if isinstance(corpus, real_text.TokenizedCorpus) else real_text.tokenize_corpus(tokenizer, corpus)
    rng = np.random.default_rng([seed, index])
    kind = kinds[index % len(kinds)]
    for _ in range(MAX_TRIES):
        (window,) = real_text.windows(tokenizer, length, 1, rng, tc, disjoint=False)
        document = tokenizer.decode([int(t) for t in window.ids], skip_special_tokens=True)
        found = _span_question(tokenizer, window, document, kind, rng, min_answer, max_answer)
        if found is not None:
            question, answer = found
            instruction = TEMPLATE.format(preamble=PREAMBLE, document=document, question=question)
            return {"instruction": instruction, "output": answer, "kind": kind, "window_start": window.start,
                    "length": length}
    raise ValueError(
        f"no {kind!r} question found in {MAX_TRIES} windows of {length} tokens (sentences of at least "
        f"{MIN_CUE + min_answer} tokens whose quote is unique); pass more text (corpus=) or a smaller min_answer"
    )


def real_text_rows(tokenizer, num_rows: int, lengths: Sequence[int] = (2048,), seed: int = 0,
                   kinds: Sequence[str] = REAL_TEXT_KINDS, corpus: real_text.Corpus | None = None,
                   min_answer: int = 8, max_answer: int = 64, progress: bool = False) -> list[dict]:
    """`num_rows` rows of the real-text recipe, row `i` with a document of `lengths[i % len(lengths)]`
    tokens of `tokenizer` (module docstring). Seeded: the same arguments give the same rows."""
    from tqdm import tqdm

    if num_rows < 0 or not lengths or min(lengths) < 1:
        raise ValueError(f"need num_rows >= 0 and positive lengths, got num_rows={num_rows}, lengths={list(lengths)}")
    tc = real_text.tokenize_corpus(tokenizer, corpus)
    return [
        real_text_row(tokenizer, i, lengths[i % len(lengths)], seed, kinds, tc, min_answer, max_answer)
        for i in tqdm(range(num_rows), desc="real-text rows", unit="row", disable=not progress)
    ]


NEEDLE_TRAINING_TASKS = ("niah_multikey", "niah_multivalue")


def needle_row(tokenizer, index: int, length: int, seed: int = 1000, tasks: Sequence[str] = NEEDLE_TRAINING_TASKS,
               corpus: real_text.Corpus | real_text.TokenizedCorpus | None = None) -> dict:
    """Row `index` of the needle recipe (module docstring): `instruction`, `output`, and the provenance
    fields `kind` (the task), `depth` and `length`."""
    if not tasks or any(t not in needles.TASKS for t in tasks):
        raise ValueError(f"tasks must be a non-empty subset of {list(needles.TASKS)}, got {list(tasks)}")
    task = tasks[index % len(tasks)]
    (sample,) = needles.make_samples(task, tokenizer, length, 1, np.random.default_rng([seed, index]),
                                     chat=False, answer_prefix=False, corpus=corpus)
    instruction = tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
    return {"instruction": instruction, "output": ", ".join(sample.answers), "kind": task,
            "depth": sample.depth, "length": length}


def needle_rows(tokenizer, num_rows: int, lengths: Sequence[int] = (2048,), seed: int = 1000,
                tasks: Sequence[str] = NEEDLE_TRAINING_TASKS, corpus: real_text.Corpus | None = None,
                progress: bool = False) -> list[dict]:
    """`num_rows` rows of the needle recipe, row `i` a prompt of `lengths[i % len(lengths)]` tokens of
    `tokenizer` (module docstring). Seeded: the same arguments give the same rows."""
    from tqdm import tqdm

    if num_rows < 0 or not lengths or min(lengths) < 1:
        raise ValueError(f"need num_rows >= 0 and positive lengths, got num_rows={num_rows}, lengths={list(lengths)}")
    tc = real_text.tokenize_corpus(tokenizer, corpus)
    return [needle_row(tokenizer, i, lengths[i % len(lengths)], seed, tasks, tc)
            for i in tqdm(range(num_rows), desc="needle rows", unit="row", disable=not progress)]


def write_jsonl(rows: list[dict], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
