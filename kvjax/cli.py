"""The `kvjax` command line: `generate`, `prefill`, `fetch` and `serve`, and `demo`, `eval`, `bench`, `train`
(the programs under `eval/` and `train/`, run by module name).

Notes: docs/modules.md (`kvjax/cli.py`)."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_MODEL = "tiny"  # the model shipped in kvjax/assets/tiny-llama


def cmd_generate(args) -> int:
    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache
    from kvjax.policies.options import parse_spec

    if args.mesh:  # join the multi-process runtime (kvjax.distributed.launch) before any JAX computation
        from kvjax import distributed as dist

        dist.initialize()
    if args.state is not None:
        return cmd_generate_from_state(args)
    enable_compilation_cache()

    if args.prompt is None and args.prompt_file is None:
        raise SystemExit("give --prompt TEXT or --prompt-file FILE")
    prompt = args.prompt
    if args.prompt_file is not None:
        with open(args.prompt_file) as f:
            prompt = f.read()
    started = time.perf_counter()
    policy = parse_spec(args.policy, page_size=args.page_size, options=args.policy_option)
    model = kvjax.load_model(args.model, dtype=args.dtype)
    loaded = time.perf_counter()
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; kvjax generate needs one to read --prompt")
    if args.chat:
        if not getattr(model.tokenizer, "chat_template", None):
            raise SystemExit(f"{args.model}'s tokenizer has no chat template; drop --chat")
        messages = [{"role": "user", "content": prompt}]
        ids = list(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    else:
        ids = model.tokenizer(prompt)["input_ids"]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    page_size=args.page_size, chunk_size=args.chunk_size, decode_last=args.decode_last)
    if args.mesh:
        import jax

        from kvjax.engine.api import check_context

        check_context(model.cfg, len(ids), args.max_new_tokens, args.allow_longer_context)
        tokens = dist.generate_sharded(model, [ids], args.max_new_tokens, policy, mesh=dist.mesh_from_text(args.mesh),
                                       **sampling)[0]
        if jax.process_index() != 0:  # every process holds the same tokens: one prints them
            return 0
    else:
        tokens = kvjax.generate(model, [ids], args.max_new_tokens, policy, allow_longer_context=args.allow_longer_context,
                                progress=not args.json, **sampling)[0]
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


def _read_prompt(args) -> str:
    if args.prompt is None and args.prompt_file is None:
        raise SystemExit("give --prompt TEXT or --prompt-file FILE")
    if args.prompt_file is None:
        return args.prompt
    with open(args.prompt_file) as f:
        return f.read()


def cmd_prefill(args) -> int:
    """Prefill and compress a document once and save its state (`kvjax.save_state`) for `generate --state`."""
    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache
    from kvjax.policies.options import parse_spec

    if args.mesh:  # the runtime first (kvjax.distributed.launch); saving gathers the state into this process
        import jax

        from kvjax import distributed as dist

        dist.initialize()
        mesh = dist.mesh_from_text(args.mesh)
        if jax.process_count() > 1 or mesh.shape["data"] != 1:
            raise SystemExit(f"kvjax prefill --mesh {args.mesh}: one document is one sequence, so the mesh is 1xM "
                             "(heads over M devices) in one process (the state is saved from host memory)")
    enable_compilation_cache()
    started = time.perf_counter()
    policy = parse_spec(args.policy, page_size=args.page_size, options=args.policy_option)
    model = kvjax.load_model(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; kvjax prefill needs one to read the document")
    ids = model.tokenizer(_read_prompt(args))["input_ids"]
    loaded = time.perf_counter()
    if args.mesh:  # each device prefills its kv heads; save_state merges the shards' pools into one
        from kvjax.engine.api import check_context

        check_context(model.cfg, len(ids), 0, args.allow_longer_context)
        state, logits, _ = dist.prefill_sharded(model, [ids], policy, mesh=mesh, page_size=args.page_size,
                                                chunk_size=args.chunk_size, max_new_tokens=args.room)
    else:
        state, logits = kvjax.prefill(model, [ids], policy, page_size=args.page_size, chunk_size=args.chunk_size,
                                      max_new_tokens=args.room, allow_longer_context=args.allow_longer_context,
                                      progress=not args.json)
    kvjax.save_state(state, args.save, model=model, policy=policy, logits=logits, model_name=args.model)
    header = kvjax.read_header(args.save)
    report = {"state": args.save, "model": args.model, "policy": header["policy"], "prompt_tokens": len(ids),
              "pages": header["pages"], "room": header["room"], "devices": len(state.k_pages.sharding.device_set),
              "load_s": round(loaded - started, 3),
              "prefill_s": round(time.perf_counter() - loaded, 3)}
    print(json.dumps(report) if args.json else
          f"saved {args.save}: {len(ids)} tokens, {header['pages']} pages of {header['page_dtype']}, room for "
          f"{header['room']} more tokens; prefill {report['prefill_s']:.2f}s incl. compile")
    return 0


def cmd_generate_from_state(args) -> int:
    """`generate --state DIR`: the prompt is the question, fed by decode to the saved (compressed) document."""
    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache
    from kvjax.policies.options import parse_policy_options

    enable_compilation_cache()
    started = time.perf_counter()
    header = kvjax.read_header(args.state)
    name = header["model"]["name"] if args.model == DEFAULT_MODEL and header["model"]["name"] else args.model
    model = kvjax.load_model(name, dtype=header["model"]["dtype"])
    data = parse_policy_options(header["policy"]["name"], args.policy_option)  # fields the spec leaves out
    if args.mesh:  # the state's sequences over the mesh's data axis, its kv heads over the model axis
        from kvjax import distributed as dist

        model, saved = dist.load_state_sharded(args.state, model, mesh=dist.mesh_from_text(args.mesh),
                                               extra_tokens=args.extra_tokens, pad_rows=True, once=True, **data)
    else:  # one question: decode takes the loaded buffers over instead of copying them
        saved = kvjax.load_state(args.state, model, extra_tokens=args.extra_tokens, once=True, **data)
    loaded = time.perf_counter()
    question = "" if args.prompt is None and args.prompt_file is None else _read_prompt(args)
    ids = model.tokenizer(question, add_special_tokens=False)["input_ids"] if question else []
    tokens = kvjax.generate_from_state(model, saved, ids, args.max_new_tokens, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)[0]
    finished = time.perf_counter()
    if args.mesh:
        import jax

        if jax.process_index() != 0:  # every process holds the same tokens: one prints them
            return 0
    new_ids = [int(t) for t in tokens if t >= 0]
    text = model.tokenizer.decode(new_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"state": args.state, "model": name, "policy": header["policy"], "question_tokens": len(ids),
                          "new_tokens": len(new_ids), "token_ids": new_ids, "text": text,
                          "load_s": round(loaded - started, 3), "generate_s": round(finished - loaded, 3)}))
    else:
        print(text)
        print(f"[state {args.state}: {len(ids)} question tokens, {len(new_ids)} new; load {loaded - started:.2f}s, "
              f"generate {finished - loaded:.2f}s incl. compile]", file=sys.stderr)
    return 0


# The command line dispatches to the programs by module name: the library never imports its programs.
BENCHMARKS = {  # speed, memory and compile time
    "decode": "kvjax.eval.bench_decode", "policies": "kvjax.eval.bench_policies",
    "attention": "kvjax.eval.bench_attention", "serving": "kvjax.eval.bench_serving",
    "memory": "kvjax.eval.bench_memory", "cacheclip": "kvjax.eval.bench_cacheclip",
    "compile": "kvjax.eval.bench_compile", "locret-labels": "kvjax.eval.bench_locret_labels",
    "suite": "kvjax.eval.suite", "compare": "kvjax.eval.compare", "dispatch": "kvjax.eval.bench_dispatch",
    "load": "kvjax.eval.bench_load", "device": "kvjax.eval.bench_device", "saved-state": "kvjax.eval.bench_saved_state",
}
EVALUATIONS = {  # accuracy, perplexity, what a policy keeps
    "sweep": "kvjax.eval.sweep", "model-accuracy": "kvjax.eval.model_accuracy",
    "locret-quality": "kvjax.eval.locret_quality", "perplexity-sweep": "kvjax.eval.perplexity",
    "trace-needle": "kvjax.eval.trace_needle", "locret-oracle": "kvjax.eval.locret_oracle",
}
# evaluations `kvjax bench` ran before `kvjax eval NAME` existed, by their old names (`kvjax eval perplexity` is
# evaluate.py's task)
MOVED_TO_EVAL = {name: name for name in EVALUATIONS} | {"perplexity": "perplexity-sweep"}
# benchmarks folded into another, by their old names: (the benchmark now run, the options put first)
FOLDED = {"real": ("decode", ["--model", "smollm2-135m"])}
TRAINERS = {"locret": "kvjax.train.locret", "default-model": "kvjax.train.train_default_model",
            "cacheclip-aux": "kvjax.train.cacheclip_aux"}
DEMO, EVALUATE = "kvjax.eval.demo", "kvjax.eval.evaluate"


def _run_program(module_name: str, argv: list[str], as_json: bool = False) -> int:
    """Run a program's `main(argv)`; with `as_json`, its tables go to stderr and its result dict to stdout."""
    import contextlib
    import importlib

    module = importlib.import_module(module_name)
    if not as_json:
        module.main(argv)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        result = module.main(argv)
    if not isinstance(result, dict):
        raise ValueError(f"{module_name}.main returned no result to print as JSON")
    print(json.dumps(result, default=str))
    return 0


