"""Decode speed of kvjax full-cache generation against `transformers`, same random weights, same CPU.

Llama-3.2-1B shape (hidden 2048, 32 query / 8 kv heads of 64, MLP 8192, vocab 128256, tied embeddings),
float32, with the layer count cut (default 4 of 16) to keep the run short. For each context (1K, 4K, 8K):
prefill time (compile time reported apart, from JAX's compile events), decode tokens/s over N steps after
a warm-up step, and achieved bytes/s (weights plus the KV cache read per token) against a large read of
several times the 480 MiB last-level cache measured in the same run.

    python -m eval.bench_decode              # writes ./kvjax-results/decode/bench_decode.{json,md,png}
    python -m eval.bench_decode --quick      # a small smoke run
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ._report import default_out, machine_info, markdown_table, write_outputs

COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
_compile_seconds = collections.Counter()


def _on_event(name, duration, **kwargs):
    if name.rsplit("/", 1)[-1] in COMPILE_EVENTS:
        _compile_seconds["total"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


def llama_1b_config(layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def large_read_gbps(gib: float, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth of a `gib`-GiB float32 array, with jax (sum) and torch (sum), median of `repeats`."""
    import torch

    n = int(gib * 2**30 // 4)
    x = jnp.ones((n,), jnp.float32)
    jax.block_until_ready(jnp.sum(x))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(jnp.sum(x))
        times.append(time.perf_counter() - t)
    jax_gbps = n * 4 / statistics.median(times) / 1e9
    del x
    y = torch.ones(n)
    y.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        y.sum()
        times.append(time.perf_counter() - t)
    return {"bytes": n * 4, "jax_sum_gbps": jax_gbps, "torch_sum_gbps": n * 4 / statistics.median(times) / 1e9}


def bench_kvjax(model, prompt: np.ndarray, steps: int) -> dict:
    import kvjax

    _compile_seconds.clear()
    t = time.perf_counter()
    state, logits = kvjax.prefill(model, prompt, max_new_tokens=steps + 1)
    jax.block_until_ready(logits)
    prefill_wall = time.perf_counter() - t
    prefill_compile = _compile_seconds["total"]
    token = jnp.argmax(logits, -1)
    _compile_seconds.clear()
    t = time.perf_counter()
    logits, state = kvjax.decode_step(model, state, np.asarray(token))  # compiles the decode step
    jax.block_until_ready(logits)
    first_step = time.perf_counter() - t
    decode_compile = _compile_seconds["total"]
    times = []
    for _ in range(steps):
        token = np.asarray(jnp.argmax(logits, -1))
        t = time.perf_counter()
        logits, state = kvjax.decode_step(model, state, token)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t)
    return {
        "prefill_s": prefill_wall - prefill_compile, "prefill_compile_s": prefill_compile,
        "decode_compile_s": decode_compile, "first_decode_step_s": first_step,
        "decode_step_s": statistics.median(times), "decode_tokens_per_s": 1.0 / statistics.median(times),
    }


