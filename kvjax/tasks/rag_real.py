"""Cross-chunk RAG prompts in real text for real models (CacheClip's evaluation on SmolLM2-135M).

Notes: docs/modules.md (`kvjax/tasks/rag_real.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvjax.tasks import needles, real_text

KINDS = ("straddle", "split", "two_hop", "inside")
INSTRUCTION = "Answer the question using the retrieved documents below."
FACT_KEY = " The secret code of {name} is"
FACT_VALUE = " {value}."
LINK = " {name} left the code in locker {locker}."
LOCKER = " Locker {locker} holds the code {value}."
QUESTION = {
    "fact": "What is the secret code of {name}?",
    "two_hop": "{name} left the code in a locker. What code does that locker hold?",
}
ANSWER_PREFIX = {"fact": " The secret code of {name} is", "two_hop": " The code is"}
MAX_NEW_TOKENS = 12  # a 7-digit value and its period, with room for a leading space or words


@dataclass(frozen=True)
class RagRequest:
    """One request as token ids, and what scoring and recall need."""

    kind: str
    prefix: np.ndarray  # int32[P]
    chunks: list  # num_chunks x int32[chunk_len]
    query: np.ndarray  # int32[Q]
    answer: str
    name: str
    after_boundary: np.ndarray | None  # assembled slots of the asked fact's tokens after a chunk boundary
    max_new_tokens: int = MAX_NEW_TOKENS

    def value_ids(self, tokenizer) -> list[int]:
        """The asked value as it ends its fact (" 1234567."), in `tokenizer`'s ids: the answer a tuning
        run teacher-forces."""
        return _ids(tokenizer, FACT_VALUE.format(value=self.answer))

    def correct(self, text: str) -> bool:
        """RULER's string match: the value occurs in the generated text."""
        return self.answer in text


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chunk(window: real_text.Window, chunk_len: int, inserts: list[list[int]], first: list[int], last: list[int],
           rng: np.random.Generator) -> list[int]:
    """`first` + the window's filler with each of `inserts` put in at distinct sentence starts (token
    offsets where there are too few) + `last`: exactly `chunk_len` tokens, the filler cut to fit."""
    budget = chunk_len - len(first) - len(last) - sum(len(x) for x in inserts)
    if budget < 1:
        raise ValueError(f"a chunk of {chunk_len} tokens has no room for its facts; use longer chunks")
    filler = [int(t) for t in window.ids[:budget]]
    starts = [int(s) for s in window.sentence_starts if 0 < s < budget]
    if len(starts) < len(inserts):
        starts = list(range(1, budget))
    cuts = sorted(rng.choice(starts, size=len(inserts), replace=False).tolist()) if inserts else []
    body, last_cut = [], 0
    for cut, sentence in zip(cuts, inserts):
        body += filler[last_cut:cut] + sentence
        last_cut = cut
    return first + body + filler[last_cut:] + last


def askable_names(tokenizer, form: str) -> list[str]:
    """The adjective-noun names whose question and answer prefix of `form` ("fact" or "two_hop") have the
    most common token length under `tokenizer`: the asked name is one of them, so every query of a kind
    has one length and the RAG pipeline compiles once per kind (another length recompiles every method).
    Distractor names are any."""
    names = [f"{a}-{n}" for a in needles.ADJECTIVES for n in needles.NOUNS]
    lengths = np.array([len(_ids(tokenizer, QUESTION[form].format(name=name) + ANSWER_PREFIX[form].format(name=name)))
                        for name in names])
    common = np.bincount(lengths).argmax()
    return [name for name, n in zip(names, lengths) if n == common]


def rag_requests(tokenizer, kind: str, num_samples: int, rng: np.random.Generator | int, *, num_chunks: int = 8,
                 chunk_len: int = 256, num_distractors: int = 3, chat: bool = True, corpus=None) -> list[RagRequest]:
    """`num_samples` requests of `kind` (module docstring), each with its own filler windows."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {KINDS}")
    if num_chunks < 2:
        raise ValueError(f"cross-chunk requests need num_chunks >= 2, got {num_chunks}")
    rng = np.random.default_rng(rng)
    askable = askable_names(tokenizer, "two_hop" if kind == "two_hop" else "fact")
    windows = real_text.windows(tokenizer, chunk_len, num_samples * num_chunks, rng, corpus)
    out = []
    for i in range(num_samples):
        name = str(rng.choice(askable))
        names: list[str] = [name]  # a list, not a set: the order must not depend on string hashing
        while len(names) < num_distractors + 1:
            drawn = f"{rng.choice(needles.ADJECTIVES)}-{rng.choice(needles.NOUNS)}"
            names += [drawn] if drawn not in names else []
        others = names[1:]
        value = str(int(rng.integers(1_000_000, 10_000_000)))
        wins = windows[i * num_chunks : (i + 1) * num_chunks]
        inserts: list[list[list[int]]] = [[] for _ in range(num_chunks)]
        first: list[list[int]] = [[] for _ in range(num_chunks)]
        last: list[list[int]] = [[] for _ in range(num_chunks)]
        after = None
        key_ids = _ids(tokenizer, FACT_KEY.format(name=name))
        value_ids = _ids(tokenizer, FACT_VALUE.format(value=value))
        if kind in ("straddle", "split"):
            fact = key_ids + value_ids
            cut = len(key_ids) if kind == "split" else int(rng.integers(1, len(fact)))
            c = int(rng.integers(0, num_chunks - 1))  # the boundary after chunk c
            last[c], first[c + 1] = fact[:cut], fact[cut:]
            after = np.arange(len(fact) - cut) + (c + 1) * chunk_len  # + len(prefix), below
        elif kind == "inside":
            inserts[int(rng.integers(0, num_chunks))].append(key_ids + value_ids)
        else:  # two_hop
            locker = str(int(rng.integers(100, 1000)))
            a, b = sorted(rng.choice(num_chunks, size=2, replace=False).tolist())
            inserts[a].append(_ids(tokenizer, LINK.format(name=name, locker=locker)))
            inserts[b].append(_ids(tokenizer, LOCKER.format(locker=locker, value=value)))
        for other in others:  # distractors: other names' codes, whole, anywhere
            inserts[int(rng.integers(0, num_chunks))].append(_ids(tokenizer, FACT_KEY.format(name=other) + FACT_VALUE.format(
                value=int(rng.integers(1_000_000, 10_000_000)))))
        chunks = [_chunk(w, chunk_len, inserts[c], first[c], last[c], rng) for c, w in enumerate(wins)]
        form = "two_hop" if kind == "two_hop" else "fact"
        head, tail = needles._head_tail(tokenizer, INSTRUCTION, QUESTION[form].format(name=name),
                                        ANSWER_PREFIX[form].format(name=name), chat)
        prefix = np.asarray(head, np.int32)
        out.append(RagRequest(kind, prefix, [np.asarray(c, np.int32) for c in chunks], np.asarray(tail, np.int32),
                              value, name, None if after is None else after + len(prefix)))
        assert all(len(c) == chunk_len for c in chunks), [len(c) for c in chunks]
    return out
