"""Retrieval and perplexity tasks in real text for real models (any Hugging Face tokenizer): Quest's
passkey, RULER's needles (single, multi-key, multi-value) and PG19-style perplexity texts.

Notes: docs/modules.md (`kvjax/tasks/needles.py`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvjax.tasks import real_text

PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = " The pass key is"
PASSKEY_TOKENS_TO_GENERATE = 10  # Quest

RULER_NEEDLE = "One of the special magic numbers for {key} is: {value}."
RULER_INSTRUCTION = {
    False: "A special magic number is hidden within the following text. Make sure to memorize it. "
           "I will quiz you about the number afterwards.",
    True: "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the numbers afterwards.",
}
RULER_QUESTION = {
    False: "What is the special magic number for {key} mentioned in the provided text?",
    True: "What are all the special magic numbers for {key} mentioned in the provided text?",
}
RULER_ANSWER_PREFIX = {
    False: " The special magic number for {key} mentioned in the provided text is",
    True: " The special magic numbers for {key} mentioned in the provided text are",
}
RULER_TOKENS_TO_GENERATE = 128  # RULER's niah setting
RULER_DEPTHS = np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int) / 100.0

# RULER draws keys as adjective-noun pairs from wonderwords' lists; these are a fixed subset of the same kind
ADJECTIVES = (
    "abundant agreeable ancient brave bright calm careful clever curious daring eager elegant fancy fierce "
    "gentle gigantic glorious graceful happy honest humble jolly kind lively lucky mighty modern nimble "
    "patient polite proud quiet rapid rustic silent sleepy smooth splendid steady swift tender vivid wise"
).split()
NOUNS = (
    "anchor apricot balloon basket beacon bicycle blanket bucket butterfly cabinet canoe carpet castle "
    "cathedral chimney compass cottage crayon dolphin falcon feather fountain garden giraffe harbor "
    "harvest helmet island kettle lantern lighthouse meadow mountain orchard panther pebble pelican "
    "pillow pumpkin rainbow saddle sailboat scarecrow squirrel teapot tulip umbrella volcano walrus window"
).split()

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue")
_SENTINEL = "<<KVJAX-CONTEXT-HERE>>"


@dataclass(frozen=True)
class NeedleSample:
    """One prompt: `context_ids` prefilled, `question_ids` fed by decode; `answers` must all be produced
    (`answer` is the first). `needle_positions` are the token indices in `context_ids` where each needle
    starts, the asked one first; `depth` is the fraction of the filler before the asked needle."""

    task: str
    context_ids: list[int]
    question_ids: list[int]
    answer: str
    answers: tuple[str, ...]
    depth: float
    requested_depth: float
    needle_positions: tuple[int, ...]
    key: str | None
    window_start: int
    chat: bool
    max_new_tokens: int
    metadata: dict = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.context_ids + self.question_ids

    @property
    def length(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


@dataclass(frozen=True)
class PerplexityText:
    """A real-text token sequence: `context_ids` prefilled (BOS first where the tokenizer adds one), then
    `continuation_ids` each predicted through decode."""

    context_ids: list[int]
    continuation_ids: list[int]
    window_start: int

    @property
    def token_ids(self) -> list[int]:
        return self.context_ids + self.continuation_ids

    @property
    def prefix_tokens(self) -> int:
        return len(self.context_ids)


# -------------------------------------------------------------------------------------------- scoring


def postprocess_prediction(text: str) -> str:
    """RULER's `postprocess_pred`: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for niah: per sample the fraction of its references found (case-insensitive
    substring) in the prediction, averaged over samples, in percent rounded to 2 decimals."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as references (> 0), got {len(predictions)} and {len(references)}")
    score = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
                for p, ref in zip(predictions, references)) / len(predictions) * 100
    return round(score, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for QA: per sample 1 when any of its references is found (case-insensitive
    substring) in the prediction, averaged over samples, in percent rounded to 2 decimals."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as references (> 0), got {len(predictions)} and {len(references)}")
    score = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref)
                for p, ref in zip(predictions, references)) / len(predictions) * 100
    return round(score, 2)


def passkey_prediction(text: str) -> str | None:
    """Quest's reading of a passkey answer: the first run of digits, or None."""
    m = re.search(r"\d+", text)
    return m.group() if m else None


def score_prediction(sample: NeedleSample, text: str) -> float:
    """A sample's score in [0, 1]: passkey by Quest's first-integer match, niah by RULER's
    string_match_all over the sample's answers (after RULER's postprocessing)."""
    if sample.task == "passkey":
        prediction = passkey_prediction(text)
        return float(prediction is not None and int(prediction) == int(sample.answer))
    return string_match_all([postprocess_prediction(text)], [sample.answers]) / 100.0


