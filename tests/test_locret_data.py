"""The offline LongAlpaca-format recipe on real text (kvjax.tasks.longalpaca.real_text_rows), its file writer
(train/locret_data.py) and the reader the trainer uses (kvjax.locret.data), with the small byte-level BPE
and prose corpus of test_real_tasks (no model, no download)."""

from __future__ import annotations

import json
import os
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.locret import load_heads
from kvjax.locret.data import build_examples
from kvjax.tasks import longalpaca as la
from kvjax.train import locret_data
from test_real_tasks import corpus, tokenizer  # noqa: F401  (fixtures)

LENGTHS = (256, 512)


def _document(row) -> str:
    instruction = row["instruction"]
    assert instruction.startswith(la.PREAMBLE + "\nThe text begins.\n")
    return instruction[len(la.PREAMBLE + "\nThe text begins.\n") : instruction.index("\nNow the text ends.\n")]


def _quote(row) -> str:
    return re.search(r'"(.*)"', row["instruction"].rsplit("\nNow the text ends.\n", 1)[1]).group(1)


@pytest.fixture(scope="module")
def rows(tokenizer, corpus):
    return la.real_text_rows(tokenizer, 8, LENGTHS, seed=3, corpus=corpus)


def test_rows_are_seeded_and_independent_of_their_number(tokenizer, corpus, rows):
    assert la.real_text_rows(tokenizer, 8, LENGTHS, seed=3, corpus=corpus) == rows
    assert la.real_text_rows(tokenizer, 3, LENGTHS, seed=3, corpus=corpus) == rows[:3]  # row i seeded by (seed, i)
    other = la.real_text_rows(tokenizer, 8, LENGTHS, seed=4, corpus=corpus)
    assert [r["window_start"] for r in other] != [r["window_start"] for r in rows]


def test_answers_are_spans_of_a_document_of_the_asked_length(tokenizer, rows):
    assert [r["kind"] for r in rows] == ["continue", "next"] * 4
    for i, row in enumerate(rows):
        document, quote, answer = _document(row), _quote(row), row["output"]
        assert row["length"] == LENGTHS[i % 2]
        n = len(tokenizer(document, add_special_tokens=False)["input_ids"])
        assert abs(n - row["length"]) <= 0.02 * row["length"], (n, row["length"])
        assert document.count(quote) == 1 and answer in document
        assert 8 <= len(tokenizer(answer, add_special_tokens=False)["input_ids"]) <= 64 + 2
        # continue: the answer goes on from the quote; next: it is the sentence after the quoted one
        assert re.search(re.escape(quote) + r"\s*" + re.escape(answer), document), (quote, answer)
        if row["kind"] == "next":
            assert quote[-1] in ".!?" and answer[0].isupper()


def test_bad_recipe_arguments_name_the_field(tokenizer, corpus):
    with pytest.raises(ValueError, match="kinds must be"):
        la.real_text_row(tokenizer, 0, 256, kinds=("needle",), corpus=corpus)
    with pytest.raises(ValueError, match="min_answer"):
        la.real_text_row(tokenizer, 0, 256, corpus=corpus, min_answer=9, max_answer=8)
    with pytest.raises(ValueError, match="no 'continue' question found"):
        la.real_text_row(tokenizer, 0, 256, corpus=corpus, min_answer=400, max_answer=400)


