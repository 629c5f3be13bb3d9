"""Peak memory of Locret's label generation (and optionally of a whole train step) against sequence length.

    python -m eval.bench_locret_labels                               # SmolLM2-135M, 2K / 4K / 8K prefix tokens
    python -m eval.bench_locret_labels --lengths 2048 --mode step --hidden 128 --dtype bfloat16

Each point is its own process (`--point LENGTH`) that loads the model, builds one sequence of LENGTH prefix
tokens and `--answer` answer tokens (random ids: memory does not depend on them), compiles
`kvjax.locret.labels.compute_targets` (or, `--mode step`, the jitted train step: labels, loss, gradient,
AdamW) and runs it once. It reports peak RSS (`VmHWM`, the process's high-water mark: model, compile and
run), the run's own peak (`VmHWM` reset after the compile, so loading the model and compiling do not
mask it) and how far it rose above the RSS it started from, the RSS before compiling, XLA's own plan for the program (`memory_analysis`: temporaries,
arguments, outputs), and, for scale, the bytes of the targets (features + labels) and of the paged cache
the labels need, which grow linearly, against one layer's `[Hq, T, T]` float32 score tensor, which the
blocked label step never builds. `--compile-only` reports XLA's plan without running the program. Writes locret_labels.{json,md} under --out (default
./kvjax-results/locret_labels).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from .lib.report import default_out, machine_info, markdown_table, reset_peak_rss, rss_mib, write_outputs


def run_point(args, length: int) -> dict:
    """One measurement in this process (call it in a fresh one)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kvjax
    from kvjax.locret import HeadsConfig, init_heads
    from kvjax.locret.data import Example, make_batch
    from kvjax.locret.labels import compute_targets
    from kvjax.locret.training import make_optimizer, make_train_step

    model = kvjax.load_model(args.model, dtype=args.dtype)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    example = Example(rng.integers(4, cfg.vocab_size, length).astype(np.int32),
                      rng.integers(4, cfg.vocab_size, args.answer).astype(np.int32))
    batch = jax.tree_util.tree_map(jnp.asarray, make_batch([example], args.chunk))
    if args.mode == "labels":
        fn = jax.jit(lambda p, b: compute_targets(p, b, cfg=cfg, dtype=model.dtype, chunk_size=args.chunk))
        call_args = (model.params, batch)
    else:
        heads = init_heads(HeadsConfig.for_model(cfg, args.hidden)).params
        optimizer = make_optimizer(total_steps=10, warmup_steps=1)
        fn = make_train_step(optimizer, cfg=cfg, dtype=model.dtype, chunk_size=args.chunk)
        call_args = (heads, optimizer.init(heads), model.params, batch)
    jax.block_until_ready(call_args)
    rss_before = rss_mib("VmRSS")
    began = time.perf_counter()
    compiled = fn.lower(*call_args).compile()
    compile_s = time.perf_counter() - began
    plan = compiled.memory_analysis()
    run_s, run_peak, rss_after_compile = None, None, rss_mib("VmRSS")
    if not args.compile_only:
        load_and_compile_peak = rss_mib("VmHWM")
        reset_peak_rss()
        began = time.perf_counter()
        jax.block_until_ready(compiled(*call_args))
        run_s = time.perf_counter() - began
        run_peak = rss_mib("VmHWM")
        peak = max(load_and_compile_peak, run_peak)
    else:
        peak = rss_mib("VmHWM")

    item = jnp.dtype(model.dtype).itemsize
    L, Hq, H, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    Tp, A = batch.prefix.shape[1], batch.answer.shape[1]
    return {
        "model": args.model, "mode": args.mode, "dtype": args.dtype, "prefix_tokens": length, "answer_tokens": args.answer,
        "chunk": args.chunk, "ran": not args.compile_only, "peak_rss_mib": peak, "run_peak_rss_mib": run_peak,
        "run_peak_above_start_mib": None if run_peak is None else run_peak - rss_after_compile,
        "rss_before_compile_mib": rss_before,
        "xla_temp_mib": getattr(plan, "temp_size_in_bytes", 0) / 2**20 if plan is not None else None,
        "xla_argument_mib": getattr(plan, "argument_size_in_bytes", 0) / 2**20 if plan is not None else None,
        "xla_output_mib": getattr(plan, "output_size_in_bytes", 0) / 2**20 if plan is not None else None,
        "targets_mib": L * Tp * ((Hq + 2 * H) * D * item + H * 4) / 2**20,
        "cache_mib": 2 * L * (Tp + A) * H * D * item / 2**20,
        "one_layer_dense_scores_mib": Hq * (Tp + A) ** 2 * 4 / 2**20,
        "compile_s": compile_s, "run_s": run_s,
    }