# ----------------------------------------------------------------------------------------- assembling


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _prompt_texts(tokenizer, instruction: str, question: str, answer_prefix: str, chat: bool) -> tuple[str, str]:
    """(the text before the filler, the text after it). Plain: RULER's and Quest's layout
    'instruction\\n{context}\\nquestion answer_prefix'. Chat: the same user message in the chat template,
    then the assistant header and the answer prefix."""
    if not chat:
        return instruction + "\n", "\n" + question + answer_prefix
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat=True needs a tokenizer with a chat template; this one has none")
    content = f"{instruction}\n{_SENTINEL}\n{question}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the tokenizer's chat template altered the user message; cannot place the context")
    before, after = text.split(_SENTINEL)
    return before, after + answer_prefix.lstrip()


def _strip_leading_whitespace(tokenizer, ids: np.ndarray, starts: np.ndarray) -> tuple[list[int], np.ndarray]:
    """A filler window whose first sentence starts without whitespace (it follows a newline of the
    template); sentence offsets moved with it."""
    ids = [int(t) for t in ids]
    starts = [int(s) for s in starts]
    for _ in range(4):
        first = tokenizer.decode(ids[:1]) if ids else ""
        if not first or "\ufffd" in first or first == first.lstrip():
            break
        stripped = _encode(tokenizer, first.lstrip()) if first.strip() else []
        delta = len(stripped) - 1
        ids = stripped + ids[1:]
        starts = [0] + [s + delta for s in starts if s > 0 and s + delta > 0]
    return ids, np.unique(np.array(starts, np.int64))


@dataclass(frozen=True)
class _Plan:
    """One sample before the filler is known: needles (token ids) and their requested depths, asked first."""

    needles: list[list[int]]
    depths: list[float]
    head: list[int]
    tail: list[int]


def _assemble(plan: _Plan, filler: list[int], starts: np.ndarray) -> tuple[list[int], list[int], list[float]]:
    """Filler with each needle inserted at the sentence start nearest its depth. Returns the context
    (head + filler with needles), each needle's position in it and its realised depth."""
    n = len(filler)
    bounds = starts[starts < n] if starts.size else np.array([0], np.int64)
    cuts = [int(bounds[np.abs(bounds - d * n).argmin()]) for d in plan.depths]
    order = sorted(range(len(plan.needles)), key=lambda i: (cuts[i], i))
    out = list(plan.head)
    positions = [0] * len(plan.needles)
    last = 0
    for i in order:
        out += filler[last : cuts[i]]
        positions[i] = len(out)
        out += plan.needles[i]
        last = cuts[i]
    out += filler[last:]
    return out, positions, [c / max(n, 1) for c in cuts]


def _evenly_spread(num_samples: int) -> list[float]:
    return [0.5] if num_samples == 1 else [float(d) for d in np.linspace(0.0, 1.0, num_samples)]


def _fill(tokenizer, task: str, plans: list[_Plan], n_tokens: int, rng: np.random.Generator, corpus, chat: bool,
          answers: list[tuple[str, ...]], keys: list[str | None], requested: list[float], max_new_tokens: int,
          redraw) -> list[NeedleSample]:
    """Draw one distinct filler window per plan, sized so that each prompt is `n_tokens` long, and
    assemble the samples. `redraw(i, window_text)` may replace plan i's needles when an answer or key
    already occurs in its filler."""
    fixed = [len(p.head) + sum(len(x) for x in p.needles) + len(p.tail) for p in plans]
    filler_lengths = [n_tokens - f for f in fixed]
    if min(filler_lengths) < 1:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for filler in a {task} prompt "
                         f"({max(fixed)} tokens of instruction, needles and question)")
    slack = 8  # for the tokens a stripped first sentence may gain
    wins = real_text.windows(tokenizer, max(filler_lengths) + slack, len(plans), rng, corpus)
    out = []
    for i, (plan, win) in enumerate(zip(plans, wins)):
        ids, starts = _strip_leading_whitespace(tokenizer, win.ids, win.sentence_starts)
        plan = redraw(i, tokenizer.decode(ids[: filler_lengths[i]]), plan) or plan
        n_filler = n_tokens - (len(plan.head) + sum(len(x) for x in plan.needles) + len(plan.tail))
        if not 1 <= n_filler <= len(ids):
            raise RuntimeError(f"sample {i}: a redrawn needle left {n_filler} filler tokens of {len(ids)}")
        filler = ids[:n_filler]
        context, positions, realised = _assemble(plan, filler, starts)
        out.append(NeedleSample(
            task=task, context_ids=context, question_ids=list(plan.tail), answer=answers[i][0],
            answers=answers[i], depth=realised[0], requested_depth=requested[i],
            needle_positions=tuple(positions), key=keys[i], window_start=win.start, chat=chat,
            max_new_tokens=max_new_tokens,
            metadata={"n_tokens": n_tokens, "head_tokens": len(plan.head), "filler_tokens": len(filler),
                      "needle_tokens": tuple(len(x) for x in plan.needles), "needle_depths": tuple(realised)},
        ))
        assert out[-1].length == n_tokens, (out[-1].length, n_tokens)
    return out


