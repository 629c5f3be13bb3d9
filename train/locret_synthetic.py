"""Synthetic long-document QA in LongAlpaca's format, for training retaining heads on the shipped model.

Each row is `{"instruction": document + question, "output": answer}` like LongAlpaca-12k, with the
document and question from `kvjax.tasks.synthetic.multikey_sample` (records hidden in filler, one asked).

    python -m train.locret_synthetic --out data/locret_multikey.jsonl --rows 400
"""

from __future__ import annotations

import argparse

import numpy as np

from kvjax.tasks.longalpaca import multikey_rows, write_jsonl


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="jsonl file to write")
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--lengths", type=int, nargs="+", default=[900, 1900], help="document lengths in tokens (cycled)")
    p.add_argument("--records", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = multikey_rows(np.random.default_rng(args.seed), args.rows, tuple(args.lengths), args.records)
    return write_jsonl(rows, args.out)


if __name__ == "__main__":
    print(main())