def measure(args, length: int) -> dict:
    command = [sys.executable, "-m", "kvjax.eval.bench_locret_labels", "--point", str(length), "--model", args.model,
               "--mode", args.mode, "--dtype", args.dtype, "--answer", str(args.answer), "--chunk", str(args.chunk),
               "--hidden", str(args.hidden)] + (["--compile-only"] if args.compile_only else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.point_timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"prefix_tokens": length, "error": f"timed out after {args.point_timeout} s"}
    if done.returncode != 0:
        return {"prefix_tokens": length, "error": " ".join(done.stderr.strip().splitlines()[-1:])}
    return json.loads(done.stdout.strip().splitlines()[-1])


COLUMNS = [
    ("prefix tokens", "prefix_tokens"), ("run's peak RSS MiB", "run_peak_rss_mib"),
    ("run's peak above its start MiB", "run_peak_above_start_mib"), ("process peak RSS MiB", "peak_rss_mib"),
    ("RSS before compile MiB", "rss_before_compile_mib"),
    ("XLA temp MiB", "xla_temp_mib"), ("targets MiB", "targets_mib"), ("cache MiB", "cache_mib"),
    ("one layer's [Hq, T, T] f32 MiB (not built)", "one_layer_dense_scores_mib"), ("compile s", "compile_s"), ("run s", "run_s"),
]


def render(payload: dict, columns: list[tuple[str, str]] = COLUMNS) -> str:
    def cell(r, key):
        value = r.get(key, "")
        return round(value) if key.endswith("_mib") and isinstance(value, float) else value

    rows = [[r["prefix_tokens"], r["error"], *[""] * (len(columns) - 2)] if "error" in r
            else [cell(r, key) for _, key in columns] for r in payload["results"]]
    s = payload["settings"]
    return (markdown_table([name for name, _ in columns], rows)
            + f"\n{s['model']}, {s['mode']}, {s['dtype']}, answer {s['answer']} tokens, chunk {s['chunk']}"
            + (f", heads hidden {s['hidden']}" if s["mode"] == "step" else "")
            + (", compiled only (not run: peak RSS is the compile's)" if s["compile_only"] else "")
            + f"; one process per point; {payload['machine'].get('cpu_model', '')}, {payload['machine']['cpu_count']} cores.\n")


def render_memory(payload: dict) -> str:
    """The table without its seconds: for runs whose times were taken with other work on the cores."""
    return render(payload, [c for c in COLUMNS if not c[1].endswith("_s")])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf, tiny or a registered name")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="prefix tokens per point")
    p.add_argument("--answer", type=int, default=512, help="answer tokens (the trainer's --max-answer)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk of the label forward")
    p.add_argument("--mode", choices=["labels", "step"], default="labels", help="labels only, or a whole train step")
    p.add_argument("--hidden", type=int, default=1024, help="retaining-head hidden size (--mode step)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--compile-only", action="store_true",
                   help="compile and report XLA's plan without running (peak RSS is then the compile's)")
    p.add_argument("--point-timeout", type=int, default=1800, help="seconds per point")
    p.add_argument("--out", default=default_out("locret_labels"))
    p.add_argument("--point", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.point is not None:
        print(json.dumps(run_point(args, args.point)))
        return {}
    if min(args.lengths) < 1 or args.answer < 1 or args.chunk < 1:
        p.error("--lengths, --answer and --chunk must be >= 1")

    from tqdm import tqdm

    results = [measure(args, length) for length in tqdm(args.lengths, desc="points", unit="point")]
    settings = {k: getattr(args, k) for k in ("model", "lengths", "answer", "chunk", "mode", "hidden", "dtype", "compile_only")}
    payload = {"machine": machine_info(), "settings": settings, "results": results}
    table = render(payload)
    paths = write_outputs(args.out, "locret_labels", payload, table)
    print(table)
    print(f"wrote {paths['json']} and {paths['md']}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
