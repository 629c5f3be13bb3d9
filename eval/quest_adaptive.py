"""Adaptive Quest against fixed-budget Quest at equal pages read, on the shipped model's multi-key task or a
real model's real-text tasks.

Fixed Quest reads `budget / 16 - 1` scored pages per head plus the current one; adaptive Quest reads per
head the fewest pages whose estimated mass reaches `top_p` (capped by its `token_budget`). Both are run
through the retrieval protocol (question fed by decode), and every decode step counts the pages each head
of each selecting layer reads (`kvjax.policies.page_reads`). The comparison: for each adaptive point, the
pages fixed Quest needs for at least the same accuracy (its smallest budget that reaches it), and how many
fewer adaptive Quest read.

    python -m eval.quest_adaptive                # ./kvjax-results/quest_adaptive/quest_adaptive_multikey_2048.{json,md}
    python -m eval.quest_adaptive --model smollm2-135m --task real_passkey --dense-layers 2
    python -m eval.quest_adaptive --quick

Quest only selects pages, so every point of a batch is derived from one shared prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tqdm import tqdm

from .lib import retrieval
from .lib.policies import DEFAULT_DENSE_LAYERS
from .lib.report import default_out, machine_info, markdown_table, write_outputs


def run(model, length: int, samples: int, records: int, budgets, top_ps, cap: int, dense_layers: int, seed: int,
        task: str = "multikey", min_pages: int = 1, batch_size: int = 8) -> dict:
    import kvjax
    from kvjax.policies.page_reads import PageReads, counting

    points = [("quest", b, None) for b in budgets] + [("quest_adaptive", cap, p) for p in top_ps]
    policies, tallies = {}, {}
    for index, (name, budget, top_p) in enumerate(points):
        options = {"token_budget": budget, "dense_layers": dense_layers}
        if top_p is not None:
            options.update(top_p=top_p, min_pages=min_pages)
        tallies[index] = PageReads()
        policies[index] = counting(kvjax.make_policy(name, **options), tallies[index])
    # Quest only selects, so every point is derived from one shared prefill per batch
    started = time.perf_counter()
    prompts = retrieval.task_samples(model, task, length, num_samples=samples, seed=seed, num_records=records)
    scores = {index: [] for index in policies}
    for start in tqdm(range(0, len(prompts), batch_size), desc=f"quest_adaptive {task} {length}"):
        answered = retrieval.answer_shared(model, policies, prompts[start : start + batch_size], task, length)
        for index, records_ in answered.items():
            scores[index] += records_
    seconds = round(time.perf_counter() - started, 1)
    rows = [{"policy": name, "budget": budget, "top_p": top_p, "accuracy": retrieval.accuracy(scores[index]),
             "pages_read": tallies[index].mean} for index, (name, budget, top_p) in enumerate(points)]
    fixed = sorted((r for r in rows if r["policy"] == "quest"), key=lambda r: r["pages_read"])
    for row in rows:
        if row["policy"] != "quest_adaptive":
            continue
        # the fewest pages fixed Quest reads at no lower accuracy
        enough = [r for r in fixed if r["accuracy"] >= row["accuracy"]]
        row["fixed_pages_same_accuracy"] = enough[0]["pages_read"] if enough else None
        row["fewer_pages"] = 1 - row["pages_read"] / enough[0]["pages_read"] if enough else None
    return {"machine": machine_info(), "task": task, "length": length, "samples": samples, "records": records,
            "cap": cap, "min_pages": min_pages, "dense_layers": dense_layers, "seed": seed, "rows": rows,
            "seconds": seconds}


def table(result: dict) -> str:
    rows = [[r["policy"], r["budget"], "" if r["top_p"] is None else r["top_p"], f"{100 * r['accuracy']:.0f}%",
             f"{r['pages_read']:.2f}",
             "" if r.get("fixed_pages_same_accuracy") is None else f"{r['fixed_pages_same_accuracy']:.2f}",
             "" if r.get("fewer_pages") is None else f"{100 * r['fewer_pages']:.0f}%"] for r in result["rows"]]
    records = f"{result['records']} records, " if result["task"] == "multikey" else ""
    head = (f"**{result['task']}** on {result.get('model', 'tiny')}, {result['length']} tokens, {records}{result['samples']} "
            f"samples; pages read per head and decode step (current page included), layers >= {result['dense_layers']}\n\n")
    return head + markdown_table(
        ["policy", "token_budget", "top_p", "accuracy", "pages read", "fixed Quest pages, same accuracy", "fewer pages"],
        rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--task", default="multikey", choices=list(retrieval.TASKS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--budgets", nargs="+", type=int, default=[48, 64, 96, 128, 192, 256, 512])
    parser.add_argument("--top-p", nargs="+", type=float, default=[0.5, 0.7, 0.8, 0.9, 0.95, 0.99])
    parser.add_argument("--cap", type=int, default=512, help="adaptive Quest's token_budget (its most pages)")
    parser.add_argument("--min-pages", type=int, default=1, help="adaptive Quest's fewest pages per head")
    parser.add_argument("--dense-layers", type=int, default=DEFAULT_DENSE_LAYERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 8 samples, two points each")
    parser.add_argument("--out", default=default_out("quest_adaptive"))
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.samples, args.budgets, args.top_p = 1024, 8, [64, 256], [0.5, 0.9]

    import kvjax

    model = kvjax.load_model(args.model)
    result = run(model, args.length, args.samples, args.records, args.budgets, args.top_p, args.cap,
                 args.dense_layers, args.seed, task=args.task, min_pages=args.min_pages)
    result["model"] = args.model
    text = table(result)
    paths = write_outputs(args.out, f"quest_adaptive_{args.task}_{args.length}", result, text)
    print(text)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
