"""Adaptive Quest against fixed-budget Quest at equal pages read, on the shipped model's multi-key task.

Fixed Quest reads `budget / 16 - 1` scored pages per head plus the current one; adaptive Quest reads per
head the fewest pages whose estimated mass reaches `top_p` (capped by its `token_budget`). Both are run
through the retrieval protocol (question fed by decode), and every decode step counts the pages each head
of each selecting layer reads (`kvjax.policies.page_reads`). The comparison: for each adaptive point, the
pages fixed Quest needs for at least the same accuracy (its smallest budget that reaches it), and how many
fewer adaptive Quest read.

    python -m eval.quest_adaptive                # writes ./kvjax-results/quest_adaptive/quest_adaptive.{json,md}
    python -m eval.quest_adaptive --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax

from . import retrieval
from ._report import default_out, machine_info, markdown_table, write_outputs
from .sweep import DEFAULT_DENSE_LAYERS


def run(model, length: int, samples: int, records: int, budgets, top_ps, cap: int, dense_layers: int, seed: int,
        task: str = "multikey", min_pages: int = 1) -> dict:
    import kvjax
    from kvjax.policies.page_reads import PageReads, counting

    points = [("quest", b, None) for b in budgets] + [("quest_adaptive", cap, p) for p in top_ps]
    rows = []
    for name, budget, top_p in points:
        options = {"token_budget": budget, "dense_layers": dense_layers}
        if top_p is not None:
            options.update(top_p=top_p, min_pages=min_pages)
        tally = PageReads()
        started = time.perf_counter()
        scored = retrieval.run_task(model, counting(kvjax.make_policy(name, **options), tally), task, length, samples,
                                    seed, records)
        rows.append({"policy": name, "budget": budget, "top_p": top_p, "accuracy": retrieval.accuracy(scored),
                     "pages_read": tally.mean, "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr)
        jax.clear_caches()  # every point compiles its own steps (a new tally each)
    fixed = sorted((r for r in rows if r["policy"] == "quest"), key=lambda r: r["pages_read"])
    for row in rows:
        if row["policy"] != "quest_adaptive":
            continue
        # the fewest pages fixed Quest reads at no lower accuracy
        enough = [r for r in fixed if r["accuracy"] >= row["accuracy"]]
        row["fixed_pages_same_accuracy"] = enough[0]["pages_read"] if enough else None
        row["fewer_pages"] = 1 - row["pages_read"] / enough[0]["pages_read"] if enough else None
    return {"machine": machine_info(), "task": task, "length": length, "samples": samples, "records": records,
            "cap": cap, "min_pages": min_pages, "dense_layers": dense_layers, "seed": seed, "rows": rows}


def table(result: dict) -> str:
    rows = [[r["policy"], r["budget"], "" if r["top_p"] is None else r["top_p"], f"{100 * r['accuracy']:.0f}%",
             f"{r['pages_read']:.2f}",
             "" if r.get("fixed_pages_same_accuracy") is None else f"{r['fixed_pages_same_accuracy']:.2f}",
             "" if r.get("fewer_pages") is None else f"{100 * r['fewer_pages']:.0f}%"] for r in result["rows"]]
    head = (f"**{result['task']}**, {result['length']} tokens, {result['records']} records, {result['samples']} "
            f"samples; pages read per head and decode step (current page included), layers >= {result['dense_layers']}\n\n")
    return head + markdown_table(
        ["policy", "token_budget", "top_p", "accuracy", "pages read", "fixed Quest pages, same accuracy", "fewer pages"],
        rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
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
                 args.dense_layers, args.seed, min_pages=args.min_pages)
    result["model"] = args.model
    text = table(result)
    paths = write_outputs(args.out, "quest_adaptive", result, text)
    print(text)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