def _head_tail(tokenizer, instruction: str, question: str, answer_prefix: str, chat: bool) -> tuple[list[int], list[int]]:
    before, after = _prompt_texts(tokenizer, instruction, question, answer_prefix, chat)
    # plain prompts start as the tokenizer starts a text (BOS where it adds one); chat text carries its own
    return _encode(tokenizer, before, special=not chat), _encode(tokenizer, after)


# ---------------------------------------------------------------------------------------------- tasks


def passkey_samples(tokenizer, n_tokens: int, num_samples: int, rng: np.random.Generator | int, *,
                    chat: bool = False, answer_prefix: bool = True, corpus=None,
                    depths: Sequence[float] | None = None) -> list[NeedleSample]:
    """Quest's passkey in real text: `num_samples` prompts of exactly `n_tokens` tokens (context and
    question), the needle at depths spread evenly from 0 to 1 (or cycling through `depths`)."""
    rng = np.random.default_rng(rng)
    depths = _evenly_spread(num_samples) if depths is None else [float(depths[i % len(depths)]) for i in range(num_samples)]
    prefix = PASSKEY_ANSWER_PREFIX if answer_prefix else ""
    head, tail = _head_tail(tokenizer, PASSKEY_INSTRUCTION, PASSKEY_QUESTION, prefix, chat)
    keys = [int(rng.integers(1, 50001)) for _ in range(num_samples)]
    answers = [(str(k),) for k in keys]

    def needle(key: int) -> list[int]:
        return _encode(tokenizer, " " + PASSKEY_NEEDLE.format(key=key))

    def redraw(i: int, filler_text: str, plan: _Plan) -> _Plan | None:
        key = keys[i]
        for _ in range(1000):  # the filler must not hold the answer as a number of its own
            if not re.search(rf"(?<!\d){key}(?!\d)", filler_text):
                break
            key = int(rng.integers(1, 50001))
        if key == keys[i]:
            return None
        keys[i] = key
        answers[i] = (str(key),)
        return _Plan([needle(key)], plan.depths, plan.head, plan.tail)

    plans = [_Plan([needle(k)], [d], head, tail) for k, d in zip(keys, depths)]
    return _fill(tokenizer, "passkey", plans, n_tokens, rng, corpus, chat, answers, [None] * num_samples, depths,
                 PASSKEY_TOKENS_TO_GENERATE, redraw)


