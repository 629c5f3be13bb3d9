"""Retrieval tasks with Quest's protocol: the shipped model's synthetic passkey and multi-key needle, and
real-text passkey and RULER needles for real models (`kvjax.tasks.needles`).

Protocol (Quest's passkey evaluation): the context is prefilled densely (the policy compresses it, if it
compresses), then the question is fed **token by token through decode** (`kvjax.engine.generation.continue_rows`,
each row its own question), so a method that chooses what to keep before the question arrives cannot know what will be asked. The
answer is greedy, as many tokens as the task's answers have digits; a sample is correct when the first
integer of the generated text equals the answer.

    records = run_task(model, policy, "multikey", n_tokens=2048, num_samples=50, num_records=4)
    accuracy(records)

Real-text tasks (`REAL_TASKS`: real_passkey, niah_single, niah_multikey, niah_multivalue) are scored as their
papers do: Quest's first-integer match for the passkey, RULER's string_match_all for the needles (a
multi-value sample scores the share of its values found).

`answer_shared` answers one batch under many policies with one full prefill (`kvjax.engine.shared_prefill`): each
policy that compresses after prefill is derived from a copy of that state, equal to its own prefill; policies
that score the prompt in a pass of their own (KVzip) and differ in their budget alone share one prefill and one
scoring pass (`scored_states`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
import itertools
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


def answer_samples(model, policy, samples: Sequence, task: str, n_tokens: int, batch_size: int = 8,
                   page_size: int = 16, chunk_size: int = 512) -> list[Scored]:
    """`samples` (synthetic or real-text) answered under one policy, in batches: `answer_shared` with one policy."""
    if model.tokenizer is None:
        raise ValueError("retrieval tasks need a model with a tokenizer")
    out: list[Scored] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        out += answer_shared(model, {"policy": policy}, batch, task, n_tokens, page_size, chunk_size)["policy"]
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


def split_sample(model, sample, task: str) -> tuple[list[int], list[int], int]:
    """(context ids prefilled, question ids fed by decode, tokens to generate) of a synthetic or real sample."""
    if task in REAL_TASKS:
        return list(sample.context_ids), list(sample.question_ids), min(REAL_ANSWER_TOKENS[task], sample.max_new_tokens)
    prompt = model.tokenizer(sample.prompt)["input_ids"]
    question = len(model.tokenizer(sample.question, add_special_tokens=False)["input_ids"])
    # the shipped model was not trained to end its answer: exactly the answer's digit count (docs/default_model.md)
    return prompt[: len(prompt) - question], prompt[len(prompt) - question :], len(sample.answer)


def score_sample(model, sample, task: str, n_tokens: int, tokens: Sequence[int]) -> Scored:
    """One generated row scored as its task's paper scores it."""
    text = model.tokenizer.decode([int(t) for t in tokens if t >= 0], skip_special_tokens=True)
    if task not in REAL_TASKS:
        prediction, correct = score_text(text, sample.answer)
        return Scored(task, n_tokens, sample.depth, sample.answer, prediction, correct, text)
    score = needles.score_prediction(sample, text)
    prediction = needles.passkey_prediction(text) if sample.task == "passkey" else text.strip()
    return Scored(task, n_tokens, sample.depth, " ".join(sample.answers), prediction, score == 1.0, text, score)


def compresses_in_prefill(policy) -> bool:
    """Whether `policy` compresses during prefill (Locret) or scores the prompt in a pass of its own (KVzip): its
    state cannot be derived from a shared one."""
    compressor = policy.compressor
    return compressor is not None and (compressor.chunks is not None or compressor.scoring_pass is not None)


def policy_state(model, shared, policy, contexts, reserve: int, page_size: int = 16, chunk_size: int = 512):
    """`(state, logits)` of `contexts` under `policy`: derived from the shared full prefill `shared`
    (`kvjax.engine.shared_prefill`), or, for a policy that compresses during prefill, a prefill of its own (with the
    shared state's capacity when there is one)."""
    import kvjax
    from kvjax.engine.shared_prefill import derive

    if not compresses_in_prefill(policy):
        return derive(model, shared, policy)
    kvzip = policy.compressor.scoring_pass is not None  # KVzip's pass needs more than the shared capacity
    capacity = shared.state.capacity if shared and not kvzip else None
    return kvjax.prefill(model, contexts, policy, page_size=page_size, chunk_size=chunk_size,
                         capacity=capacity, max_new_tokens=reserve)