def cmd_demo(args) -> int:
    return _run_program(DEMO, args.rest)


def cmd_eval(args) -> int:
    """`kvjax eval NAME ...` runs an evaluation program; `kvjax eval TASK ...` one task under one policy."""
    if args.rest and args.rest[0] in EVALUATIONS:
        return _run_program(EVALUATIONS[args.rest[0]], args.rest[1:])
    return _run_program(EVALUATE, args.rest)


def cmd_bench(args) -> int:
    # `--json` may come before or after the benchmark's own options (argparse.REMAINDER keeps the latter)
    as_json = args.json or "--json" in args.rest
    if args.name in MOVED_TO_EVAL:
        moved = MOVED_TO_EVAL[args.name]
        print(f"kvjax bench {args.name}: an evaluation, now `kvjax eval {moved}` (run as that)", file=sys.stderr)
    rest = [a for a in args.rest if a != "--json"]
    if args.name in FOLDED:
        name, first = FOLDED[args.name]
        first = [] if "--model" in rest else first
        print(f"kvjax bench {args.name}: runs `kvjax bench {' '.join([name, *first, *rest])}`", file=sys.stderr)
        return _run_program(BENCHMARKS[name], first + rest, as_json)
    module = BENCHMARKS.get(args.name) or EVALUATIONS[MOVED_TO_EVAL.get(args.name, args.name)]
    return _run_program(module, rest, as_json)


