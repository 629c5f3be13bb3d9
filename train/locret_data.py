"""Write the offline LongAlpaca-format training file of real text for Locret's heads (a jsonl file).

    python -m train.locret_data --model smollm2-135m --out data/locret_real_text.jsonl --rows 600 --lengths 2048 4096 8192
    python -m train.locret_data --model smollm2-135m --out rows.jsonl --corpus books/ --kinds continue

The recipe is `kvjax.tasks.longalpaca.real_text_rows` (documented there): row i, seeded by (seed, i), is a
window of `lengths[i % len(lengths)]` tokens of real text (Debian's licence texts, or `--corpus`, a text file
or a directory of .txt files) and a question whose answer is a span of it (`continue` a quoted sentence,
or quote the sentence `next` to a quoted one). Only the model's tokenizer is used (window lengths are in its
tokens). `kvjax train locret --data kvjax:real-text` builds the same rows in memory.

`--recipe needles` writes `kvjax.tasks.longalpaca.needle_rows` instead: the real-text needle tasks
(`--tasks`, RULER's multi-key and multi-value needles by default) as rows, seeded by (seed, i), for heads
trained to keep needles (documented there; keep `--seed` apart from the evaluation's seed 0).

    python -m train.locret_data --recipe needles --model smollm2-135m --out rows.jsonl --rows 300 --lengths 1024 2048 --seed 1000
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> str:
    from kvjax.tasks.longalpaca import NEEDLE_TRAINING_TASKS, QUESTIONS, REAL_TEXT_KINDS
    from kvjax.tasks.needles import TASKS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="whose tokenizer measures the windows: HF directory, .gguf, tiny or a name")
    p.add_argument("--out", required=True, help="jsonl file to write")
    p.add_argument("--recipe", choices=["real-text", "needles"], default="real-text",
                   help="real-text: span questions on real text; needles: the needle tasks as rows")
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="document lengths in tokens (cycled)")
    p.add_argument("--kinds", nargs="+", choices=sorted(QUESTIONS), default=list(REAL_TEXT_KINDS), help="question kinds (cycled)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(NEEDLE_TRAINING_TASKS),
                   help="needle tasks (cycled; --recipe needles)")
    p.add_argument("--min-answer", type=int, default=8, help="answer tokens, at least")
    p.add_argument("--max-answer", type=int, default=64, help="answer tokens, at most")
    p.add_argument("--corpus", default=None, help="a text file or directory of .txt files (default: Debian's licence texts)")
    p.add_argument("--seed", type=int, default=None, help="default 0 (real-text), 1000 (needles)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    import kvjax
    from kvjax.tasks import real_text
    from kvjax.tasks.longalpaca import needle_rows, real_text_rows, write_jsonl

    tokenizer = kvjax.load_model(args.model).tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model!r} has no tokenizer; the recipe measures windows in its tokens")
    corpus = real_text.load_corpus(args.corpus)
    if args.recipe == "needles":
        seed = 1000 if args.seed is None else args.seed
        rows = needle_rows(tokenizer, args.rows, args.lengths, seed, args.tasks, corpus, progress=not args.no_progress)
    else:
        seed = 0 if args.seed is None else args.seed
        rows = real_text_rows(tokenizer, args.rows, args.lengths, seed, args.kinds, corpus, args.min_answer,
                              args.max_answer, progress=not args.no_progress)
    path = write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} rows to {path} (corpus {corpus.fingerprint}: {', '.join(corpus.sources[:3])}"
          f"{', ...' if len(corpus.sources) > 3 else ''})", file=sys.stderr)
    return path


if __name__ == "__main__":
    print(main())