def answer_shared(model, policies: dict, samples: Sequence, task: str, n_tokens: int, page_size: int = 16,
                  chunk_size: int = 512, progress=None, question_in_prefill: bool = False) -> dict:
    """One batch of `samples` under every policy of `policies` ({key: Policy}), with one full prefill shared
    by every policy that compresses after prefill or only selects pages (`kvjax.engine.shared_prefill`); a policy
    compressing during prefill (Locret) is prefilled on its own. Questions are fed by decode, ragged.
    Returns {key: [Scored, ...]} in sample order. `progress` (a tqdm bar) is advanced once per policy.
    `question_in_prefill` prefills the question with the context (so it is compressed with it, and sits in
    SnapKV's observation window), the setting of SnapKV's and Ada-KV's LongBench runs, instead of Quest's."""
    from kvjax.engine.generation import continue_rows
    from kvjax.engine.shared_prefill import shared_prefill

    split = [split_sample(model, s, task) for s in samples]
    if question_in_prefill:  # SnapKV's and H2O's own setting: the question is prefilled, then compressed
        split = [(c + q, [], m) for c, q, m in split]
    contexts = [c for c, _, _ in split]
    questions = [np.asarray(q, np.int32) for _, q, _ in split]
    max_new = max(m for _, _, m in split)
    reserve = max(len(q) for q in questions) + max_new
    shareable = {k: p for k, p in policies.items() if not compresses_in_prefill(p)}
    out = {}
    shared = None
    if shareable:
        shared = shared_prefill(model, contexts, list(shareable.values()), reserve_tokens=reserve,
                                page_size=page_size, chunk_size=chunk_size)
    states = ((key, policy_state(model, shared, policies[key], contexts, reserve, page_size, chunk_size)) for key in
              policies if not any(key in group for group in scoring_groups(policies)))
    for group in scoring_groups(policies):
        states = itertools.chain(states, scored_states(model, {k: policies[k] for k in group}, contexts, reserve,
                                                       page_size, chunk_size))
    for key, (state, logits) in states:  # one state at a time
        tokens = continue_rows(model, state, logits, questions, max_new, policies[key])
        out[key] = [score_sample(model, s, task, n_tokens, row) for s, row in zip(samples, np.asarray(tokens))]
        if progress is not None:
            progress.update(1)
    return {key: out[key] for key in policies}


def scoring_groups(policies: dict) -> list[list]:
    """Keys of `policies` ({key: Policy}) that score the prompt in a pass of their own (KVzip) and differ in
    `token_budget` alone, grouped (groups of two or more): their scores do not depend on the budget."""
    groups: dict = {}
    for key, policy in policies.items():
        compressor = policy.compressor
        if compressor is policy and compressor.scoring_pass is not None and policy.selector is None:
            groups.setdefault(dataclasses.replace(policy, token_budget=0), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def scored_states(model, policies: dict, contexts, reserve: int, page_size: int = 16, chunk_size: int = 512):
    """Yields `(key, (state, logits))` for each of `policies` (a `scoring_groups` group), each equal to its own
    prefill (`policy_state`) but from one prefill and one scoring pass: each policy pools the scores its own way
    and compresses a copy of the scored state (the last policy the state itself)."""
    from kvjax.engine.api import as_token_lists
    from kvjax.engine.generation import PrefillPlan, compress_prefilled, prefill_chunk_steps, run_to_end
    from kvjax.engine.reconstruction import reconstruction_scores, score_slots
    from kvjax.util.trees import copied

    first = next(iter(policies.values()))
    rows = as_token_lists(contexts, model.cfg.vocab_size)
    plan = PrefillPlan.for_prompts(first, max(map(len, rows)), reserve, None, page_size, chunk_size)
    state, last_queries, logits = run_to_end(prefill_chunk_steps(model, rows, plan))
    state, scores = reconstruction_scores(model, state, rows, first.compressor.scoring_pass)
    keys = list(policies)
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        mine = score_slots(state if last else copied(state), scores, policy=policies[key])
        mine = compress_prefilled(model, mine, last_queries, policies[key], [len(r) for r in rows], reserve)
        yield key, (mine, logits if last else copied(logits))


def run_task(model, policy, task: str, n_tokens: int, num_samples: int, seed: int = 0, num_records: int = 4,
             depths: Sequence[float] | None = None, batch_size: int = 8, **kwargs) -> list[Scored]:
    """`num_samples` samples of `task` (synthetic or real-text) answered under `policy`."""
    return answer_samples(model, policy, task_samples(model, task, n_tokens, num_samples, seed, num_records, depths),
                          task, n_tokens, batch_size, **kwargs)


def task_samples(model, task: str, n_tokens: int, num_samples: int, seed: int = 0, num_records: int = 4,
                 depths: Sequence[float] | None = None) -> list:
    """`num_samples` samples of `task`: real-text ones for `model`'s tokenizer, or synthetic ones."""
    if task in REAL_TASKS:
        return make_real_samples(model, task, n_tokens, num_samples, seed)
    return make_samples(task, n_tokens, num_samples, seed, num_records, depths)


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
