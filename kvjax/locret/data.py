"""LongAlpaca-style training rows for Locret: load, check, tokenize, truncate, batch.

Notes: docs/modules.md (`kvjax/locret/data.py`)."""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass

import numpy as np

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Example:
    prefix: np.ndarray  # int32[Tp] the prompt (chat template applied when the tokenizer has one)
    answer: np.ndarray  # int32[A]


def _read_json_lines(path: str, skipped: collections.Counter) -> list:
    """A fallback reader when `datasets` cannot build one table (e.g. a field's type differs across rows)."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        rows = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                skipped["unparsable_line"] += 1
        return rows


def load_rows(source: str, split: str = "train", skipped: collections.Counter | None = None) -> list:
    """Rows (dicts) of a hub dataset or a local json / jsonl / parquet file."""
    import datasets

    skipped = collections.Counter() if skipped is None else skipped
    ext = os.path.splitext(source)[1].lower()
    if os.path.exists(source):
        if ext not in LOCAL_FORMATS:
            raise ValueError(f"local data file {source!r} must end in one of {', '.join(LOCAL_FORMATS)}")
        try:
            ds = datasets.load_dataset(LOCAL_FORMATS[ext], data_files=source, split="train")
        except Exception as error:  # mixed types across rows, a broken line: read it line by line
            if LOCAL_FORMATS[ext] != "json":
                raise ValueError(f"could not read {source!r}: {error}") from error
            return _read_json_lines(source, skipped)
        return list(ds)
    if ext in LOCAL_FORMATS:
        raise FileNotFoundError(f"data file {source!r} does not exist")
    return list(datasets.load_dataset(source, split=split))


def row_text(row, skipped: collections.Counter) -> tuple[str, str] | None:
    """(instruction, output) of a good row, else None with the reason counted in `skipped`."""
    if not isinstance(row, dict):
        skipped["not_an_object"] += 1
        return None
    instruction, output = row.get("instruction"), row.get("output")
    if instruction is None:
        skipped["missing_instruction"] += 1
        return None
    if output is None:
        skipped["missing_output"] += 1
        return None
    if not isinstance(instruction, str) or not isinstance(output, str):
        skipped["not_a_string"] += 1
        return None
    extra = row.get("input")
    if isinstance(extra, str) and extra.strip():
        instruction = f"{instruction}\n{extra}"
    if not instruction.strip():
        skipped["empty_instruction"] += 1
        return None
    if not output.strip():
        skipped["empty_answer"] += 1
        return None
    return instruction, output


def tokenize_row(tokenizer, instruction: str, output: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids). With a chat template the instruction is the user turn and the answer
    follows the generation prompt; without one the prompt gets the tokenizer's special tokens (BOS)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
        )
        prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prefix = tokenizer(instruction, add_special_tokens=True)["input_ids"]
    answer = tokenizer(output, add_special_tokens=False)["input_ids"]
    return list(prefix), list(answer)


def truncate(prefix: list, answer: list, max_length: int, max_answer: int) -> tuple[list, list]:
    """Cap the answer at `max_answer` tokens, then the whole at `max_length` by cutting the middle of the
    prompt (its start, with the instructions, and its end, with the question, are kept)."""
    answer = answer[:max_answer]
    room = max_length - len(answer)
    if len(prefix) > room:
        head = room // 2
        prefix = prefix[:head] + prefix[len(prefix) - (room - head) :]
    return prefix, answer


def build_examples(
    source: str | list,
    tokenizer,
    max_length: int = 10240,
    max_answer: int = 512,
    split: str = "train",
    limit: int | None = None,
    progress: bool = True,
) -> tuple[list[Example], collections.Counter]:
    """Tokenized examples and the count of skipped rows by reason. `source` is what `load_rows` reads, or
    the rows themselves (e.g. `kvjax.tasks.longalpaca.real_text_rows`)."""
    from tqdm import tqdm

    if max_answer < 1 or max_length <= max_answer:
        raise ValueError(f"need 1 <= max_answer < max_length, got max_answer={max_answer}, max_length={max_length}")
    skipped: collections.Counter = collections.Counter()
    rows = load_rows(source, split, skipped) if isinstance(source, (str, os.PathLike)) else list(source)
    examples = []
    for row in tqdm(rows, desc="tokenizing", disable=not progress, unit="row"):
        text = row_text(row, skipped)
        if text is None:
            continue
        prefix, answer = tokenize_row(tokenizer, *text)
        if not answer:
            skipped["empty_answer_tokens"] += 1
            continue
        if not prefix:
            skipped["empty_prompt_tokens"] += 1
            continue
        prefix, answer = truncate(prefix, answer, max_length, max_answer)
        examples.append(Example(np.asarray(prefix, np.int32), np.asarray(answer, np.int32)))
        if limit is not None and len(examples) >= limit:
            break
    return examples, skipped


def padded_width(n: int, chunk: int) -> int:
    """Padded width: a power of two (at least 8) up to `chunk`, then a multiple of `chunk` (few compiles)."""
    if n > chunk:
        return -(-n // chunk) * chunk
    width = 8
    while width < n:
        width *= 2
    return min(width, chunk)


def make_batch(examples: list[Example], chunk_size: int):
    """A `kvjax.locret.labels.Batch` (numpy) of `examples`, left-aligned and padded to bucketed widths."""
    from kvjax.locret.labels import Batch

    Tp = padded_width(max(len(e.prefix) for e in examples), chunk_size)
    A = padded_width(max(len(e.answer) for e in examples), 1 << 30)
    prefix = np.zeros((len(examples), Tp), np.int32)
    answer = np.zeros((len(examples), A), np.int32)
    for i, e in enumerate(examples):
        prefix[i, : len(e.prefix)] = e.prefix
        answer[i, : len(e.answer)] = e.answer
    lens = lambda key: np.asarray([len(getattr(e, key)) for e in examples], np.int32)
    return Batch(prefix, lens("prefix"), answer, lens("answer"))


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The example order of one epoch: a permutation fixed by (seed, epoch), so a resumed run sees the
    same examples at the same steps."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
    """Example indices of 0-based `step`."""
    out = []
    for j in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(j, num_examples)
        out.append(int(epoch_order(num_examples, seed, epoch)[offset]))
    return out