def cmd_train(args) -> int:
    return _run_program(TRAINERS[args.what], args.rest)


def cmd_fetch(args) -> int:
    from kvjax.models import hub

    if args.list or not args.name:
        for entry in hub.REGISTRY.values():
            where = hub.cached_path(entry.name)
            print(f"{entry.name}: {entry.description} [{where or 'not fetched: kvjax fetch ' + entry.name}]")
        return 0
    print(hub.fetch(args.name, progress=not args.quiet))
    return 0


def server_of(args):
    """The model and `ServerConfig` of `kvjax serve`'s arguments (with `--mesh 1xM`, heads over M devices)."""
    import kvjax
    from kvjax.policies.options import parse_spec
    from kvjax.serving.http import ServerConfig

    policy = parse_spec(args.policy, page_size=args.page_size, options=args.policy_option)
    model = kvjax.load_model(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype)
    backend = None
    if args.mesh:
        from kvjax import distributed as dist

        model, backend = dist.on_mesh(model, dist.mesh_from_text(args.mesh))
    config = ServerConfig(args.served_name or args.model, policy, args.max_context or model.cfg.max_position_embeddings,
                          chunk_size=args.chunk_size, page_size=args.page_size,
                          steps_per_dispatch=args.steps_per_dispatch, max_rows=args.max_rows, documents_dir=args.documents,
                          disk_cache_mb=args.disk_cache_mb, disk_cache_dir=args.disk_cache_dir,
                          prefix_cache_mb=args.prefix_cache_mb, prefill_chunks_per_step=args.prefill_chunks_per_step,
                          backend=backend)
    return model, config