def test_needle_rows_are_the_needle_tasks_seeded_per_row(tokenizer, corpus, tmp_path, monkeypatch):
    rows = la.needle_rows(tokenizer, 4, LENGTHS, seed=7, corpus=corpus)
    assert la.needle_rows(tokenizer, 2, LENGTHS, seed=7, corpus=corpus) == rows[:2]  # row i seeded by (seed, i)
    assert [r["kind"] for r in rows] == ["niah_multikey", "niah_multivalue"] * 2
    for i, row in enumerate(rows):
        values = row["output"].split(", ")
        assert len(values) == (4 if row["kind"] == "niah_multivalue" else 1)
        for value in values:  # every asked value is in the prompt, in its needle sentence
            assert re.search(r"One of the special magic numbers for [\w-]+ is: " + value, row["instruction"])
        assert row["instruction"].rstrip().endswith("mentioned in the provided text?")  # the question, no answer
        n = len(tokenizer(row["instruction"], add_special_tokens=False)["input_ids"])
        assert abs(n - LENGTHS[i % 2]) <= 0.02 * LENGTHS[i % 2], (n, row["length"])
    with pytest.raises(ValueError, match="tasks must be"):
        la.needle_row(tokenizer, 0, 256, tasks=("needle",), corpus=corpus)
    book = tmp_path / "book.txt"
    book.write_text(corpus.text)
    import kvjax

    monkeypatch.setattr(kvjax, "load_model", lambda name: types.SimpleNamespace(tokenizer=tokenizer))
    out = str(tmp_path / "needles.jsonl")
    locret_data.main(["--recipe", "needles", "--model", "any", "--out", out, "--rows", "4", "--lengths", "256",
                      "512", "--seed", "7", "--corpus", str(book), "--no-progress"])
    with open(out) as f:
        assert [json.loads(line) for line in f] == la.needle_rows(tokenizer, 4, LENGTHS, seed=7, corpus=la.real_text.load_corpus(str(book)))


def test_file_writer_and_trainer_reader(tokenizer, corpus, rows, tmp_path, monkeypatch):
    book = tmp_path / "book.txt"
    book.write_text(corpus.text)
    import kvjax

    monkeypatch.setattr(kvjax, "load_model", lambda name: types.SimpleNamespace(tokenizer=tokenizer))
    out = str(tmp_path / "rows.jsonl")
    assert locret_data.main(["--model", "any", "--out", out, "--rows", "4", "--lengths", "256", "--seed", "1",
                             "--corpus", str(book), "--no-progress"]) == out
    with open(out) as f:
        written = [json.loads(line) for line in f]
    assert len(written) == 4 and written == la.real_text_rows(tokenizer, 4, (256,), seed=1, corpus=corpus)
    examples, skipped = build_examples(out, tokenizer, max_length=1024, max_answer=64, progress=False)
    assert not skipped and len(examples) == 4
    assert [e.answer.tolist() for e in examples] == [tokenizer(r["output"], add_special_tokens=False)["input_ids"] for r in written]
    in_memory, _ = build_examples(rows, tokenizer, max_length=1024, max_answer=64, progress=False)  # rows, not a file
    assert len(in_memory) == len(rows)


def test_trainer_builds_the_recipe_in_memory(tokenizer, corpus, tmp_path, monkeypatch):
    """`kvjax train locret --data kvjax:real-text`: rows from the model's tokenizer, a short run, bf16 export."""
    import kvjax
    from kvjax.models.config import ModelConfig
    from kvjax.models.loading import Model, init_params
    from kvjax.train import locret as train_locret

    cfg = ModelConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
    ))
    model = Model(cfg, init_params(cfg, seed=0), tokenizer=tokenizer)
    monkeypatch.setattr(kvjax, "load_model", lambda name, dtype="float32": model)
    # the recipe's default corpus is Debian's licences: the fixture's prose instead, which the small BPE knows
    monkeypatch.setattr(la.real_text, "load_corpus", lambda path=None, min_chars=0: corpus)
    out = str(tmp_path / "run")
    summary = train_locret.main(["--model", "random", "--data", "kvjax:real-text", "--data-rows", "3", "--data-lengths",
                                 "128", "--steps", "2", "--warmup", "1", "--chunk-size", "64", "--max-length", "512", "--max-answer", "64",
                                 "--hidden", "8", "--save-every", "2", "--out", out, "--no-progress"])
    assert summary["examples"] == 3 and not summary["skipped"] and np.isfinite(summary["final_loss"])
    exported = load_heads(os.path.join(out, "heads.safetensors"))
    assert exported.layer(0)["w1"].dtype == jnp.bfloat16 and exported.config.hidden_size == 8
