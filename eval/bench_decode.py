"""Decode speed across model widths: kvjax against `transformers`, same weights, same CPU, one run.

Three widths, each at batch 1 and batch 8: SmolLM2-135M-Instruct (its real weights, when `kvjax fetch
smollm2-135m` has run), a 110M Llama shape (hidden 1024, 8 layers, 16 query / 4 kv heads of 64, MLP 2816,
vocab 32000) and Llama-3.2-1B's width (hidden 2048, 32 / 8 heads of 64, MLP 8192, vocab 128256, tied
embeddings; 8 of its 16 layers by default), random weights for the last two. For each (width, batch,
context): prefill seconds (compile apart), decode tokens/s (rows x steps per second, median step of N after
a warm-up), the bytes a step reads (weights plus the KV cache) as GB/s and as a share of a large read, and
the FLOPs a step does as a share of a large float32 matmul, all measured in the same run.

    kvjax bench decode --out results/decode      # every width, batch 1 at 1K/4K/8K, batch 8 at 1K/2K
    kvjax bench decode --quick                        # a small smoke run

With `--model NAME` (a fetched name or a .gguf file; `kvjax bench real` runs it for SmolLM2-135M), one real
model instead, batch 1, at each of `--dtypes`: both sides load the GGUF (kvjax through its own reader,
transformers through `from_pretrained(dir, gguf_file=...)`) and dequantise to the same floats; it writes
bench_real.json (its own table, `render_model`):

    kvjax bench decode --model smollm2-135m --out results/real_speed   # 2K/4K/8K, float32 and bfloat16
    kvjax bench decode --model smollm2-135m --quick                         # 256/512 tokens, float32
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax.numpy as jnp
import numpy as np

from .lib.report import cpu_load, default_out, load_line, machine_info, markdown_table, write_outputs
from .lib.setups import param_bytes
from .lib.timing import DecodeRun, large_read, matmul_gflops

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # --model: the KV bytes a token takes per value



@dataclasses.dataclass(frozen=True)
class Width:
    """A model width to time: a transformers config (random weights) or a fetched real model."""

    name: str
    hidden: int = 0
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    intermediate: int = 0
    vocab: int = 0
    real: str | None = None  # a `kvjax fetch` name: its GGUF in both libraries

    def hf_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads, max_position_embeddings=131072, rope_theta=500000.0,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )


def widths(layers_1b: int, quick: bool) -> dict[str, Width]:
    if quick:
        return {"tiny-gqa": Width("tiny-gqa", 256, 2, 8, 2, 512, 4096)}
    return {
        "smollm2-135m": Width("smollm2-135m", real="smollm2-135m"),
        "110m": Width("110m", 1024, 8, 16, 4, 2816, 32000),
        "llama-3.2-1b-width": Width("llama-3.2-1b-width", 2048, layers_1b, 32, 8, 8192, 128256),
    }


def load_transformers(path: str, dtype: str, threads: int):
    """transformers' model of a GGUF file (`path`) at `dtype`, on `threads` torch threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch_dtype
    ).eval()


def bench_kvjax(model, prompt: np.ndarray, steps: int) -> dict:
    return DecodeRun.prefilled(model, prompt, max_new_tokens=steps + 1).run(steps)


def read_bound(gib: float) -> dict:
    """The large read a step is held to: jax's and torch's sum over `gib` GiB, the faster median."""
    return large_read(int(gib * 2**30), repeats=5, torch=True)


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
    step = statistics.median(times)
    return {"prefill_s": prefill, "decode_step_s": step, "decode_tokens_per_s": prompt.shape[0] / step}


def step_cost(cfg, batch: int, context: int) -> dict[str, float]:
    """What one float32 decode step of `batch` rows at `context` tokens reads and computes: the weights once
    (layers, norms, the logits matrix; the embedding rows gathered are negligible), the KV cache of every row,
    and the FLOPs of the matmuls (2 per weight per row) and of attention (4 per cached key per query head)."""
    E, L = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = E * (q + 2 * kv) + q * E + 3 * E * cfg.intermediate_size + 2 * E
    weights = L * layer_weights + E * cfg.vocab_size + E
    kv_bytes = batch * L * 2 * kv * 4 * context
    flops = 2 * batch * (L * layer_weights + E * cfg.vocab_size) + 4 * batch * L * q * context
    return {"bytes": weights * 4 + kv_bytes, "weight_bytes": weights * 4, "kv_bytes": kv_bytes, "flops": flops}