def _ruler_key(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        key = f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"
        if key not in taken:
            taken.add(key)
            return key


def _ruler_value(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        value = str(int(rng.integers(1_000_000, 10_000_000)))  # RULER: 7 digits
        if value not in taken:
            taken.add(value)
            return value


def niah_samples(tokenizer, n_tokens: int, num_samples: int, rng: np.random.Generator | int, *,
                 variant: str = "single", num_keys: int = 4, num_values: int = 4, chat: bool = False,
                 answer_prefix: bool = True, corpus=None, depths: Sequence[float] | None = None,
                 max_new_tokens: int = RULER_TOKENS_TO_GENERATE) -> list[NeedleSample]:
    """RULER's needle in a haystack of real text. `variant`: "single" (one needle), "multikey"
    (`num_keys` needles with distinct keys, one asked), "multivalue" (`num_values` needles for the asked
    key, all to be produced). The asked needle (the first value, for multivalue) sits at depths spread
    evenly over the samples (or cycling through `depths`); the others at RULER's 40 depths drawn at random."""
    if variant not in ("single", "multikey", "multivalue"):
        raise ValueError(f"unknown niah variant {variant!r}; choose single, multikey or multivalue")
    if variant == "multikey" and num_keys < 2:
        raise ValueError(f"niah multikey needs num_keys >= 2, got {num_keys}")
    if variant == "multivalue" and num_values < 2:
        raise ValueError(f"niah multivalue needs num_values >= 2, got {num_values}")
    rng = np.random.default_rng(rng)
    spread = _evenly_spread(num_samples) if depths is None else [float(depths[i % len(depths)]) for i in range(num_samples)]
    many = variant == "multivalue"
    n_keys = num_keys if variant == "multikey" else 1
    n_values = num_values if many else 1
    plans, answers, keys = [], [], []
    for i in range(num_samples):
        taken_keys: set[str] = set()
        taken_values: set[str] = set()
        sample_keys = [_ruler_key(rng, taken_keys) for _ in range(n_keys)]
        values = [[_ruler_value(rng, taken_values) for _ in range(n_values)] for _ in sample_keys]
        asked = sample_keys[0]
        texts = [RULER_NEEDLE.format(key=k, value=v) for k, vs in zip(sample_keys, values) for v in vs]
        others = [float(d) for d in rng.choice(RULER_DEPTHS, len(texts) - 1, replace=False)]
        prefix = RULER_ANSWER_PREFIX[many].format(key=asked) if answer_prefix else ""
        head, tail = _head_tail(tokenizer, RULER_INSTRUCTION[many], RULER_QUESTION[many].format(key=asked), prefix, chat)
        plans.append(_Plan([_encode(tokenizer, " " + t) for t in texts], [spread[i]] + others, head, tail))
        answers.append(tuple(values[0]))
        keys.append(asked)

    def redraw(i: int, filler_text: str, plan: _Plan) -> None:
        # 7-digit values and hyphenated keys do not occur in prose; a filler holding one would make the
        # answer ambiguous, so say so rather than score it
        for token in answers[i] + (keys[i],):
            if token.lower() in filler_text.lower():
                raise RuntimeError(f"the filler of sample {i} already holds {token!r}; use another seed")
        return None

    return _fill(tokenizer, f"niah_{variant}", plans, n_tokens, rng, corpus, chat, answers, keys, spread,
                 max_new_tokens, redraw)


def niah_single_samples(tokenizer, n_tokens: int, num_samples: int, rng, **kwargs) -> list[NeedleSample]:
    return niah_samples(tokenizer, n_tokens, num_samples, rng, variant="single", **kwargs)


def niah_multikey_samples(tokenizer, n_tokens: int, num_samples: int, rng, **kwargs) -> list[NeedleSample]:
    return niah_samples(tokenizer, n_tokens, num_samples, rng, variant="multikey", **kwargs)


def niah_multivalue_samples(tokenizer, n_tokens: int, num_samples: int, rng, **kwargs) -> list[NeedleSample]:
    return niah_samples(tokenizer, n_tokens, num_samples, rng, variant="multivalue", **kwargs)


def make_samples(task: str, tokenizer, n_tokens: int, num_samples: int, rng: np.random.Generator | int = 0,
                 **kwargs) -> list[NeedleSample]:
    """`num_samples` prompts of `task` (one of `TASKS`) of exactly `n_tokens` tokens."""
    if task == "passkey":
        return passkey_samples(tokenizer, n_tokens, num_samples, rng, **kwargs)
    if task in TASKS:
        return niah_samples(tokenizer, n_tokens, num_samples, rng, variant=task.removeprefix("niah_"), **kwargs)
    raise ValueError(f"unknown real-text task {task!r}; choose from {', '.join(TASKS)}")


def perplexity_texts(tokenizer, context_tokens: int, continuation_tokens: int, count: int,
                     rng: np.random.Generator | int, corpus=None) -> list[PerplexityText]:
    """`count` real-text sequences from distinct windows: `context_tokens` prefilled (BOS included where
    the tokenizer adds one) and `continuation_tokens` to score, StreamingLLM's and H2O's PG19 measure."""
    if context_tokens < 1 or continuation_tokens < 1:
        raise ValueError(f"perplexity texts need context_tokens >= 1 and continuation_tokens >= 1, "
                         f"got {context_tokens} and {continuation_tokens}")
    rng = np.random.default_rng(rng)
    bos = _encode(tokenizer, "", special=True)
    n_context = context_tokens - len(bos)
    if n_context < 1:
        raise ValueError(f"context_tokens={context_tokens} leaves no text after the {len(bos)} special tokens")
    out = []
    for win in real_text.windows(tokenizer, n_context + continuation_tokens + 8, count, rng, corpus):
        ids, _ = _strip_leading_whitespace(tokenizer, win.ids, win.sentence_starts)
        out.append(PerplexityText(bos + ids[:n_context], ids[n_context : n_context + continuation_tokens], win.start))
    return out
