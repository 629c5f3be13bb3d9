"""A LongBench harness over local jsonl files, for the six tasks Quest reports.

Reads LongBench's own format (one JSON object per line with `input`, `context`, `answers`, and optionally
`length`, `dataset`, `all_classes`, `_id`), builds LongBench's prompt for the task (its
`dataset2prompt.json`), truncates the middle of over-long prompts as LongBench's `pred.py` does, generates
greedily up to the task's `dataset2maxlen` tokens, and scores with LongBench's metrics: QA-F1 (token F1
after SQuAD-style normalisation) for the QA tasks, Rouge-L for GovReport. Scores are 0-100, the max
over the reference answers, averaged over samples.

    scores = run_longbench(model, policy, "qasper", "data/qasper.jsonl", max_prompt_tokens=4096)
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from typing import Sequence

import numpy as np
from tqdm import tqdm

# LongBench's config/dataset2prompt.json and dataset2maxlen.json, for Quest's six tasks
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
}
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "gov_report": 512,
                  "triviaqa": 32}
TASKS = tuple(PROMPTS)
REQUIRED_FIELDS = ("input", "context", "answers")


# ------------------------------------------------------------------------------------------ metrics


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD / LongBench)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], truth_tokens: Sequence[str]) -> float:
    common = Counter(prediction_tokens) & Counter(truth_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, truth: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(truth).split())


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, truth: str) -> float:
    """Rouge-L F1 over whitespace tokens (longest common subsequence; sentence-level form)."""
    p, t = prediction.split(), truth.split()
    lcs = _lcs_length(p, t)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(t)
    return 2 * precision * recall / (precision + recall)


METRICS = {"narrativeqa": qa_f1, "qasper": qa_f1, "multifieldqa_en": qa_f1, "hotpotqa": qa_f1, "triviaqa": qa_f1,
           "gov_report": rouge_l}


def score_prediction(task: str, prediction: str, answers: Sequence[str]) -> float:
    """LongBench's per-sample score (0-1): the max over reference answers. TriviaQA keeps the first line."""
    if task == "triviaqa":
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[task]
    return max((metric(prediction, a) for a in answers), default=0.0)


# --------------------------------------------------------------------------------------------- data


def load_jsonl(path: str) -> tuple[list[dict], int]:
    """Rows of a LongBench jsonl file with the required fields, and the count of skipped bad rows."""
    rows, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(row, dict) or any(k not in row for k in REQUIRED_FIELDS) or not row["answers"]:
                skipped += 1
                continue
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no usable LongBench rows (fields {', '.join(REQUIRED_FIELDS)}); {skipped} skipped")
    return rows, skipped


def build_prompt_ids(tokenizer, task: str, row: dict, max_prompt_tokens: int) -> list[int]:
    """LongBench's prompt, middle-truncated to `max_prompt_tokens` tokens (pred.py keeps both ends)."""
    text = PROMPTS[task].format(context=row["context"], input=row["input"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
        half = max_prompt_tokens // 2
        ids = ids[:half] + ids[len(ids) - (max_prompt_tokens - half):]
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + ids


def run_longbench(model, policy, task: str, path: str, max_prompt_tokens: int = 4096, max_samples: int | None = None,
                  decode_last: int = 0, max_new_tokens: int | None = None, progress: bool = True) -> dict:
    """Score `policy` on one LongBench task file. Returns the mean score (0-100) and per-sample records."""
    import kvjax

    if task not in PROMPTS:
        raise ValueError(f"unknown LongBench task {task!r}; supported: {', '.join(TASKS)}")
    rows, skipped = load_jsonl(path)
    rows = rows[:max_samples] if max_samples else rows
    max_new = max_new_tokens or MAX_NEW_TOKENS[task]
    records = []
    for row in tqdm(rows, desc=f"longbench {task} {policy.name}", disable=not progress, leave=False):
        ids = build_prompt_ids(model.tokenizer, task, row, max_prompt_tokens)
        out = kvjax.generate(model, [ids], max_new, policy, decode_last=min(decode_last, len(ids) - 1))[0]
        prediction = model.tokenizer.decode([int(t) for t in out if t >= 0], skip_special_tokens=True)
        records.append({"id": row.get("_id"), "prediction": prediction,
                        "score": score_prediction(task, prediction, row["answers"])})
    return {"task": task, "policy": policy.name, "score": 100.0 * float(np.mean([r["score"] for r in records])),
            "samples": len(records), "skipped_rows": skipped, "records": records}