def cmd_serve(args) -> int:
    from kvjax.util.compilation_cache import enable_compilation_cache
    from kvjax.serving.http import serve

    enable_compilation_cache()
    model, config = server_of(args)
    print(f"serving {config.model_name} ({args.policy}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(model, config, args.host, args.port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax", description="Long-context KV-cache compression in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help="'tiny' (shipped; default), a fetched name (kvjax fetch --list), a HF directory or a .gguf file")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--allow-longer-context", action="store_true",
                     help="run a prompt longer than the model's context (max_position_embeddings) instead of refusing it")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (instruct models)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--policy", default="full", help="cache policy: NAME[:KEY=VALUE,...] or EVICT+SELECT (kvjax.policies.parse_spec)")
    gen.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE", help="policy option, repeatable")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--chunk-size", type=int, default=512)
    gen.add_argument("--decode-last", type=int, default=0, help="feed the last N prompt tokens as decode steps")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                     help="generate over a device mesh, e.g. 1x8 (heads over 8 devices; with --state the saved state "
                          "loaded there); over several processes started by python -m kvjax.distributed.launch "
                          "(docs/sharding.md)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--state", default=None, metavar="DIR",
                     help="answer from a state saved by kvjax prefill: the prompt is the question, fed by decode "
                          "(--model defaults to the state's, its policy is the saved one)")
    gen.add_argument("--extra-tokens", type=int, default=None,
                     help="with --state: room for this many question and answer tokens (default: the saved room)")
    gen.set_defaults(func=cmd_generate)

    pre = sub.add_parser("prefill", help="prefill and compress a document once and save its state (generate --state)")
    pre.add_argument("--model", default=DEFAULT_MODEL, help="as for generate")
    pre_source = pre.add_mutually_exclusive_group()
    pre_source.add_argument("--prompt", help="document text")
    pre_source.add_argument("--prompt-file", help="file holding the document")
    pre.add_argument("--save", required=True, metavar="DIR", help="directory the state is saved into (replaced)")
    pre.add_argument("--policy", default="full", help="cache policy: NAME[:KEY=VALUE,...] or EVICT+SELECT (kvjax.policies.parse_spec)")
    pre.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE", help="policy option, repeatable")
    pre.add_argument("--room", type=int, default=256, help="tokens of question and answer the saved state has room for")
    pre.add_argument("--page-size", type=int, default=16)
    pre.add_argument("--chunk-size", type=int, default=512)
    pre.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    pre.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"], help="KV page dtype")
    pre.add_argument("--allow-longer-context", action="store_true")
    pre.add_argument("--mesh", default=None, metavar="1xM",
                     help="prefill with the kv heads split over M devices of this process (docs/sharding.md); the "
                          "state is saved as from one device")
    pre.add_argument("--json", action="store_true", help="print one JSON object")
    pre.set_defaults(func=cmd_prefill)

    demo = sub.add_parser("demo", add_help=False,
                          help="retrieval accuracy and decode speed of several policies (kvjax demo --help)")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="the demo's options")
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", add_help=False,
                        help=f"an evaluation: kvjax eval {{{','.join(sorted(EVALUATIONS))}}} ..., or one task under "
                             "one policy (kvjax eval --help)")
    ev.add_argument("rest", nargs=argparse.REMAINDER, help="the evaluation's name and options, or the task's options")
    ev.set_defaults(func=cmd_eval)

    fetch = sub.add_parser("fetch", help="download a registered real model into $KVJAX_HOME (kvjax fetch --list)")
    fetch.add_argument("name", nargs="?", help="registered model name, e.g. smollm2-135m")
    fetch.add_argument("--list", action="store_true", help="list the registered models and where they are")
    fetch.add_argument("--quiet", action="store_true", help="no progress bar")
    fetch.set_defaults(func=cmd_fetch)

    bench = sub.add_parser("bench", help="run a benchmark program (speed, memory, compile time; eval/bench_NAME.py)")
    bench.add_argument("name", choices=sorted(BENCHMARKS) + sorted(MOVED_TO_EVAL) + sorted(FOLDED))
    bench.add_argument("--json", action="store_true", help="print the result JSON on stdout (tables go to stderr)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=cmd_bench)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    srv.add_argument("--model", default=DEFAULT_MODEL, help="as for generate")
    srv.add_argument("--served-name", default=None, help="the model id clients send (default: --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--policy", default="full", help="the cache policy of requests without kv_policy (NAME[:KEY=VALUE,...] or EVICT+SELECT)")
    srv.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE", help="policy option, repeatable")
    srv.add_argument("--max-context", type=int, default=None, help="prompt + max_tokens, at most (default: the model's)")
    srv.add_argument("--chunk-size", type=int, default=512)
    srv.add_argument("--page-size", type=int, default=16)
    srv.add_argument("--steps-per-dispatch", type=int, default=16, help="decode steps per device call (streaming granularity)")
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    srv.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                     help="KV page dtype (default: --dtype); int8 keeps one float32 scale per slot")
    srv.add_argument("--max-rows", type=int, default=4,
                     help="requests decoded together per batch; each batch's pool holds this many full-context rows")
    srv.add_argument("--mesh", default=None, metavar="1xM",
                     help="split the model's heads (and each batch's KV pages) over M devices of this process")
    srv.add_argument("--prefix-cache-mb", type=int, default=256,
                     help="memory for prefill states at chunk boundaries, reused by prompts sharing whole chunks (0: off)")
    srv.add_argument("--prefill-chunks-per-step", type=int, default=0,
                     help="at most this many prefill chunks between two decode dispatches, so live requests keep "
                          "streaming while a long prompt prefills (0: whole prompts first)")
    srv.add_argument("--documents", default=None, metavar="DIR",
                     help="saved states (kvjax prefill --save DIR/ID) that requests name by id in kv_state, sending "
                          "only the question; kept in the --prefix-cache-mb budget")
    srv.add_argument("--disk-cache-mb", type=int, default=0,
                     help="a disk tier under the prefix cache: what its memory budget evicts is written there and "
                          "read back on a hit (0: none); /health reports its hit rate and bytes")
    srv.add_argument("--disk-cache-dir", default=None, help="the disk tier's folder (default: a temporary one)")
    srv.set_defaults(func=cmd_serve)

    train = sub.add_parser("train", help="train retaining heads (locret) or the shipped default model")
    train.add_argument("what", choices=sorted(TRAINERS))
    train.add_argument("rest", nargs=argparse.REMAINDER, help="the trainer's own options")
    train.set_defaults(func=cmd_train)
    return parser


# Commands whose whole argument list belongs to a program: argparse's REMAINDER does not take a list that
# starts with an option (`kvjax demo --model x` was refused), so these are passed on as they are.
PASS_THROUGH = ("demo", "eval")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:  # the program's own parser answers --help too
        args = argparse.Namespace(command=argv[0], rest=argv[1:])
        args.func = cmd_demo if argv[0] == "demo" else cmd_eval
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"kvjax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
