"""Synthetic long-context retrieval text: the shipped model's training data and the evaluation tasks.

Notes: docs/modules.md (`kvjax/tasks/synthetic.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FILLER = "the grass is green . the sky is blue . the sun is yellow . here we go . there and back again ."
FILLER_WORDS = FILLER.split()
FILLER_SENTENCES = [s.split() + ["."] for s in FILLER.rstrip(" .").split(" . ")]
PASSKEY_QUESTION = "what is the pass key ? the pass key is"
MULTIKEY_QUESTION = "what is the magic number for {key} ? {key}"

KEYS = (
    "apple banana cherry grape lemon mango melon olive peach pear plum berry "
    "tiger lion zebra horse camel eagle falcon otter panda koala wolf fox "
    "river ocean desert forest island valley canyon meadow glacier harbor "
    "silver copper cobalt marble granite amber crystal velvet "
    "rocket engine anchor compass lantern mirror hammer violin piano guitar "
    "paris london tokyo berlin madrid cairo delhi lima oslo rome"
).split()

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
DIGITS = [str(d) for d in range(10)]
EXTRA_WORDS = (
    "pass key remember it what ? magic number for : , one of special numbers a an in on at to no yes answer "
    "question context document user assistant instruction below read"
).split()
VOCABULARY = list(dict.fromkeys(SPECIALS + DIGITS + FILLER_WORDS + EXTRA_WORDS + KEYS))


@dataclass(frozen=True)
class Sample:
    """One task instance: `context + question` is the prompt; `answer` the expected digits (no spaces)."""

    context: str
    question: str
    answer: str
    depth: float  # where the (asked) needle sits, 0 = start of the context, 1 = end

    @property
    def prompt(self) -> str:
        return f"{self.context} {self.question}"


def digits(number: str) -> str:
    """'71432' -> '7 1 4 3 2' (how the tokenizer splits numbers)."""
    return " ".join(number)


def random_number(rng: np.random.Generator, num_digits: int) -> str:
    first = str(rng.integers(1, 10))
    return first + "".join(str(d) for d in rng.integers(0, 10, num_digits - 1))


def filler_words(n_tokens: int, offset: int = 0) -> list[str]:
    """The repeated filler, `n_tokens` words long, starting `offset` words into the cycle."""
    reps = -(-(n_tokens + offset) // len(FILLER_WORDS))
    return (FILLER_WORDS * reps)[offset : offset + n_tokens]


def _sentence_boundaries(n_tokens: int) -> np.ndarray:
    """Word indices into `filler_words(n_tokens)` at which a sentence starts (0 included)."""
    words = filler_words(n_tokens)
    return np.array([0] + [i + 1 for i, w in enumerate(words[:-1]) if w == "."], np.int64)


def insert_at_depths(n_filler: int, inserts: list[list[str]], depths: list[float]) -> tuple[list[str], list[float]]:
    """Filler of `n_filler` words with each insert placed at the sentence boundary nearest its depth.

    Returns the words and the realised depth of each insert (fraction of the filler before it).
    """
    words = filler_words(n_filler)
    bounds = _sentence_boundaries(n_filler)
    cuts = [int(bounds[np.abs(bounds - d * n_filler).argmin()]) for d in depths]
    order = sorted(range(len(inserts)), key=lambda i: (cuts[i], i))
    out: list[str] = []
    last = 0
    for i in order:
        out += words[last : cuts[i]] + inserts[i]
        last = cuts[i]
    out += words[last:]
    return out, [cuts[i] / max(n_filler, 1) for i in range(len(inserts))]


def passkey_sample(rng: np.random.Generator, n_tokens: int, depth: float | None = None, num_digits: int = 5) -> Sample:
    """A passkey prompt of about `n_tokens` tokens (context + question; BOS not counted)."""
    key = random_number(rng, num_digits)
    needle = f"the pass key is {digits(key)} . remember it . {digits(key)} is the pass key .".split()
    n_filler = max(n_tokens - len(needle) - len(PASSKEY_QUESTION.split()), 0)
    depth = float(rng.uniform()) if depth is None else depth
    words, (real_depth,) = insert_at_depths(n_filler, [needle], [depth])
    return Sample(" ".join(words), PASSKEY_QUESTION, key, real_depth)


def multikey_records(rng: np.random.Generator, num_records: int, num_digits: int = 4) -> list[tuple[str, str]]:
    """`num_records` (key, value) pairs with distinct keys."""
    if not 1 <= num_records <= len(KEYS):
        raise ValueError(f"num_records must be in 1..{len(KEYS)}, got {num_records}")
    keys = rng.choice(len(KEYS), num_records, replace=False)
    return [(KEYS[k], random_number(rng, num_digits)) for k in keys]


def record_words(key: str, value: str) -> list[str]:
    return f"{key} {digits(value)} .".split()


def multikey_sample(
    rng: np.random.Generator, n_tokens: int, num_records: int, depth: float | None = None, num_digits: int = 4
) -> Sample:
    """A multi-key needle prompt of about `n_tokens` tokens; the question asks one record at `depth`."""
    records = multikey_records(rng, num_records, num_digits)
    asked = int(rng.integers(num_records))
    depths = [float(x) for x in rng.uniform(size=num_records)]
    if depth is not None:
        depths[asked] = depth
    inserts = [record_words(k, v) for k, v in records]
    question = MULTIKEY_QUESTION.format(key=records[asked][0])
    n_filler = max(n_tokens - sum(len(i) for i in inserts) - len(question.split()), 0)
    words, real = insert_at_depths(n_filler, inserts, depths)
    return Sample(" ".join(words), question, records[asked][1], real[asked])


def multikey_training_text(
    rng: np.random.Generator, n_tokens: int, num_records: int, num_questions: int, num_digits: int = 4
) -> tuple[str, list[tuple[str, str]]]:
    """A context with records followed by several question/answer pairs (denser supervision for training).

    Returns the text and the list of (question, answer digits) in the order they appear after the context.
    """
    records = multikey_records(rng, num_records, num_digits)
    inserts = [record_words(k, v) for k, v in records]
    asked = rng.choice(num_records, min(num_questions, num_records), replace=False)
    qa = [(MULTIKEY_QUESTION.format(key=records[i][0]), records[i][1]) for i in asked]
    qa_len = sum(len(q.split()) + num_digits + 1 for q, _ in qa)
    n_filler = max(n_tokens - sum(len(i) for i in inserts) - qa_len, 0)
    words, _ = insert_at_depths(n_filler, inserts, [float(x) for x in rng.uniform(size=num_records)])
    return " ".join(words), qa


def first_integer(text: str) -> str | None:
    """The first run of digits in `text`, spaces between digits ignored ('7 1 4 3 2 .' -> '71432')."""
    out = []
    for token in text.split():
        if token.isdigit():
            out.append(token)
        elif out:
            break
    return "".join(out) if out else None
