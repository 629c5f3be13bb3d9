"""The `kvjax` command line: `generate`, `demo`, `eval`, `bench` and `train`.

    kvjax demo                                   # shipped model, retrieval under several policies (~2 min)
    kvjax generate --prompt "..." [--policy quest --policy-option token_budget=64]
    kvjax eval multikey --policy quest --budget 128 --length 2048 --json
    kvjax bench sweep --lengths 2048 --budgets 64 128 --json     # any eval/bench_*.py program, or sweep
    kvjax train locret --model DIR --data FILE ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources

DEFAULT_MODEL = "tiny"  # the model shipped in kvjax/assets/tiny-llama


def shipped_model_dir() -> str:
    return str(resources.files("kvjax") / "assets" / "tiny-llama")


def resolve_model_path(name: str) -> str:
    return shipped_model_dir() if name == DEFAULT_MODEL else name


def enable_compilation_cache() -> str:
    """Use JAX's persistent compilation cache, so a second run of the same command does not compile again."""
    import jax

    cache_dir = os.environ.get("KVJAX_COMPILATION_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "kvjax", "jax"))
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


def _policy_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--policy-option expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def cmd_generate(args) -> int:
    enable_compilation_cache()
    import kvjax

    if args.prompt is None and args.prompt_file is None:
        raise SystemExit("give --prompt TEXT or --prompt-file FILE")
    prompt = args.prompt
    if args.prompt_file is not None:
        with open(args.prompt_file) as f:
            prompt = f.read()
    started = time.perf_counter()
    model = kvjax.load_model(resolve_model_path(args.model), dtype=args.dtype)
    loaded = time.perf_counter()
    policy = kvjax.make_policy(args.policy, **_policy_options(args.policy_option))
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; kvjax generate needs one to read --prompt")
    ids = model.tokenizer(prompt)["input_ids"]
    tokens = kvjax.generate(
        model, [ids], args.max_new_tokens, policy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, page_size=args.page_size, chunk_size=args.chunk_size, decode_last=args.decode_last,
    )[0]
    finished = time.perf_counter()
    new_ids = [int(t) for t in tokens if t >= 0]
    text = model.tokenizer.decode(new_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "model": args.model, "policy": args.policy, "prompt_tokens": len(ids), "new_tokens": len(new_ids),
            "token_ids": new_ids, "text": text, "load_s": round(loaded - started, 3),
            "generate_s": round(finished - loaded, 3),
        }))
    else:
        print(text)
        print(
            f"[{len(ids)} prompt tokens, {len(new_ids)} new, policy {args.policy}; load {loaded - started:.2f}s, "
            f"generate {finished - loaded:.2f}s incl. compile]",
            file=sys.stderr,
        )
    return 0


BENCHMARKS = {
    "decode": "eval.bench_decode", "policies": "eval.bench_policies", "attention": "eval.bench_attention",
    "serving": "eval.bench_serving", "memory": "eval.bench_memory", "sweep": "eval.sweep",
    "cacheclip": "eval.bench_cacheclip", "model-accuracy": "eval.model_accuracy",
    "locret-quality": "eval.locret_quality",
}
TRAINERS = {"locret": "train.locret", "default-model": "train.train_default_model"}
EVAL_TASKS = ("passkey", "multikey", "perplexity", "longbench")


def _emit(args, result: dict, text: str) -> None:
    print(json.dumps(result) if args.json else text)


def cmd_demo(args) -> int:
    from kvjax.demo import main as demo_main

    return demo_main(args)


def _eval_policy(args):
    from eval.sweep import build_policy

    return build_policy(args.policy, args.budget, args.dense_layers)


def cmd_eval(args) -> int:
    enable_compilation_cache()
    import kvjax

    model = kvjax.load_model(resolve_model_path(args.model), dtype=args.dtype)
    policy = _eval_policy(args)
    if args.task in ("passkey", "multikey"):
        from eval import retrieval

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
        from eval.perplexity import decode_perplexity, read_text_tokens

        if not args.text:
            raise ValueError("kvjax eval perplexity needs --text FILE (a local text file, e.g. a PG19 book)")
        ids = read_text_tokens(args.text, model.tokenizer, args.max_tokens)
        result = decode_perplexity(model, policy, ids, args.prefix_tokens, progress=not args.json)
        text = f"perplexity {result['perplexity']:.3f} over {result['tokens']} tokens ({args.policy})"
    else:
        from eval.longbench import run_longbench

        if not (args.data and args.longbench_task):
            raise ValueError("kvjax eval longbench needs --longbench-task NAME and --data FILE.jsonl")
        result = run_longbench(model, policy, args.longbench_task, args.data, args.max_prompt_tokens,
                               args.max_samples, progress=not args.json)
        text = (f"{args.longbench_task} ({args.policy}): {result['score']:.2f} over {result['samples']} samples "
                f"({result['skipped_rows']} bad rows skipped)")
    _emit(args, result, text)
    return 0


def _run_module_main(module_name: str, argv: list[str], as_json: bool) -> int:
    import contextlib
    import importlib

    module = importlib.import_module(module_name)
    if as_json:
        with contextlib.redirect_stdout(sys.stderr):
            result = module.main(argv)
        if not isinstance(result, dict):
            raise ValueError(f"{module_name}.main returned no result to print as JSON")
        print(json.dumps(result, default=str))
    else:
        module.main(argv)
    return 0


def cmd_bench(args) -> int:
    # `--json` may come before or after the benchmark's own options (argparse.REMAINDER keeps the latter)
    as_json = args.json or "--json" in args.rest
    return _run_module_main(BENCHMARKS[args.name], [a for a in args.rest if a != "--json"], as_json)


def cmd_train(args) -> int:
    import importlib

    importlib.import_module(TRAINERS[args.what]).main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax", description="Long-context KV-cache compression in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="local HF model directory, or 'tiny' (shipped; default)")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--policy", default="full", help="cache policy name (kvjax.make_policy)")
    gen.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE", help="policy option, repeatable")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--chunk-size", type=int, default=512)
    gen.add_argument("--decode-last", type=int, default=0, help="feed the last N prompt tokens as decode steps")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="retrieval accuracy and decode speed of several policies on the shipped model")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--length", type=int, default=2048)
    demo.add_argument("--budget", type=int, default=128)
    demo.add_argument("--samples", type=int, default=16, help="samples per task and policy")
    demo.add_argument("--records", type=int, default=4, help="records in the multi-key task")
    demo.add_argument("--policies", nargs="+", default=None)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="one evaluation task under one policy")
    ev.add_argument("task", choices=EVAL_TASKS)
    ev.add_argument("--model", default=DEFAULT_MODEL)
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
    ev.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="run a benchmark program (eval/bench_NAME.py or the sweep)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", action="store_true", help="print the result JSON on stdout (tables go to stderr)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=cmd_bench)

    train = sub.add_parser("train", help="train retaining heads (locret) or the shipped default model")
    train.add_argument("what", choices=sorted(TRAINERS))
    train.add_argument("rest", nargs=argparse.REMAINDER, help="the trainer's own options")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvjax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
