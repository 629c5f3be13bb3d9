"""Real-text corpus, filler windows and needle tasks (kvjax.tasks.real_text, kvjax.tasks.needles), with a
small byte-level BPE the test trains, so no model or download is needed."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from kvjax.tasks import needles as nd
from kvjax.tasks import real_text as rt

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ADJ = ("old tired young quiet proud gentle bitter bright patient clever hungry wary lonely merry stern "
       "humble restless careful weary honest").split()
NOUN = ("miller traveller sister doctor sailor captain farmer widow schoolmaster stranger cook merchant "
        "soldier priest weaver shepherd baker clerk fisherman nurse blacksmith poet judge mason carter "
        "innkeeper tailor gardener hunter pilot").split()
VERB = ("walked toward spoke about forgot visited quarrelled over dreamed of painted wrote about watched "
        "mended crossed remembered praised doubted guarded sold").split()
PLACE = ("mill harbour orchard market church lighthouse valley bridge road cottage square chapel meadow "
         "forest quarry garden tavern station river school").split()
CODA = ("before the rain came", "when the evening was still", "and nobody asked why", "though the hour was late",
        "as the bells rang out", "while the children slept", "long after the war", "in the first spring")


def _prose(seed: int, paragraphs: int) -> str:
    """English-like sentences (random enough that de-duplication keeps them), in paragraphs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(int(rng.integers(3, 7))):
            a, n, v, b, p, c = (rng.choice(x) for x in (ADJ, NOUN, VERB, ADJ, PLACE, CODA))
            sentences.append(f"The {a} {n} {v} the {b} {p} {c}" + str(rng.choice([".", ".", ".", "!", "?"])))
        out.append(" ".join(sentences))
    return "\n\n".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> rt.Corpus:
    d = tmp_path_factory.mktemp("prose")
    # hard-wrapped lines, a rule line and a Project Gutenberg header/footer, as a book file has them
    body = _prose(1, 260)
    wrapped = "\n\n".join("\n".join(re.findall(r".{1,70}(?:\s|$)", p)) for p in body.split("\n\n"))
    (d / "book.txt").write_text("Title page\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + wrapped
                                + "\n\n-----------\n\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence\n")
    (d / "second.txt").write_text(_prose(2, 120))
    return rt.load_corpus(d)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    sample = corpus.text[:6000] + " " + " ".join(nd.ADJECTIVES + nd.NOUNS) + " pass key special magic number"
    bpe.train_from_iterator([sample], trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


# ---------------------------------------------------------------------------------------------- corpus


def test_clean_text_cuts_gutenberg_frame_rules_and_joins_wrapped_lines(corpus):
    text = corpus.text
    assert "PROJECT GUTENBERG" not in text and "Title page" not in text and "licence" not in text
    assert "---" not in text
    assert all("\n" not in p for p in text.split("\n\n"))  # one line per paragraph
    assert [d.name for d in corpus.documents] == ["book.txt", "second.txt"]


def test_dedupe_drops_repeated_paragraphs():
    a = "The quick brown fox jumps over the lazy dog near the river bank today."
    b = "An entirely different paragraph about the weather in the northern hills."
    docs = [rt.Document("new", "x", f"{a}\n\n{b}"), rt.Document("old", "y", a.replace("today", "again") + "\n\n" + a)]
    assert rt.dedupe_paragraphs(docs) == [docs[0]]


def test_load_corpus_errors_name_the_input(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        rt.load_corpus(tmp_path / "no-such-dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        rt.load_corpus(tmp_path / "empty")
    with pytest.raises(ValueError, match="min_chars"):
        rt.load_corpus(corpus.sources[0], min_chars=10**9)
    with pytest.raises(FileNotFoundError, match="--corpus DIR.*KVJAX_CORPUS=DIR.*path="):
        rt.common_licenses_corpus(str(tmp_path / "nothing"))


def test_kvjax_corpus_names_a_directory_of_the_users_text(tmp_path, monkeypatch, corpus):
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("The first book's only sentence is long enough to keep. " * 20)
    (books / "notes.bin").write_text("not text")
    monkeypatch.setenv("KVJAX_CORPUS", str(books))
    assert [d.name for d in rt.load_corpus().documents] == ["a.txt"]
    monkeypatch.setenv("KVJAX_CORPUS", str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="KVJAX_CORPUS="):
        rt.load_corpus()
    monkeypatch.delenv("KVJAX_CORPUS")
    monkeypatch.setattr(rt, "COMMON_LICENSES_DIR", str(tmp_path / "no-licences"))
    monkeypatch.setattr(rt.common_licenses_corpus, "__defaults__", (str(tmp_path / "no-licences"),))
    with pytest.raises(FileNotFoundError, match="no real-text corpus.*--corpus DIR"):
        rt.load_corpus()


@pytest.mark.skipif(not os.path.isdir(rt.COMMON_LICENSES_DIR),
                    reason=f"no Debian licence texts in {rt.COMMON_LICENSES_DIR} (the default real-text corpus)")
def test_default_corpus_is_the_deduplicated_licences():
    corpus = rt.load_corpus()
    names = [d.name for d in corpus.documents]
    assert "GPL-3" in names and "GPL" not in names and "LGPL" not in names  # symlinks skipped
    assert names.index("GPL-3") < names.index("GPL-2")  # newest first
    assert corpus.num_chars > 100_000 and rt.load_prose() == corpus.text
    paragraphs = corpus.text.split("\n\n")
    assert len(paragraphs) == len(set(paragraphs))


def test_tokenized_corpus_round_trips_and_marks_sentences(tokenizer, corpus):
    tc = rt.tokenize_corpus(tokenizer, corpus)
    assert tokenizer.decode(tc.ids.tolist()) == corpus.text
    assert tc.ids.tolist() == tokenizer(corpus.text, add_special_tokens=False)["input_ids"]
    assert tc.sentence_starts[0] == 0 and np.all(np.diff(tc.sentence_starts) > 0)
    for s in tc.sentence_starts[1:50]:  # each starts after a sentence end
        before = tokenizer.decode(tc.ids[max(s - 3, 0) : s].tolist()).rstrip()
        assert before.endswith((".", "!", "?")), before
    assert rt.tokenize_corpus(tokenizer, corpus) is tc  # cached


# --------------------------------------------------------------------------------------------- windows


def test_windows_are_distinct_disjoint_sentence_aligned_and_seeded(tokenizer, corpus):
    tc = rt.tokenize_corpus(tokenizer, corpus)
    length, count = 600, tc.num_tokens // 600 - 2
    wins = rt.windows(tokenizer, length, count, 3, corpus)
    starts = sorted(w.start for w in wins)
    assert len(set(starts)) == count and all(w.length == length for w in wins)
    assert all(b - a >= length for a, b in zip(starts, starts[1:]))  # disjoint: no window repeats text
    assert np.mean([w.start in set(tc.sentence_starts.tolist()) for w in wins]) >= 0.8
    for w in wins:
        assert np.array_equal(w.ids, tc.ids[w.start : w.start + length])
        assert np.all(tc.sentence_starts[np.isin(tc.sentence_starts, w.sentence_starts + w.start)] >= w.start)
    again = rt.windows(tokenizer, length, count, np.random.default_rng(3), corpus)
    assert [w.start for w in again] == [w.start for w in wins]
    assert [w.start for w in rt.windows(tokenizer, length, count, 4, corpus)] != [w.start for w in wins]


def test_windows_overlap_only_when_needed_and_error_when_impossible(tokenizer, corpus):
    n = rt.tokenize_corpus(tokenizer, corpus).num_tokens
    wins = rt.windows(tokenizer, n // 3, 12, 0, corpus)  # 12 windows of a third: must overlap, starts distinct
    assert len({w.start for w in wins}) == 12
    with pytest.raises(ValueError, match=r"cannot supply 12 non-overlapping windows of \d+ tokens"):
        rt.windows(tokenizer, n // 3, 12, 0, corpus, disjoint=True)
    with pytest.raises(ValueError, match=f"the corpus \\({n} tokens.*cannot supply 3 distinct windows of {n} tokens"):
        rt.windows(tokenizer, n, 3, 0, corpus)
    with pytest.raises(ValueError, match="length >= 1"):
        rt.windows(tokenizer, 0, 3, 0, corpus)


# ------------------------------------------------------------------------------------------------ tasks


def _find(haystack: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


@pytest.mark.parametrize("task", nd.TASKS)
def test_samples_have_exact_length_needles_at_depth_and_distinct_windows(tokenizer, corpus, task):
    n_tokens, num = 512, 6
    samples = nd.make_samples(task, tokenizer, n_tokens, num, 0, corpus=corpus)
    assert [s.length for s in samples] == [n_tokens] * num
    assert len({s.window_start for s in samples}) == num  # no filler window repeats
    assert [s.requested_depth for s in samples] == pytest.approx(np.linspace(0, 1, num).tolist())
    max_sentence = int(np.diff(rt.tokenize_corpus(tokenizer, corpus).sentence_starts).max())
    for s in samples:
        meta = s.metadata
        assert meta["head_tokens"] + meta["filler_tokens"] + sum(meta["needle_tokens"]) == len(s.context_ids)
        text = tokenizer.decode(s.context_ids)
        if task == "passkey":
            assert text.count(f"The pass key is {s.answer}. Remember it. {s.answer} is the pass key.") == 1
        else:
            for v in s.answers:
                assert text.count(f"One of the special magic numbers for {s.key} is: {v}.") == 1
        # each needle's tokens sit at its reported position; the filler holds no answer outside them
        spans = sorted(zip(s.needle_positions, meta["needle_tokens"]))
        for pos, size in spans:
            assert tokenizer.decode(s.context_ids[pos : pos + size]).strip().startswith(
                "The pass key is" if task == "passkey" else "One of the special magic numbers for")
        filler, last = [], meta["head_tokens"]
        for pos, size in spans:
            filler += s.context_ids[last:pos]
            last = pos + size
        filler += s.context_ids[last:]
        assert len(filler) == meta["filler_tokens"]
        assert all(a not in tokenizer.decode(filler) for a in s.answers)
        # the asked needle's depth: filler tokens before it over all filler, within a sentence of the request
        pos = s.needle_positions[0]
        before = pos - meta["head_tokens"] - sum(size for p, size in spans if p < pos)
        assert s.depth == pytest.approx(before / meta["filler_tokens"])
        assert abs(before - s.requested_depth * meta["filler_tokens"]) <= max_sentence
    if task != "passkey":
        assert len({s.key for s in samples}) > 1


def test_multikey_distractors_and_multivalue_answers(tokenizer, corpus):
    mk = nd.make_samples("niah_multikey", tokenizer, 512, 3, 1, corpus=corpus, num_keys=4)
    for s in mk:
        text = tokenizer.decode(s.context_ids)
        keys = re.findall(r"special magic numbers for ([a-z]+-[a-z]+) is", text)
        assert len(keys) == 4 and len(set(keys)) == 4 and s.key in keys and len(s.answers) == 1
        assert tokenizer.decode(s.question_ids).count(s.key) == 2  # question and answer prefix
    mv = nd.make_samples("niah_multivalue", tokenizer, 512, 3, 1, corpus=corpus, num_values=3)
    for s in mv:
        assert len(s.answers) == 3 and len(set(s.answers)) == 3 and len(s.needle_positions) == 3
        assert "What are all the special magic numbers" in tokenizer.decode(s.question_ids)


def test_plain_split_puts_question_and_answer_prefix_in_question_ids(tokenizer, corpus):
    s = nd.make_samples("passkey", tokenizer, 400, 2, 0, corpus=corpus)[0]
    assert tokenizer.decode(s.question_ids) == "\nWhat is the pass key? The pass key is"
    assert tokenizer.decode(s.context_ids).startswith(nd.PASSKEY_INSTRUCTION + "\n")
    assert "What is the pass key" not in tokenizer.decode(s.context_ids)
    s = nd.make_samples("niah_single", tokenizer, 400, 2, 0, corpus=corpus)[1]
    assert tokenizer.decode(s.question_ids) == (
        f"\nWhat is the special magic number for {s.key} mentioned in the provided text?"
        f" The special magic number for {s.key} mentioned in the provided text is")


def test_chat_split_puts_question_and_assistant_turn_in_question_ids(tokenizer, corpus):
    s = nd.make_samples("passkey", tokenizer, 400, 2, 0, corpus=corpus, chat=True)[0]
    context, question = tokenizer.decode(s.context_ids), tokenizer.decode(s.question_ids)
    assert context.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                              + nd.PASSKEY_INSTRUCTION + "\n")
    assert "<|im_start|>assistant" not in context and "What is the pass key" not in context
    assert question == "\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"
    full = tokenizer.decode(s.prompt_ids)
    assert full.index("The pass key is " + s.answer) < full.index("What is the pass key?")
    bare = nd.make_samples("niah_single", tokenizer, 400, 1, 0, corpus=corpus, chat=True, answer_prefix=False)[0]
    assert tokenizer.decode(bare.question_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert bare.length == 400


def test_samples_are_deterministic_under_a_seed(tokenizer, corpus):
    a = nd.make_samples("niah_multikey", tokenizer, 400, 3, 7, corpus=corpus)
    b = nd.make_samples("niah_multikey", tokenizer, 400, 3, np.random.default_rng(7), corpus=corpus)
    c = nd.make_samples("niah_multikey", tokenizer, 400, 3, 8, corpus=corpus)
    assert [(s.prompt_ids, s.answers) for s in a] == [(s.prompt_ids, s.answers) for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]


def test_task_errors_name_the_bad_input(tokenizer, corpus):
    with pytest.raises(ValueError, match="n_tokens=20 leaves no room"):
        nd.make_samples("passkey", tokenizer, 20, 1, 0, corpus=corpus)
    with pytest.raises(ValueError, match="unknown real-text task 'niah'"):
        nd.make_samples("niah", tokenizer, 400, 1, 0, corpus=corpus)
    with pytest.raises(ValueError, match="cannot supply 400 distinct windows"):
        nd.make_samples("passkey", tokenizer, rt.tokenize_corpus(tokenizer, corpus).num_tokens - 10, 400, 0,
                        corpus=corpus)


def test_perplexity_texts(tokenizer, corpus):
    texts = nd.perplexity_texts(tokenizer, 300, 100, 4, 0, corpus=corpus)
    assert len({t.window_start for t in texts}) == 4
    for t in texts:
        assert len(t.context_ids) == 300 and len(t.continuation_ids) == 100 and t.prefix_tokens == 300
        assert t.token_ids == t.context_ids + t.continuation_ids
        assert tokenizer.decode(t.token_ids) in corpus.text  # one contiguous stretch of the corpus
    with pytest.raises(ValueError, match="continuation_tokens >= 1"):
        nd.perplexity_texts(tokenizer, 300, 0, 1, 0, corpus=corpus)


# ---------------------------------------------------------------------------------------------- scoring


def test_string_match_all_is_rulers_fraction_of_references_found():
    preds = ["The numbers are 1234567 and 7654321.", "only 1111111", "nothing"]
    refs = [["1234567", "7654321"], ["1111111", "2222222"], ["3333333"]]
    assert nd.string_match_all(preds, refs) == round((1.0 + 0.5 + 0.0) / 3 * 100, 2) == 50.0
    assert nd.string_match_all(["ABC-Def"], [["abc-DEF"]]) == 100.0  # case-insensitive substring


def test_string_match_part_is_rulers_any_reference_found():
    preds = ["only 1111111", "nothing here", "x 9 y"]
    refs = [["1111111", "2222222"], ["3333333"], ["9", "8"]]
    assert nd.string_match_part(preds, refs) == round(2 / 3 * 100, 2) == 66.67
    with pytest.raises(ValueError, match="as many predictions as references"):
        nd.string_match_part(["a"], [])


def test_passkey_scoring_is_quests_first_integer():
    sample = nd.NeedleSample("passkey", [], [], "4213", ("4213",), 0.5, 0.5, (0,), None, 0, False, 10)
    assert nd.score_prediction(sample, " 4213. Remember it.") == 1.0
    assert nd.score_prediction(sample, " 04213") == 1.0  # Quest compares integers
    assert nd.score_prediction(sample, " 12 then 4213") == 0.0
    assert nd.score_prediction(sample, " no digits") == 0.0
    niah = nd.NeedleSample("niah_multivalue", [], [], "1", ("1234567", "7654321"), 0.5, 0.5, (0,), "k", 0, False, 8)
    assert nd.score_prediction(niah, "\x01 1234567\n") == 0.5
    assert nd.postprocess_prediction(" a\x01b \n") == "a\nb"
