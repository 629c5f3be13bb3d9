"""Retrieval tasks with Quest's protocol: passkey and multi-key needle.

Protocol (Quest's passkey evaluation): the context is prefilled densely (the policy compresses it, if it
compresses), then the question is fed **token by token through decode** (`generate(decode_last=len(question))`),
so a method that chooses what to keep before the question arrives cannot know what will be asked. The
answer is greedy, as many tokens as the task's answers have digits; a sample is correct when the first
integer of the generated text equals the answer.

    records = run_task(model, policy, "multikey", n_tokens=2048, num_samples=50, num_records=4)
    accuracy(records)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from kvjax.tasks import synthetic

TASKS = ("passkey", "multikey")


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


def make_samples(
    task: str, n_tokens: int, num_samples: int, seed: int = 0, num_records: int = 4,
    depths: Sequence[float] | None = None,
) -> list[synthetic.Sample]:
    """`num_samples` prompts of about `n_tokens` tokens. With `depths`, the samples cycle through them
    (the needle, or the asked record, at each depth in turn); otherwise depths are uniform at random."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; choose from {', '.join(TASKS)}")
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


def run_task(model, policy, task: str, n_tokens: int, num_samples: int, seed: int = 0, num_records: int = 4,
             depths: Sequence[float] | None = None, batch_size: int = 8, **kwargs) -> list[Scored]:
    samples = make_samples(task, n_tokens, num_samples, seed, num_records, depths)
    return answer_samples(model, policy, samples, task, n_tokens, batch_size, **kwargs)


def accuracy(records: Sequence[Scored]) -> float:
    if not records:
        raise ValueError("no records to score")
    return float(np.mean([r.correct for r in records]))


def accuracy_by_depth(records: Sequence[Scored], bins: int = 5) -> dict[str, float]:
    """Accuracy per depth bin ('0.0-0.2': 0.95, ...)."""
    edges = np.linspace(0, 1, bins + 1)
    out = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        hits = [r.correct for r in records if lo <= r.depth < hi or (hi == 1 and r.depth == 1)]
        if hits:
            out[f"{lo:.1f}-{hi:.1f}"] = float(np.mean(hits))
    return out


def as_dicts(records: Sequence[Scored]) -> list[dict]:
    return [asdict(r) for r in records]
