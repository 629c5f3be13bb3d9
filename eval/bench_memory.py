"""Peak resident memory against context length: Locret (fixed budget, per-chunk eviction) vs the full cache.

    python -m eval.bench_memory                       # 8K..64K full, 8K..128K Locret
    python -m eval.bench_memory --contexts 8192 16384 --locret-only-contexts 131072
    python -m eval.bench_memory --model smollm2-135m --heads smollm2-135m --out results/locret/memory

With `--model` (a registered name, a directory or `.gguf`) the points load that model instead, and
`--heads` names Locret's heads (a shipped name such as `smollm2-135m`, or a path); without it the
random model's heads are random (memory does not depend on what the heads learned).

Each point is its own process (a fresh `python -m eval.bench_memory --point ...`) that builds a random
model, prefills one prompt of the given length (chunked) and decodes a few tokens, then reports its peak
RSS (`VmHWM`, reset after the model is loaded where Linux allows it, so a loading peak does not mask the
prefill's) and its RSS before the prefill. The model is small except in its KV per token (few layers,
many wide kv heads, float32 cache), so the full cache dominates the process as the context grows; Locret
keeps `token_budget` slots per head and its pool is sized for budget + one chunk. Writes
bench_memory.{json,md,png} under --out (default ./kvjax-results/memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .lib.report import default_out, machine_info, markdown_table, reset_peak_rss, rss_mib, write_outputs

# Few layers and a small MLP keep compute low; 4 kv heads of 128 in float32 give 4 KiB of K+V per token
# per layer, so a 64K-token full cache is 512 MiB against a ~300 MiB JAX process.
MODEL = dict(
    model_type="llama", vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=128, max_position_embeddings=1 << 20,
    rope_theta=500000.0, tie_word_embeddings=True,
)


def run_point(policy_name: str, context: int, budget: int, chunk: int, new_tokens: int, model_name: str | None = None,
              heads_name: str | None = None, local_tail: int = 100) -> dict:
    """One measurement in this process (call it in a fresh one)."""
    import jax
    import numpy as np

    import kvjax
    from kvjax.cache.compaction import memory_report
    from kvjax.models.config import ModelConfig
    from kvjax.models.loading import Model, init_params
    from kvjax.locret import HeadsConfig, init_heads

    if model_name is None:
        cfg = ModelConfig.from_hf_dict(MODEL)
        model = Model(cfg, init_params(cfg, seed=0))
    else:
        model = kvjax.load_model(model_name)
        cfg = model.cfg
    if policy_name == "locret":
        heads = heads_name if heads_name is not None else init_heads(HeadsConfig.for_model(cfg), seed=0)
        # per kv head, as the committed points ran (the SmolLM2 heads default to pool="all", which sizes each
        # head's pages for head_cap times its share)
        policy = kvjax.make_policy("locret", token_budget=budget, stabilizers=budget // 4, local_tail=local_tail,
                                   heads=heads, pool="head")
    else:
        policy = kvjax.make_policy("full")
    tokens = np.random.default_rng(0).integers(4, cfg.vocab_size, (1, context)).astype(np.int32)
    if model_name is not None and model.tokenizer is not None:  # real text for a real model: the corpus
        from kvjax.tasks.real_text import tokenize_corpus  # (31K SmolLM2 tokens) repeated to the context

        tokens = np.resize(tokenize_corpus(model.tokenizer).ids, context).astype(np.int32)[None]
    jax.block_until_ready(model.params)
    # loading (a GGUF is dequantised through temporaries) may peak above the prefill: measure from here
    load_peak = rss_mib("VmHWM")
    peak_reset = reset_peak_rss()
    rss_before = rss_mib("VmRSS")
    began = time.perf_counter()
    state, logits = kvjax.prefill(model, tokens, policy=policy, chunk_size=chunk, max_new_tokens=new_tokens,
                                  allow_longer_context=True)
    token = np.asarray(logits.argmax(-1))
    for _ in range(new_tokens):
        logits, state = kvjax.decode_step(model, state, token, policy=policy)
        token = np.asarray(logits.argmax(-1))
    seconds = time.perf_counter() - began
    report = memory_report(state)
    return {
        "policy": policy_name,
        "context": context,
        "peak_rss_mib": rss_mib("VmHWM"),
        "rss_before_prefill_mib": rss_before,
        "load_peak_rss_mib": load_peak,
        "peak_reset_after_load": peak_reset,
        "pool_mib": (state.k_pages.nbytes + state.v_pages.nbytes) / 2**20,
        "kv_in_use_mib": report["bytes_in_use"] / 2**20,
        "full_cache_kv_mib": report["bytes_full_cache"] / 2**20,
        "seconds": seconds,
    }


def measure(policy_name: str, context: int, args) -> dict:
    command = [
        sys.executable, "-m", "eval.bench_memory", "--point", policy_name, str(context), "--budget", str(args.budget),
        "--chunk", str(args.chunk), "--new-tokens", str(args.new_tokens), "--local-tail", str(args.local_tail),
    ] + (["--model", args.model] if args.model else []) + (["--heads", args.heads] if args.heads else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.point_timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"policy": policy_name, "context": context, "error": f"timed out after {args.point_timeout} s"}
    if done.returncode != 0:
        return {"policy": policy_name, "context": context, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("full", "o-"), ("locret", "s-")):
        points = sorted((r["context"], r["peak_rss_mib"]) for r in results if r["policy"] == name and "error" not in r)
        if points:
            ax.plot([p[0] / 1024 for p in points], [p[1] for p in points], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("Peak resident memory of one prefill + decode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536], help="both policies")
    p.add_argument("--locret-only-contexts", type=int, nargs="*", default=[131072], help="Locret only (cheap)")
    p.add_argument("--budget", type=int, default=2048, help="Locret token_budget (slots per head)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk size")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--local-tail", type=int, default=100, help="Locret's local tail (the paper's 100)")
    p.add_argument("--point-timeout", type=int, default=600, help="seconds per point")
    p.add_argument("--out", default=default_out("memory"))
    p.add_argument("--model", default=None, help="a model to load (default: the random KV-heavy model above)")
    p.add_argument("--heads", default=None, help="Locret's heads: a shipped name or a path (default: random heads)")
    p.add_argument("--point", nargs=2, metavar=("POLICY", "CONTEXT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.point:
        print(json.dumps(run_point(args.point[0], int(args.point[1]), args.budget, args.chunk, args.new_tokens,
                                   args.model, args.heads, args.local_tail)))
        return {}

    from tqdm import tqdm

    jobs = [(name, c) for c in args.contexts for name in ("locret", "full")]
    jobs += [("locret", c) for c in args.locret_only_contexts]
    results = []
    for name, context in tqdm(jobs, desc="points", unit="point"):
        results.append(measure(name, context, args))
        tqdm.write(json.dumps(results[-1]))
    payload = {
        "machine": machine_info(),
        "model": args.model or MODEL,
        "heads": args.heads,
        "settings": {"budget": args.budget, "chunk": args.chunk, "new_tokens": args.new_tokens, "local_tail": args.local_tail},
        "results": results,
    }
    print(render(payload, args.out))
    return payload


def peak_slopes(results: list) -> dict[str, float]:
    """MiB of peak RSS per 1K tokens of context, per policy (a least-squares line over its finished points)."""
    import numpy as np

    out = {}
    for name in sorted({r["policy"] for r in results}):
        points = [(r["context"] / 1024, r["peak_rss_mib"]) for r in results if r["policy"] == name and "error" not in r]
        if len(points) >= 2:
            x, y = np.array(points).T
            out[name] = float(np.polyfit(x, y, 1)[0])
    return out


def render(payload: dict, out_dir: str) -> str:
    """Write the JSON, the Markdown table and the plot of `payload`; return the table."""
    headers = ["policy", "context", "peak RSS MiB", "RSS before prefill MiB", "KV pool MiB", "KV in use MiB", "seconds"]
    keys = ("peak_rss_mib", "rss_before_prefill_mib", "pool_mib", "kv_in_use_mib", "seconds")
    rows = [
        [r["policy"], r["context"], *(int(round(r[k])) for k in keys)]
        if "error" not in r else [r["policy"], r["context"], r["error"], "", "", "", ""]
        for r in payload["results"]
    ]
    table = markdown_table(headers, rows)
    payload["slopes_mib_per_1k_tokens"] = slopes = peak_slopes(payload["results"])
    table += "\n" + "\n".join(f"Peak RSS slope, {name}: {slope:.1f} MiB per 1K tokens (least squares over the "
                               f"points that finished)." for name, slope in slopes.items()) + "\n"
    write_outputs(out_dir, "bench_memory", payload, table)
    plot(payload["results"], os.path.join(out_dir, "bench_memory.png"))
    return table


if __name__ == "__main__":
    main()
