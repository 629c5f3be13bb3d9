"""Retrieval tasks with Quest's protocol: the shipped model's synthetic passkey and multi-key needle, and
real-text passkey and RULER needles for real models (`kvjax.tasks.needles`).

Protocol (Quest's passkey evaluation): the context is prefilled densely (the policy compresses it, if it
compresses), then the question is fed **token by token through decode** (`generate(decode_last=len(question))`),
so a method that chooses what to keep before the question arrives cannot know what will be asked. The
answer is greedy, as many tokens as the task's answers have digits; a sample is correct when the first
integer of the generated text equals the answer.

    records = run_task(model, policy, "multikey", n_tokens=2048, num_samples=50, num_records=4)
    accuracy(records)

Real-text tasks (`REAL_TASKS`: real_passkey, niah_single, niah_multikey, niah_multivalue) are scored as their
papers do: Quest's first-integer match for the passkey, RULER's string_match_all for the needles (a
multi-value sample scores the share of its values found).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from kvjax.tasks import needles, synthetic

SYNTHETIC_TASKS = ("passkey", "multikey")
REAL_TASKS = ("real_passkey", "niah_single", "niah_multikey", "niah_multivalue")
TASKS = SYNTHETIC_TASKS + REAL_TASKS
# RULER generates 128 tokens for every niah task; a single 7-digit value needs far fewer, and every decode
# step costs a full step of the model, so answers are capped here (multi-value needs room for four values).
REAL_ANSWER_TOKENS = {"real_passkey": 10, "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 64}


@dataclass(frozen=True)
class Scored:
    """One answered sample."""

    task: str
    n_tokens: int
    depth: float
    answer: str
    prediction: str | None
    correct: bool
    text: str
    score: float | None = None  # a partial score in [0, 1] (RULER's string_match_all), when the task has one


def make_samples(
    task: str, n_tokens: int, num_samples: int, seed: int = 0, num_records: int = 4,
    depths: Sequence[float] | None = None,
) -> list[synthetic.Sample]:
    """`num_samples` prompts of about `n_tokens` tokens. With `depths`, the samples cycle through them
    (the needle, or the asked record, at each depth in turn); otherwise depths are uniform at random."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"unknown synthetic retrieval task {task!r}; choose from {', '.join(SYNTHETIC_TASKS)}")
    if n_tokens < 64:
        raise ValueError(f"n_tokens must be >= 64 for a retrieval prompt, got {n_tokens}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_samples):
        depth = None if depths is None else float(depths[i % len(depths)])
        if task == "passkey":
            out.append(synthetic.passkey_sample(rng, n_tokens, depth))
        else:
            out.append(synthetic.multikey_sample(rng, n_tokens, num_records, depth))
    return out


def score_text(text: str, answer: str) -> tuple[str | None, bool]:
    """First-integer match: (the integer read from `text`, whether it equals `answer`)."""
    prediction = synthetic.first_integer(text)
    return prediction, prediction == answer


def answer_samples(model, policy, samples: Sequence[synthetic.Sample], task: str, n_tokens: int,
                   batch_size: int = 8, page_size: int = 16, chunk_size: int = 512) -> list[Scored]:
    """Run `samples` through `kvjax.generate` with the question fed by decode; score each answer."""
    import kvjax

    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("retrieval tasks need a model with a tokenizer")
    out: list[Scored] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        prompts = [tokenizer(s.prompt)["input_ids"] for s in batch]
        question_lengths = {len(tokenizer(s.question, add_special_tokens=False)["input_ids"]) for s in batch}
        decode_last = min(question_lengths)  # equal within a task (the question's words are fixed)
        # a task's answers have a fixed digit count; the shipped model was not trained to end its answer,
        # so it gets exactly that many tokens (docs/default_model.md)
        max_new = max(len(s.answer) for s in batch)
        tokens = kvjax.generate(
            model, prompts, max_new, policy, decode_last=decode_last, page_size=page_size, chunk_size=chunk_size
        )
        for sample, row in zip(batch, np.asarray(tokens)):
            text = tokenizer.decode([int(t) for t in row if t >= 0], skip_special_tokens=True)
            prediction, correct = score_text(text, sample.answer)
            out.append(Scored(task, n_tokens, sample.depth, sample.answer, prediction, correct, text))
    return out


def make_real_samples(model, task: str, n_tokens: int, num_samples: int, seed: int = 0,
                      chat: bool = False) -> list[needles.NeedleSample]:
    """Real-text samples of exactly `n_tokens` tokens for `model`'s tokenizer (plain prompts with the answer
    prefix by default: under them SmolLM2-135M with full attention answered 8/8 passkeys at 2K and 4K)."""
    if task not in REAL_TASKS:
        raise ValueError(f"unknown real-text task {task!r}; choose from {', '.join(REAL_TASKS)}")
    if model.tokenizer is None:
        raise ValueError("real-text tasks need a model with a tokenizer")
    return needles.make_samples(task.removeprefix("real_"), model.tokenizer, n_tokens, num_samples, seed, chat=chat)


def answer_real_samples(model, policy, samples: Sequence[needles.NeedleSample], task: str, n_tokens: int,
                        batch_size: int = 8, page_size: int = 16, chunk_size: int = 512) -> list[Scored]:
    """Real-text samples through `kvjax.generate`, the question fed by decode. A niah question names its
    key, so question lengths differ: batches group samples of one question length."""
    import kvjax

    by_length: dict[int, list] = {}
    for sample in samples:
        by_length.setdefault(len(sample.question_ids), []).append(sample)
    max_new = REAL_ANSWER_TOKENS[task]
    out: list[Scored] = []
    for decode_last, group in sorted(by_length.items()):
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            prompts = [list(s.context_ids) + list(s.question_ids) for s in batch]
            tokens = kvjax.generate(model, prompts, min(max_new, batch[0].max_new_tokens), policy,
                                    decode_last=decode_last, page_size=page_size, chunk_size=chunk_size)
            for sample, row in zip(batch, np.asarray(tokens)):
                text = model.tokenizer.decode([int(t) for t in row if t >= 0], skip_special_tokens=True)
                score = needles.score_prediction(sample, text)
                prediction = needles.passkey_prediction(text) if sample.task == "passkey" else text.strip()
                out.append(Scored(task, n_tokens, sample.depth, " ".join(sample.answers), prediction, score == 1.0,
                                  text, score))
    return out


def run_task(model, policy, task: str, n_tokens: int, num_samples: int, seed: int = 0, num_records: int = 4,
             depths: Sequence[float] | None = None, batch_size: int = 8, **kwargs) -> list[Scored]:
    """`num_samples` samples of `task` (synthetic or real-text) answered under `policy`."""
    if task in REAL_TASKS:
        samples = make_real_samples(model, task, n_tokens, num_samples, seed)
        return answer_real_samples(model, policy, samples, task, n_tokens, batch_size, **kwargs)
    samples = make_samples(task, n_tokens, num_samples, seed, num_records, depths)
    return answer_samples(model, policy, samples, task, n_tokens, batch_size, **kwargs)


def accuracy(records: Sequence[Scored]) -> float:
    """Mean score: exact match, or the partial score (RULER's string_match_all) where a task has one."""
    if not records:
        raise ValueError("no records to score")
    return float(np.mean([r.correct if r.score is None else r.score for r in records]))


def accuracy_by_depth(records: Sequence[Scored], bins: int = 5) -> dict[str, float]:
    """Accuracy per depth bin ('0.0-0.2': 0.95, ...)."""
    edges = np.linspace(0, 1, bins + 1)
    out = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        hits = [r.correct if r.score is None else r.score for r in records
                if lo <= r.depth < hi or (hi == 1 and r.depth == 1)]
        if hits:
            out[f"{lo:.1f}-{hi:.1f}"] = float(np.mean(hits))
    return out


def as_dicts(records: Sequence[Scored]) -> list[dict]:
    return [asdict(r) for r in records]
