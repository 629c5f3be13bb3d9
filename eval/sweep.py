"""Policies x budgets x lengths on the retrieval tasks: JSON, a Quest-Table-1-shaped Markdown table, plots.

Every cell is one policy at one token budget (`full` once per length) on `eval.lib.retrieval`'s protocol
(question fed by decode, after compression), run by `eval.lib.sweep.run_sweep`: each batch of samples is
prefilled once and every cell that compresses after prefill is derived from that state; the run resumes by
batch. Decode latency per policy is timed on the task's prompts (`eval.lib.sweep.time_decodes`). Plots are
drawn from the JSON: accuracy against budget (one panel per task and length) and decode latency against
context length.

    python -m eval.sweep --model tiny --lengths 1024 2048 --budgets 64 128 256 --samples 50
    kvjax eval sweep --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from .lib import retrieval
from .lib.policies import DEFAULT_DENSE_LAYERS, DEFAULT_POLICIES
from .lib.report import default_out, load_line, markdown_table, write_outputs
from .lib.selection_aim import SHORT_TASK, pooled
from .lib.sweep import run_sweep
from .lib.tables import recorded_load


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
            if result.get("question_in_prefill"):
                title += ", question prefilled with the context (compressed with it)"
            counts = [r["samples"] for r in cells]
            common = max(set(counts), key=counts.count)  # a cell with another count says so: "0% (n=20)"

            def shown(r):
                return f"{100 * r['accuracy']:.0f}%" + ("" if r["samples"] == common else f" (n={r['samples']})")

            rows = []
            for name in result["policies"]:
                mine = {r["budget"]: r for r in cells if r["policy"] == name}
                if name == "full":
                    rows.append([name] + [shown(mine[None])] * len(budgets) if None in mine else [name] + [""] * len(budgets))
                else:
                    rows.append([name] + [shown(mine[b]) if b in mine else "" for b in budgets])
            out.append(title + f" (accuracy, {common} samples per cell unless marked)\n\n"
                       + markdown_table(["policy"] + [f"budget {b}" for b in budgets], rows))
    if result.get("latency"):
        rows = [[r["length"], r["policy"], r["budget"] or "", f"{r['decode_ms_per_step']:.2f}"] for r in result["latency"]]
        batch = result["latency"][0]["batch"]
        out.append(f"Decode latency (median ms per step, batch {batch})\n\n"
                   + markdown_table(["context", "policy", "budget", "ms/step"], rows))
    return "\n".join(out)


def accuracy_table_with_load(result: dict) -> str:
    """`accuracy_table` followed by the load the run recorded (the sweeps whose timing is quoted beside them)."""
    return accuracy_table(result) + "\n\n" + load_line(result)


def _sweep_block(task: str, length: int):
    """A renderer of one (task, length) block of a sweep JSON: `accuracy_table`'s block, with the policies that
    ran there (a sweep's JSON holds several tasks and lengths; the docs discuss each apart)."""

    def render(result: dict) -> str:
        ran = {r["policy"] for r in result["accuracy"] if (r["task"], r["length"]) == (task, length)}
        one = {**result, "tasks": [task], "lengths": [length], "latency": None,
               "policies": [p for p in result["policies"] if p in ran]}
        return accuracy_table(one) + "\n" + recorded_load(result)

    render.__doc__ = f"`eval.sweep`: accuracy of every policy and budget on {task} at {length} tokens."
    return render


passkey_2k = _sweep_block("real_passkey", 2048)
needle_2k = _sweep_block("niah_single", 2048)
passkey_4k = _sweep_block("real_passkey", 4096)
needle_4k = _sweep_block("niah_single", 4096)
passkey_8k = _sweep_block("real_passkey", 8000)
needle_8k = _sweep_block("niah_single", 8000)
multikey_2k = _sweep_block("niah_multikey", 2048)
multikey_4k = _sweep_block("niah_multikey", 4096)
multivalue_2k = _sweep_block("niah_multivalue", 2048)
multivalue_4k = _sweep_block("niah_multivalue", 4096)


def selection_headline(results: list, budgets=(128, 256)) -> str:
    """The README's selection digest: one row per policy, one column per (task, length, budget) over the
    sweeps given (e.g. the 2K and the 4K selection sweeps) at `budgets` (the aim's), then the samples
    behind each column. Sweeps of the same cells with other seeds are pooled (`eval.lib.selection_aim.pooled`)."""
    short = SHORT_TASK
    cells = pooled(results)
    groups = list(dict.fromkeys((task, n) for task, n, _, _ in cells))
    policies = list(dict.fromkeys(p for result in results for p in result["policies"]))
    columns, notes = [], []
    for task, n in groups:
        shown = [b for b in budgets if any(key[:2] == (task, n) and key[3] == b for key in cells)]
        if not shown:
            continue
        samples = max(v[1] for key, v in cells.items() if key[:2] == (task, n) and key[3] in (None, *shown))
        notes.append(f"{short.get(task, task)} {n // 1024}K: {samples}")
        columns += [(f"{short.get(task, task)} {n // 1024}K @{b}", task, n, b, samples) for b in shown]
    rows = []
    for policy in policies:
        row = [policy.replace(":dense_layers=2", "")]
        for _, task, n, b, most in columns:
            hit = cells.get((task, n, policy, None if policy == "full" else b))
            row.append("" if not hit else f"{100 * hit[0]:.0f}%" + (f" ({hit[1]})" if hit[1] < most else ""))
        rows.append(row)
    return (markdown_table(["policy"] + [c[0] for c in columns], rows).rstrip()
            + "\n\nSamples a cell: " + "; ".join(notes) + " (fewer where a cell says so in brackets).")


def headline_table(result: dict, quest: str = "quest:dense_layers=2") -> str:
    """The README's digest of a sweep: per (length, task), full attention, Quest at every budget, and the
    best evictor at the largest budget (any policy that is neither full nor a Quest variant), named."""
    budgets = result["budgets"]
    evictors = [p for p in result["policies"] if p != "full" and "quest" not in p]

    def acc(task, n, policy, budget):
        r = [r for r in result["accuracy"] if (r["task"], r["length"], r["policy"], r["budget"]) == (task, n, policy, budget)]
        return (r[0]["accuracy"], r[0]["samples"]) if r else (None, 0)

    rows = []
    for n in result["lengths"]:
        for task in result["tasks"]:
            full, samples = acc(task, n, "full", None)
            if full is None:
                continue
            best = max(((acc(task, n, p, budgets[-1])[0] or 0.0, p) for p in evictors), default=(None, ""))
            rows.append([n, task, samples, f"{100 * full:.0f}%"]
                        + [f"{100 * a:.0f}%" if (a := acc(task, n, quest, b)[0]) is not None else "" for b in budgets]
                        + ([f"{100 * best[0]:.0f}% ({best[1].split(':')[0]})"] if evictors else []))
    headers = (["context", "task", "samples", "full"] + [f"Quest {b}" for b in budgets]
               + ([f"best evictor at {budgets[-1]}"] if evictors else []))
    return markdown_table(headers, rows)


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, n) for t in result["tasks"] for n in result["lengths"]
              if any(r["task"] == t and r["length"] == n for r in result["accuracy"])]
    has_latency = bool(result.get("latency"))
    fig, axes = plt.subplots(1, len(panels) + has_latency, figsize=(4.2 * (len(panels) + has_latency), 3.6), squeeze=False)
    colors = plt.cm.tab20(np.linspace(0, 1, 20))
    styles = {name: {"color": colors[(2 * i) % 20 + (2 * i) // 20], "marker": "os^vD<>ph*"[i % 10]}
              for i, name in enumerate(result["policies"])}
    for ax, (task, n) in zip(axes[0], panels):
        for name in result["policies"]:
            cells = sorted((r for r in result["accuracy"] if r["task"] == task and r["length"] == n
                            and r["policy"] == name), key=lambda r: r["budget"] or 0)
            if name == "full" and cells:
                ax.axhline(100 * cells[0]["accuracy"], color="black", ls="--", label="full")
            elif cells:
                ax.plot([r["budget"] for r in cells], [100 * r["accuracy"] for r in cells], label=name, **styles[name])
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


def jnp_name(dtype) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


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
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int, default=None,
                        help="batches to run per task and length in this call (resume later for the rest)")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--question-in-prefill", action="store_true",
                        help="prefill the question with the context (SnapKV's setting) instead of feeding it by decode")
    parser.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                        help="KV page dtype (default: the model's dtype)")
    parser.add_argument("--reuse", default=None,
                        help="another sweep's checkpoint (.batches.jsonl) of the same setting: cells it holds for a "
                             "batch this call runs are copied from it instead of run")
    parser.add_argument("--out", default=default_out("sweep"))
    parser.add_argument("--name", default="sweep")
    args = parser.parse_args(argv)

    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    os.makedirs(args.out, exist_ok=True)
    model = kvjax.load_model(args.model, kv_dtype=args.kv_dtype)
    result = run_sweep(model, args.policies, args.budgets, args.lengths, args.tasks, args.samples, args.records,
                       args.seed, args.dense_layers, batch_size=args.batch_size, latency=not args.no_latency,
                       checkpoint=f"{args.out}/{args.name}.batches.jsonl", max_batches=args.max_batches,
                       question_in_prefill=args.question_in_prefill, reuse=args.reuse)
    result["model"] = args.model
    result["kv_dtype"] = jnp_name(model.cache_dtype)
    table = accuracy_table(result)
    paths = write_outputs(args.out, args.name, result, table)
    paths["png"] = plot(result, f"{args.out}/{args.name}.png")
    print(table)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
