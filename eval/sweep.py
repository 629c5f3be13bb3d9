"""Policies x budgets x lengths on the retrieval tasks: JSON, a Quest-Table-1-shaped Markdown table, plots.

Every cell runs `eval.retrieval` (question fed by decode, after compression) with one policy at one
token budget; `full` runs once per length. Decode latency per policy is timed on the same prompts
(`time_decode`). Plots are drawn from the JSON: accuracy against budget (one panel per task and length)
and decode latency against context length.

    python -m eval.sweep --model tiny --lengths 1024 2048 --budgets 64 128 256 --samples 50
    kvjax bench sweep --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Sequence

import jax
import numpy as np

from . import retrieval
from ._report import default_out, machine_info, markdown_table, write_outputs

DEFAULT_POLICIES = ("full", "quest", "quest_static", "snapkv", "ada_snapkv", "h2o", "tova", "streaming")
# Layer 0 of the shipped model holds its hand-set previous-token head (docs/default_model.md); retrieval
# happens in layer 1 and up, so compression starts at layer 1 for every method.
DEFAULT_DENSE_LAYERS = 1


def build_policy(name: str, budget: int | None, dense_layers: int = DEFAULT_DENSE_LAYERS):
    import kvjax

    if name == "full":
        return kvjax.make_policy("full")
    return kvjax.make_policy(name, token_budget=int(budget), dense_layers=dense_layers)


def time_decode(model, policy, prompts: Sequence[Sequence[int]], steps: int = 16) -> dict:
    """Prefill `prompts`, then time `steps` decode steps after one warm-up step: ms per step (median)."""
    import kvjax

    state, logits = kvjax.prefill(model, prompts, policy, max_new_tokens=steps + 8)
    token = np.asarray(jax.numpy.argmax(logits, -1))
    logits, state = kvjax.decode_step(model, state, token, policy)  # compile + warm-up
    jax.block_until_ready(logits)
    times = []
    for _ in range(steps):
        token = np.asarray(jax.numpy.argmax(logits, -1))
        started = time.perf_counter()
        logits, state = kvjax.decode_step(model, state, token, policy)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - started)
    ms = 1e3 * statistics.median(times)
    return {"decode_ms_per_step": ms, "decode_tokens_per_s": len(prompts) * 1e3 / ms, "batch": len(prompts)}


def run_sweep(model, policies: Sequence[str] = DEFAULT_POLICIES, budgets: Sequence[int] = (64, 128),
              lengths: Sequence[int] = (2048,), tasks: Sequence[str] = ("passkey", "multikey"), num_samples: int = 20,
              num_records: int = 4, seed: int = 0, dense_layers: int = DEFAULT_DENSE_LAYERS, batch_size: int = 8,
              latency: bool = True, progress: bool = True, checkpoint: str | None = None,
              clear_compiled: bool = True) -> dict:
    """Accuracy rows {task, length, policy, budget, accuracy, correct, samples} and latency rows.

    With `checkpoint` (a jsonl path), each finished cell is appended there, and cells already in it (same
    task, length, policy, budget, samples, records, seed and dense_layers) are not run again: a killed
    sweep resumes where it stopped. `clear_compiled` drops JAX's in-memory compiled steps after each cell
    (long sweeps; a short run such as the demo keeps them, so its latency pass reuses them)."""
    from tqdm import tqdm

    cells = [(t, n, p, b) for t in tasks for n in lengths for p in policies for b in ((None,) if p == "full" else budgets)]
    setting = {"samples": num_samples, "records": num_records, "seed": seed, "dense_layers": dense_layers}
    done = {}
    if checkpoint and os.path.exists(checkpoint):
        with open(checkpoint) as f:
            for line in f:
                row = json.loads(line)
                if row.pop("setting", None) == setting:
                    done[(row["task"], row["length"], row["policy"], row["budget"])] = row
    rows, latency_rows = [], []
    bar = tqdm(cells, desc="sweep", disable=not progress)
    for task, n_tokens, name, budget in bar:
        bar.set_postfix_str(f"{task} {n_tokens} {name} {budget or ''}")
        if (task, n_tokens, name, budget) in done:
            rows.append(done[(task, n_tokens, name, budget)])
            continue
        policy = build_policy(name, budget, dense_layers)
        started = time.perf_counter()
        records = retrieval.run_task(model, policy, task, n_tokens, num_samples, seed, num_records, batch_size=batch_size)
        rows.append({
            "task": task, "length": n_tokens, "policy": name, "budget": budget,
            "accuracy": retrieval.accuracy(records), "correct": int(sum(r.correct for r in records)),
            "samples": len(records), "seconds": round(time.perf_counter() - started, 2),
            "by_depth": retrieval.accuracy_by_depth(records),
        })
        # every (policy, budget) compiles its own steps; dropping them bounds the process's memory maps (a
        # full sweep otherwise ended in "LLVM compilation error: Cannot allocate memory" here after ~30 cells)
        if clear_compiled:
            jax.clear_caches()
        if checkpoint:
            with open(checkpoint, "a") as f:
                f.write(json.dumps({**rows[-1], "setting": setting}) + "\n")
    if latency:
        for n_tokens in tqdm(lengths, desc="latency", disable=not progress):
            # the accuracy runs' batch shape, so the decode step compiled for them is reused
            if tasks[0] in retrieval.REAL_TASKS:
                samples = retrieval.make_real_samples(model, tasks[0], n_tokens, batch_size, seed)
                prompt = [list(s.context_ids) for s in samples]
            else:
                samples = retrieval.make_samples("passkey", n_tokens, batch_size, seed)
                prompt = [model.tokenizer(s.prompt)["input_ids"] for s in samples]
            for name in policies:
                budget = None if name == "full" else max(budgets)
                timing = time_decode(model, build_policy(name, budget, dense_layers), prompt)
                latency_rows.append({"length": n_tokens, "policy": name, "budget": budget, **timing})
    return {
        "machine": machine_info(), "policies": list(policies), "budgets": list(budgets), "lengths": list(lengths),
        "tasks": list(tasks), "num_samples": num_samples, "num_records": num_records, "dense_layers": dense_layers,
        "seed": seed, "accuracy": rows, "latency": latency_rows,
    }


def accuracy_table(result: dict) -> str:
    """One block per (task, length): rows = policies, columns = budgets (Quest's Table 1 layout)."""
    out = []
    budgets = result["budgets"]
    for task in result["tasks"]:
        for n in result["lengths"]:
            cells = [r for r in result["accuracy"] if r["task"] == task and r["length"] == n]
            if not cells:
                continue
            title = f"**{task}**, {n} tokens" + (f", {result['num_records']} records" if task == "multikey" else "")
            rows = []
            for name in result["policies"]:
                mine = {r["budget"]: r["accuracy"] for r in cells if r["policy"] == name}
                if name == "full":
                    rows.append([name] + [f"{100 * mine[None]:.0f}%"] * len(budgets))
                else:
                    rows.append([name] + [f"{100 * mine[b]:.0f}%" if b in mine else "" for b in budgets])
            out.append(title + f" (accuracy, {cells[0]['samples']} samples per cell)\n\n"
                       + markdown_table(["policy"] + [f"budget {b}" for b in budgets], rows))
    if result.get("latency"):
        rows = [[r["length"], r["policy"], r["budget"] or "", f"{r['decode_ms_per_step']:.2f}"] for r in result["latency"]]
        batch = result["latency"][0]["batch"]
        out.append(f"Decode latency (median ms per step, batch {batch})\n\n"
                   + markdown_table(["context", "policy", "budget", "ms/step"], rows))
    return "\n".join(out)


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, n) for t in result["tasks"] for n in result["lengths"]]
    has_latency = bool(result.get("latency"))
    fig, axes = plt.subplots(1, len(panels) + has_latency, figsize=(4.2 * (len(panels) + has_latency), 3.6), squeeze=False)
    for ax, (task, n) in zip(axes[0], panels):
        for name in result["policies"]:
            cells = sorted((r for r in result["accuracy"] if r["task"] == task and r["length"] == n
                            and r["policy"] == name), key=lambda r: r["budget"] or 0)
            if name == "full" and cells:
                ax.axhline(100 * cells[0]["accuracy"], color="black", ls="--", label="full")
            elif cells:
                ax.plot([r["budget"] for r in cells], [100 * r["accuracy"] for r in cells], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task}, {n} tokens")
        ax.set_xlabel("token budget")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
    axes[0][0].legend(fontsize=7)
    if has_latency:
        ax = axes[0][-1]
        for name in result["policies"]:
            cells = sorted((r for r in result["latency"] if r["policy"] == name), key=lambda r: r["length"])
            ax.plot([r["length"] for r in cells], [r["decode_ms_per_step"] for r in cells], marker="o", label=name)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("decode ms / step")
        ax.set_title("decode latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    parser.add_argument("--tasks", nargs="+", default=["passkey", "multikey"], choices=list(retrieval.TASKS))
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--dense-layers", type=int, default=DEFAULT_DENSE_LAYERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--out", default=default_out("sweep"))
    parser.add_argument("--name", default="sweep")
    args = parser.parse_args(argv)

    import kvjax
    from kvjax.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    os.makedirs(args.out, exist_ok=True)
    model = kvjax.load_model(args.model)
    result = run_sweep(model, args.policies, args.budgets, args.lengths, args.tasks, args.samples, args.records,
                       args.seed, args.dense_layers, latency=not args.no_latency,
                       checkpoint=f"{args.out}/{args.name}.cells.jsonl")
    result["model"] = args.model
    table = accuracy_table(result)
    paths = write_outputs(args.out, args.name, result, table)
    paths["png"] = plot(result, f"{args.out}/{args.name}.png")
    print(table)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
