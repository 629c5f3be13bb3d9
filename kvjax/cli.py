"""The `kvjax` command line: `kvjax generate` (more subcommands arrive with their issues)."""

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