def build(width: Width, threads: int):
    """(kvjax model, transformers model) with the same float32 weights."""
    import torch

    import kvjax
    from kvjax.models.loading import param_shapes
    from kvjax.models.convert import params_from_hf

    if width.real:
        from kvjax.models.hub import resolve_model


        path = resolve_model(width.real)
        return kvjax.load_model(path), load_transformers(path, "float32", threads)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = width.hf_config()
    hf = LlamaForCausalLM(hf_config).eval()
    cfg = kvjax.ModelConfig.from_hf_dict(hf_config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    model = kvjax.Model(cfg, params_from_hf(cfg, tensors, param_shapes(cfg, jnp.float32), jnp.float32))
    return model, hf


def plot(payload: dict, path: str) -> None:
    """Per width: decode tokens/s against context (kvjax and transformers, each batch), and the step's
    bytes as a share of the large read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["width"] for r in payload["results"]))
    fig, axes = plt.subplots(2, len(names), figsize=(4.5 * len(names), 7), squeeze=False)
    for col, name in enumerate(names):
        for batch, marker in zip(sorted({r["batch"] for r in payload["results"]}), "os^"):
            rows = [r for r in payload["results"] if r["width"] == name and r["batch"] == batch]
            ctx = [r["context"] for r in rows]
            for side, style in (("kvjax", "-"), ("transformers", "--")):
                axes[0][col].plot(ctx, [r[side]["decode_tokens_per_s"] for r in rows], marker + style,
                                  label=f"{side}, batch {batch}")
                axes[1][col].plot(ctx, [r[side]["share_of_large_read"] for r in rows], marker + style,
                                  label=f"{side}, batch {batch}")
        axes[0][col].set_title(name)
        axes[0][col].set_ylabel("decode tokens/s")
        axes[1][col].set_ylabel("step bytes/s / large read")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.suptitle(f"decode, float32, {payload['machine'].get('cpu_model', '')}, {payload['machine']['cpu_count']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(payload: dict) -> str:
    """The Markdown table and note of a run (what `kvjax bench decode` prints and writes)."""
    headers = ["width", "batch", "context", "kvjax tok/s", "transformers tok/s", "speedup",
               "kvjax share of large read", "transformers share", "kvjax share of matmul FLOP/s",
               "kvjax prefill s", "transformers prefill s", "kvjax compile s (prefill + decode)"]
    forms = {r.get("decode_form", "per_layer") for r in payload["results"]}
    rows = [[r["width"] + (f" ({r.get('decode_form', 'per_layer')})" if len(forms) > 1 else ""), r["batch"], r["context"], r["kvjax"]["decode_tokens_per_s"],
             r["transformers"]["decode_tokens_per_s"], f"{r['decode_speedup']:.2f}x",
             f"{100 * r['kvjax']['share_of_large_read']:.0f}%", f"{100 * r['transformers']['share_of_large_read']:.0f}%",
             f"{100 * r['kvjax']['share_of_matmul']:.0f}%", r["kvjax"]["prefill_s"], r["transformers"]["prefill_s"],
             r["kvjax"]["prefill_compile_s"] + r["kvjax"]["decode_compile_s"]] for r in payload["results"]]
    read, matmul, machine = payload["large_read"], payload["matmul"], payload["machine"]
    load = payload.get("load", {})
    note = (f"\nfloat32, {machine.get('cpu_model', '')}, {machine['cpu_count']} cores; decode = median of "
            f"{payload['config']['timed_steps']} steps after a warm-up, tok/s = rows x steps/s. Large read "
            f"{read['gbps']:.1f} GB/s (the faster of jax {read['jax_sum_gbps']:.1f} and torch "
            f"{read['torch_sum_gbps']:.1f} over {read['bytes'] / 2**30:.1f} GiB); matmul {matmul['gflops']:.0f} GFLOP/s "
            f"(the faster of jax {matmul['jax_gflops']:.0f} and torch {matmul['torch_gflops']:.0f}, "
            f"{matmul['size']}x{matmul['size']}). Load average before/after: {load.get('before')} / {load.get('after')}.\n")
    return markdown_table(headers, rows) + note


def plot_model(payload: dict, path: str) -> None:
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


def render_model(payload: dict) -> str:
    """The table and note of a `--model` run (its .md; the docs render it from the committed JSON)."""
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


def bench_model(args) -> dict:
    """`--model`: one real model against transformers, batch 1, at each dtype and context (bench_real.json)."""
    import kvjax
    from kvjax.models.hub import resolve_model
    from tqdm import tqdm

    path = resolve_model(args.model)
    load_before = cpu_load()
    large_read = read_bound(args.read_gib)
    results = []
    for dtype in args.dtypes:
        model = kvjax.load_model(path, dtype=dtype)
        hf = load_transformers(path, dtype, args.threads)
        cfg = model.cfg
        weight_bytes = param_bytes(model.params)
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
    return payload



def main(argv=None):
    parser = argparse.ArgumentParser(prog="kvjax bench decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", nargs="+", default=None, help="widths to run (default: all)")
    parser.add_argument("--model", default=None,
                        help="one real model instead of the widths (a fetched name or a .gguf file): bench_real.json")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPE_BYTES),
                        help="--model: the dtypes to run")
    parser.add_argument("--layers-1b", type=int, default=8, help="layers of the Llama-3.2-1B width (the model has 16)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="contexts at batch 1 (default 1024 4096 8192; with --model 2048 4096 8192)")
    parser.add_argument("--batch", type=int, default=8, help="the batched rows (0: batch 1 only)")
    parser.add_argument("--batch-contexts", type=int, nargs="+", default=[1024, 2048], help="contexts at --batch")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per cell (default 8; --model 16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--read-gib", type=float, default=2.0, help="size of the large read used as the bound")
    parser.add_argument("--out", default=None, help="default ./kvjax-results/decode (--model: real_speed)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (one small width, short contexts)")
    args = parser.parse_args(argv)
    if args.model is not None and args.widths is not None:
        parser.error(f"--model {args.model} runs one model: drop --widths {' '.join(args.widths)}")
    if args.model is not None:
        args.contexts, args.steps = args.contexts or [2048, 4096, 8192], args.steps or 16
        args.out = args.out or default_out("real_speed")
        if args.quick:
            args.contexts, args.dtypes, args.steps, args.read_gib = [256, 512], ["float32"], 3, 0.25
    else:
        args.contexts, args.steps = args.contexts or [1024, 4096, 8192], args.steps or 8
        args.out = args.out or default_out("decode")
        if args.quick:
            args.contexts, args.batch, args.batch_contexts, args.steps, args.read_gib = [128, 256], 2, [128], 3, 0.25
    try:
        import torch
    except ImportError:
        raise SystemExit("kvjax bench decode compares against transformers on torch, which is not installed: "
                         "pip install 'kvjax[dev]' (torch's CPU wheel) first") from None
    from tqdm import tqdm

    threads = args.threads or os.cpu_count()
    if args.model is not None:
        args.threads = threads
        payload = bench_model(args)
        text = render_model(payload)
        paths = write_outputs(args.out, "bench_real", payload, text)
        plot_model(payload, paths["json"].replace(".json", ".png"))
        print(text)
        return payload
    torch.set_num_threads(threads)
    available = widths(args.layers_1b, args.quick)
    chosen = args.widths or list(available)
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise SystemExit(f"unknown widths {unknown}; choose from {sorted(available)}")
    load_before = cpu_load()
    large_read = read_bound(args.read_gib)
    matmul = matmul_gflops(512 if args.quick else 2048)
    cells = [(1, c) for c in args.contexts] + ([(args.batch, c) for c in args.batch_contexts] if args.batch > 1 else [])
    results, configs, skipped = [], {}, {}
    for name in chosen:
        try:
            model, hf = build(available[name], threads)
        except FileNotFoundError as error:  # a real model not fetched: say so, run the others
            skipped[name] = str(error)
            tqdm.write(f"{name}: skipped ({error})")
            continue
        cfg = model.cfg
        configs[name] = {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
                         "kv_heads": cfg.num_kv_heads, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
                         "real_weights": bool(available[name].real)}
        for batch, context in tqdm(cells, desc=name):
            prompt = np.random.default_rng([batch, context]).integers(0, cfg.vocab_size, (batch, context)).astype(np.int32)
            cost = step_cost(cfg, batch, context + args.steps // 2)

            def rates(r):
                r["achieved_gbps"] = cost["bytes"] / r["decode_step_s"] / 1e9
                r["share_of_large_read"] = r["achieved_gbps"] / large_read["gbps"]
                r["gflops"] = cost["flops"] / r["decode_step_s"] / 1e9
                r["share_of_matmul"] = r["gflops"] / matmul["gflops"]
                return r

            theirs = rates(bench_transformers(hf, prompt, args.steps))
            ours = rates(bench_kvjax(model, prompt, args.steps))
            results.append({"width": name, "batch": batch, "context": context, "step_cost": cost, "kvjax": ours,
                            "transformers": theirs, "decode_form": "per_layer",
                            "decode_speedup": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]})
            tqdm.write(f"{name} batch {batch} at {context}: {ours['decode_tokens_per_s']:.1f} vs "
                       f"{theirs['decode_tokens_per_s']:.1f} tok/s ({results[-1]['decode_speedup']:.2f}x)")
        del model, hf
    payload = {
        "benchmark": "bench_decode", "machine": machine_info(), "load": {"before": load_before, "after": cpu_load()},
        "config": {"dtype": "float32", "timed_steps": args.steps, "torch_threads": threads, "widths": configs,
                   "skipped": skipped, "quick": args.quick},
        "large_read": large_read, "matmul": matmul, "results": results,
    }
    text = render(payload)
    paths = write_outputs(args.out, "bench_decode", payload, text)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(text)
    return payload


if __name__ == "__main__":
    main()
