"""LongAlpaca-format rows (`{"instruction": document + question, "output": answer}`) built from kvjax's tasks.

Training data for retaining heads when LongAlpaca-12k itself cannot be had (no dataset hub here).
"""

from __future__ import annotations

import json
import os

import numpy as np

from kvjax.tasks.synthetic import digits, multikey_sample


def multikey_rows(rng: np.random.Generator, num_rows: int, lengths: tuple[int, ...], num_records: int = 4) -> list[dict]:
    """`num_rows` rows whose documents are about `lengths` tokens long (cycled)."""
    rows = []
    for i in range(num_rows):
        sample = multikey_sample(rng, lengths[i % len(lengths)], num_records)
        rows.append({"instruction": sample.prompt, "output": digits(sample.answer)})
    return rows


def write_jsonl(rows: list[dict], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
