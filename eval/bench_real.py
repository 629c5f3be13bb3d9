"""Speed on a real model: SmolLM2-135M-Instruct in kvjax against `transformers`, same weights, same CPU.

Both load the fetched GGUF (`kvjax fetch smollm2-135m`): kvjax through its own GGUF reader, transformers
through `from_pretrained(dir, gguf_file=...)`; both dequantise to the same floats. For each dtype and
context: prefill seconds (kvjax's compile time reported apart, from JAX's compile events), decode
tokens/s (median of N steps after a warm-up), and achieved bytes/s (weights plus the KV cache read per
token) against a large read measured in the same run. Both run in this process, one after the other, with
the same thread count.

    kvjax bench real --out eval/results/real_speed          # 2K/4K/8K, float32 and bfloat16
    kvjax bench real --quick                                # a short smoke run (256/512 tokens)
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from ._report import cpu_load, default_out, machine_info, markdown_table, write_outputs
from .bench_decode import bench_kvjax, bench_transformers, load_transformers, read_bound

MODEL = "smollm2-135m"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for dtype, marker in (("float32", "o"), ("bfloat16", "s")):
        rows = [r for r in payload["results"] if r["dtype"] == dtype]
        if not rows:
            continue
        ctx = [r["context"] for r in rows]
        axes[0].plot(ctx, [r["kvjax"]["prefill_s"] for r in rows], marker + "-", label=f"kvjax {dtype}")
        axes[0].plot(ctx, [r["transformers"]["prefill_s"] for r in rows], marker + "--", label=f"transformers {dtype}")
        axes[1].plot(ctx, [r["kvjax"]["decode_tokens_per_s"] for r in rows], marker + "-", label=f"kvjax {dtype}")
        axes[1].plot(ctx, [r["transformers"]["decode_tokens_per_s"] for r in rows], marker + "--",
                     label=f"transformers {dtype}")
        axes[2].plot(ctx, [r["kvjax"]["share_of_large_read"] for r in rows], marker + "-", label=f"kvjax {dtype}")
        axes[2].plot(ctx, [r["transformers"]["share_of_large_read"] for r in rows], marker + "--",
                     label=f"transformers {dtype}")
    for ax, label in zip(axes, ("prefill s (compile excluded)", "decode tokens/s", "decode bytes/s / large read")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, batch 1, " + payload["machine"].get("cpu_model", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="kvjax bench real", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="a fetched name or a .gguf file")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPE_BYTES))
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (XLA uses every core)")
    parser.add_argument("--read-gib", type=float, default=2.0, help="size of the large read used as the bound")
    parser.add_argument("--out", default=default_out("real_speed"))
    parser.add_argument("--quick", action="store_true", help="short smoke run (256/512 tokens, float32, 3 steps)")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.dtypes, args.steps, args.read_gib = [256, 512], ["float32"], 3, 0.25

    from tqdm import tqdm

    import kvjax
    from kvjax.models.hub import resolve_model

    path = resolve_model(args.model)
    load_before = cpu_load()
    large_read = read_bound(args.read_gib)
    results = []
    for dtype in args.dtypes:
        model = kvjax.load_model(path, dtype=dtype)
        hf = load_transformers(path, dtype, args.threads)
        cfg = model.cfg
        weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.params))
        for context in tqdm(args.contexts, desc=f"{dtype} contexts"):
            prompt = np.random.default_rng(context).integers(0, cfg.vocab_size, (1, context)).astype(np.int32)
            kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype] * (context + args.steps // 2)
            ours = bench_kvjax(model, prompt, args.steps)
            theirs = bench_transformers(hf, prompt, args.steps)
            for r in (ours, theirs):
                r["achieved_gbps"] = (weight_bytes + kv_bytes) / r["decode_step_s"] / 1e9
                r["share_of_large_read"] = r["achieved_gbps"] / large_read["jax_sum_gbps"]
            results.append({
                "dtype": dtype, "context": context, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes,
                "kvjax": ours, "transformers": theirs,
                "decode_speedup": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
                "prefill_speedup": theirs["prefill_s"] / ours["prefill_s"],
            })
            tqdm.write(f"{dtype} {context}: prefill {ours['prefill_s']:.2f}s vs {theirs['prefill_s']:.2f}s, decode "
                       f"{ours['decode_tokens_per_s']:.1f} vs {theirs['decode_tokens_per_s']:.1f} tok/s")
        del model, hf

    payload = {
        "benchmark": "bench_real", "machine": machine_info(), "model": args.model,
        "config": {"batch": 1, "timed_steps": args.steps, "torch_threads": args.threads,
                   "layers": cfg.num_layers, "hidden": cfg.hidden_size},
        "large_read": large_read, "results": results,
    }
    payload.update(cpu_load_before=load_before, cpu_load_after=cpu_load())
    text = render(payload)
    paths = write_outputs(args.out, "bench_real", payload, text)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(text)
    return payload


def render(payload: dict) -> str:
    """The table and note of a run (its .md; the README and docs render it from the committed JSON)."""
    from ._report import load_line

    headers = ["dtype", "context", "kvjax prefill s", "transformers prefill s", "prefill speedup", "kvjax tok/s",
               "transformers tok/s", "decode speedup", "kvjax GB/s (share of large read)",
               "transformers GB/s (share)", "kvjax compile s (prefill + decode)"]
    rows = [[r["dtype"], r["context"], r["kvjax"]["prefill_s"], r["transformers"]["prefill_s"],
             f"{r['prefill_speedup']:.2f}x", r["kvjax"]["decode_tokens_per_s"], r["transformers"]["decode_tokens_per_s"],
             f"{r['decode_speedup']:.2f}x", f"{r['kvjax']['achieved_gbps']:.1f} ({100 * r['kvjax']['share_of_large_read']:.0f}%)",
             f"{r['transformers']['achieved_gbps']:.1f} ({100 * r['transformers']['share_of_large_read']:.0f}%)",
             r["kvjax"]["prefill_compile_s"] + r["kvjax"]["decode_compile_s"]] for r in payload["results"]]
    m, c, read = payload["machine"], payload["config"], payload["large_read"]
    return (markdown_table(headers, rows) +
            f"\nSmolLM2-135M-Instruct (Q4_1 GGUF dequantised), batch {c['batch']}, {m.get('cpu_model', '')}, "
            f"{m['cpu_count']} cores, torch threads {c['torch_threads']}; decode = median of {c['timed_steps']} steps "
            f"after a warm-up; large read (jax sum) {read['jax_sum_gbps']:.1f} GB/s over {read['bytes'] / 2**30:.1f} "
            f"GiB. {load_line(payload)}\n")


if __name__ == "__main__":
    main()