def bench_transformers(hf, prompt: np.ndarray, steps: int) -> dict:
    import torch
    from transformers import DynamicCache

    ids = torch.tensor(prompt, dtype=torch.long)
    with torch.inference_mode():
        t = time.perf_counter()
        cache = DynamicCache(config=hf.config)
        out = hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        cache = out.past_key_values
        out = hf(token, past_key_values=cache, use_cache=True)  # warm-up step
        times = []
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            out = hf(token, past_key_values=out.past_key_values, use_cache=True)
            times.append(time.perf_counter() - t)
    return {"prefill_s": prefill, "decode_step_s": statistics.median(times), "decode_tokens_per_s": 1.0 / statistics.median(times)}


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    contexts = [r["context"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(contexts, [r["kvjax"]["decode_tokens_per_s"] for r in rows], "o-", label="kvjax (full cache)")
    ax1.plot(contexts, [r["transformers"]["decode_tokens_per_s"] for r in rows], "s-", label="transformers")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("context (tokens)")
    ax1.set_ylabel("decode tokens/s")
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ax1.set_title(f"decode, {payload['config']['layers']}-layer Llama-3.2-1B shape, f32")
    ax2.plot(contexts, [r["kvjax"]["achieved_gbps"] for r in rows], "o-", label="kvjax")
    ax2.plot(contexts, [r["transformers"]["achieved_gbps"] for r in rows], "s-", label="transformers")
    ax2.axhline(payload["large_read"]["jax_sum_gbps"], color="gray", ls="--", label="large read (jax sum)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("context (tokens)")
    ax2.set_ylabel("GB/s (weights + KV read per token)")
    ax2.set_ylim(bottom=0)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the real model has 16)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--read-gib", type=float, default=2.0, help="size of the large read used as the bound")
    parser.add_argument("--out", default=default_out("decode"))
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (2 layers, small vocab, short contexts)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.contexts, args.steps, args.vocab, args.read_gib = 2, [128, 256], 3, 4096, 0.25

    try:
        import torch
    except ImportError:
        raise SystemExit("kvjax bench decode compares against transformers on torch, which is not installed: "
                         "pip install 'kvjax[dev]' (torch's CPU wheel) first") from None
    from transformers import LlamaForCausalLM
    from tqdm import tqdm

    import kvjax
    from kvjax.loading import param_shapes
    from kvjax.models.convert import params_from_hf

    torch.manual_seed(0)
    hf_config = llama_1b_config(args.layers, args.vocab)
    hf = LlamaForCausalLM(hf_config).eval()
    cfg = kvjax.ModelConfig.from_hf_dict(hf_config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    model = kvjax.Model(cfg, params_from_hf(cfg, tensors, param_shapes(cfg, jnp.float32), jnp.float32))
    del tensors
    weight_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree_util.tree_leaves(model.params))
    large_read = large_read_gbps(args.read_gib)

    results = []
    for context in tqdm(args.contexts, desc="contexts"):
        prompt = np.random.default_rng(context).integers(0, args.vocab, (1, context)).astype(np.int32)
        kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * (context + args.steps // 2)
        ours = bench_kvjax(model, prompt, args.steps)
        theirs = bench_transformers(hf, prompt, args.steps)
        for r in (ours, theirs):
            r["achieved_gbps"] = (weight_bytes + kv_bytes) / r["decode_step_s"] / 1e9
        results.append({"context": context, "kv_bytes_per_token": kv_bytes, "kvjax": ours, "transformers": theirs,
                        "decode_speedup": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]})

    payload = {
        "benchmark": "bench_decode",
        "machine": machine_info(),
        "config": {"shape": "Llama-3.2-1B", "layers": args.layers, "vocab": args.vocab, "dtype": "float32",
                   "weight_bytes": weight_bytes, "batch": 1, "timed_steps": args.steps},
        "large_read": large_read,
        "results": results,
    }
    headers = ["context", "kvjax tok/s", "transformers tok/s", "speedup", "kvjax GB/s", "transformers GB/s",
               "large read GB/s (jax/torch)", "kvjax prefill s", "transformers prefill s", "kvjax compile s (prefill+decode)"]
    rows = [[r["context"], r["kvjax"]["decode_tokens_per_s"], r["transformers"]["decode_tokens_per_s"],
             f"{r['decode_speedup']:.2f}x", r["kvjax"]["achieved_gbps"], r["transformers"]["achieved_gbps"],
             f"{large_read['jax_sum_gbps']:.1f} / {large_read['torch_sum_gbps']:.1f}", r["kvjax"]["prefill_s"],
             r["transformers"]["prefill_s"], r["kvjax"]["prefill_compile_s"] + r["kvjax"]["decode_compile_s"]]
            for r in results]
    table = markdown_table(headers, rows)
    note = (f"\n{args.layers}-layer Llama-3.2-1B shape (of 16), float32, batch 1, {payload['machine'].get('cpu_model', '')}, "
            f"{payload['machine']['cpu_count']} cores; weights {weight_bytes / 1e9:.2f} GB; decode = median of "
            f"{args.steps} steps after a warm-up; large read over {large_read['bytes'] / 2**30:.1f} GiB.\n")
    paths = write_outputs(args.out, "bench_decode", payload, table + note)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(table + note)
    return payload


if __name__ == "__main__":
    main()
