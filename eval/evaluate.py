"""`kvjax eval TASK`: one evaluation task (passkey, multi-key, perplexity, LongBench) under one policy.

    kvjax eval multikey --policy quest --budget 128 --length 2048 --json
    kvjax eval perplexity --text book.txt --policy streaming --budget 256
    kvjax eval niah_single --model smollm2-135m --policy quest --budget 256 --length 2048
"""

from __future__ import annotations

import argparse
import json

from .lib import longbench, retrieval
from .lib.perplexity import decode_perplexity, read_text_tokens
from .lib.policies import build_policy

RETRIEVAL_TASKS = retrieval.TASKS

TASKS = RETRIEVAL_TASKS + ("perplexity", "longbench")


def build_parser() -> argparse.ArgumentParser:
    ev = argparse.ArgumentParser(prog="kvjax eval", description=__doc__.split("\n\n")[0])
    ev.add_argument("task", choices=TASKS)
    ev.add_argument("--model", default="tiny", help="'tiny' (shipped; default), a fetched name, or a local path")
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ev.add_argument("--policy", default="full")
    ev.add_argument("--budget", type=int, default=128, help="token_budget of a budgeted policy")
    ev.add_argument("--dense-layers", type=int, default=1, help="uncompressed first layers (1 suits the shipped model)")
    ev.add_argument("--length", type=int, nargs="+", default=[2048], help="prompt lengths (retrieval tasks)")
    ev.add_argument("--samples", type=int, default=50)
    ev.add_argument("--records", type=int, default=4, help="multikey: records in the context")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--text", help="perplexity: local text file")
    ev.add_argument("--max-tokens", type=int, default=4096, help="perplexity: tokens of the text to score")
    ev.add_argument("--prefix-tokens", type=int, default=1, help="perplexity: tokens prefilled before decoding")
    ev.add_argument("--longbench-task", help="longbench: narrativeqa, qasper, multifieldqa_en, hotpotqa, gov_report, triviaqa")
    ev.add_argument("--data", help="longbench: local jsonl file in LongBench's format")
    ev.add_argument("--max-prompt-tokens", type=int, default=4096)
    ev.add_argument("--max-samples", type=int, default=None)
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    return ev


def run(args) -> tuple[dict, str]:
    """The task's result (a dict) and a one-line summary per length."""
    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    model = kvjax.load_model(args.model, dtype=args.dtype)
    policy = build_policy(args.policy, args.budget, args.dense_layers)
    if args.task in RETRIEVAL_TASKS:
        rows = []
        for n in args.length:
            records = retrieval.run_task(model, policy, args.task, n, args.samples, args.seed, args.records)
            rows.append({"length": n, "accuracy": retrieval.accuracy(records),
                         "by_depth": retrieval.accuracy_by_depth(records), "samples": len(records),
                         "records": retrieval.as_dicts(records)})
        result = {"task": args.task, "policy": args.policy, "budget": args.budget, "dense_layers": args.dense_layers,
                  "num_records": args.records if args.task == "multikey" else None, "results": rows}
        text = "\n".join(f"{args.task} {r['length']} tokens, {args.policy}: {100 * r['accuracy']:.1f}% of "
                         f"{r['samples']} (by depth {r['by_depth']})" for r in rows)
    elif args.task == "perplexity":
        if not args.text:
            raise ValueError("kvjax eval perplexity needs --text FILE (a local text file, e.g. a PG19 book)")
        ids = read_text_tokens(args.text, model.tokenizer, args.max_tokens)
        result = decode_perplexity(model, policy, ids, args.prefix_tokens, progress=not args.json)
        text = f"perplexity {result['perplexity']:.3f} over {result['tokens']} tokens ({args.policy})"
    else:
        if not (args.data and args.longbench_task):
            raise ValueError("kvjax eval longbench needs --longbench-task NAME and --data FILE.jsonl")
        result = longbench.run_longbench(model, policy, args.longbench_task, args.data, args.max_prompt_tokens,
                               args.max_samples, progress=not args.json)
        text = (f"{args.longbench_task} ({args.policy}): {result['score']:.2f} over {result['samples']} samples "
                f"({result['skipped_rows']} bad rows skipped)")
    return result, text


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    result, text = run(args)
    print(json.dumps(result) if args.json else text)
    return result
