"""Policies x budgets x lengths on the retrieval tasks: JSON, a Quest-Table-1-shaped Markdown table, plots.

Every cell is one policy at one token budget (`full` once per length) on `eval.retrieval`'s protocol
(question fed by decode, after compression). Each batch of samples is prefilled once and every cell that
compresses after prefill is derived from that state (`kvjax.engine.shared_prefill`); the run resumes by batch.
Decode latency per policy is timed on the task's prompts (`time_decodes`). Plots are drawn from the JSON: accuracy against budget (one panel per task and length)
and decode latency against context length.

    python -m eval.sweep --model tiny --lengths 1024 2048 --budgets 64 128 256 --samples 50
    kvjax eval sweep --json
"""

from __future__ import annotations

import argparse
import json
import os
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


def build_policy(spec: str, budget: int | None, dense_layers: int = DEFAULT_DENSE_LAYERS):
    """The policy a sweep names (`kvjax.policies.parse_spec`: `quest`, `quest:dense_layers=0`, `snapkv+quest`),
    each part at `budget` with `dense_layers` unless its spec says otherwise."""
    from kvjax.policies.options import parse_spec

    defaults = {"dense_layers": dense_layers} | ({} if budget is None else {"token_budget": int(budget)})
    return parse_spec(spec, defaults=defaults)


def time_decodes(model, policies: dict, prompts: Sequence[Sequence[int]], steps: int = 16) -> dict:
    """Prefill `prompts` once (`kvjax.engine.shared_prefill`), derive each of `policies` ({key: Policy}; one that
    compresses during prefill or scores in a pass of its own, Locret or KVzip, is prefilled alone), then time
    `steps` decode steps after one warm-up step: {key: {decode_ms_per_step (median), decode_tokens_per_s, batch}}."""
    from kvjax.engine.shared_prefill import shared_prefill

    from ._timing import DecodeRun

    shareable = [p for p in policies.values() if not retrieval.compresses_in_prefill(p)]
    shared = shared_prefill(model, prompts, shareable, reserve_tokens=steps + 8) if shareable else None
    out = {}
    for key, policy in policies.items():
        result = DecodeRun(model, *retrieval.policy_state(model, shared, policy, prompts, steps + 8), policy).run(steps)
        out[key] = {"decode_ms_per_step": 1e3 * result["decode_step_s"],
                    "decode_tokens_per_s": result["decode_tokens_per_s"], "batch": len(prompts)}
    return out


def sweep_cells(policies: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int | None]]:
    """(policy spec, budget) cells of one task and length: `full` once, every other policy at every budget."""
    return [(p, b) for p in policies for b in ((None,) if p == "full" else budgets)]


def _cell_key(spec: str, budget) -> str:
    return spec if budget is None else f"{spec}@{budget}"


def _parse_cell_key(key: str) -> tuple[str, int | None]:
    """`(policy spec, budget)` of a cell key (`quest:dense_layers=2@64`, or `full`)."""
    spec, at, budget = key.rpartition("@")
    return (spec, int(budget)) if at else (key, None)


def run_sweep(model, policies: Sequence[str] = DEFAULT_POLICIES, budgets: Sequence[int] = (64, 128),
              lengths: Sequence[int] = (2048,), tasks: Sequence[str] = ("passkey", "multikey"), num_samples: int = 20,
              num_records: int = 4, seed: int = 0, dense_layers: int = DEFAULT_DENSE_LAYERS, batch_size: int = 8,
              latency: bool = True, progress: bool = True, checkpoint: str | None = None,
              clear_compiled: bool = True, max_batches: int | None = None, latency_batch: int = 1,
              question_in_prefill: bool = False) -> dict:
    """Accuracy rows {task, length, policy, budget, accuracy, correct, samples} and latency rows.

    Each batch of samples is prefilled once, and every cell that compresses after prefill (or only
    selects pages) is derived from that one state (`retrieval.answer_shared`); Locret prefills on its own.
    With `checkpoint` (a jsonl path) every finished batch is appended there with every cell's scores, and
    batches already in it (same setting) are not run again: a killed sweep resumes at the next batch, and
    `max_batches` bounds the batches run per (task, length) in this call (a long sweep spread over several
    sessions: the tables report the samples done so far). The report covers every task, length and cell the
    checkpoint holds for this setting, named in this call or not; the call runs only those named. With `latency`, decode speed per policy at the
    largest budget is timed on `latency_batch` prompts (`time_decodes`). `clear_compiled` drops JAX's compiled steps after
    each (task, length) (long sweeps; the demo keeps them, so its latency pass reuses them)."""
    from tqdm import tqdm

    cells = sweep_cells(policies, budgets)
    setting = {"samples": num_samples, "records": num_records, "seed": seed, "dense_layers": dense_layers,
               "batch_size": batch_size}
    if question_in_prefill:
        setting["question_in_prefill"] = True
    done: dict = {}
    seconds: dict = {}  # (task, length) -> seconds of the batches run, in this call or before it
    if checkpoint and os.path.exists(checkpoint):
        with open(checkpoint) as f:
            for line in f:
                row = json.loads(line)
                if row.pop("setting", None) == setting:
                    done.setdefault((row["task"], row["length"], row["batch"]), {}).update(row["scores"])
                    key = (row["task"], row["length"])
                    seconds[key] = seconds.get(key, 0.0) + row.get("seconds", 0.0)
    scores: dict = {}  # (task, length, cell key) -> [score per sample]; filled from `done` at the end
    batches = -(-num_samples // batch_size)
    for task in tasks:
        for n_tokens in lengths:
            samples = None
            ran = 0
            bar = tqdm(total=batches * len(cells), desc=f"{task} {n_tokens}", disable=not progress)
            for index in range(batches):
                have = done.get((task, n_tokens, index), {})
                todo = [(p, b) for p, b in cells if _cell_key(p, b) not in have]
                if max_batches is not None and ran >= max_batches:
                    todo = []  # this call's batches are spent: report what earlier runs checkpointed
                if todo:
                    if samples is None:
                        samples = retrieval.task_samples(model, task, n_tokens, num_samples, seed, num_records)
                    # strided: depths go in order over the samples, so each batch spans every depth and a
                    # partial run (max_batches) is not biased towards the start of the context
                    batch = samples[index::batches]
                    started = time.perf_counter()
                    bar.update(len(cells) - len(todo))
                    records = retrieval.answer_shared(
                        model, {_cell_key(p, b): build_policy(p, b, dense_layers) for p, b in todo}, batch, task,
                        n_tokens, progress=bar, question_in_prefill=question_in_prefill)
                    new = {key: [r.score if r.score is not None else float(r.correct) for r in rs]
                           for key, rs in records.items()}
                    have = {**have, **new}
                    seconds[(task, n_tokens)] = seconds.get((task, n_tokens), 0.0) + time.perf_counter() - started
                    ran += 1
                    if checkpoint:
                        with open(checkpoint, "a") as f:
                            f.write(json.dumps({"task": task, "length": n_tokens, "batch": index, "scores": new,
                                                "seconds": round(time.perf_counter() - started, 2),
                                                "setting": setting}) + "\n")
                else:
                    bar.update(len(cells))
                if have:
                    done[(task, n_tokens, index)] = have
            bar.close()
            # every (policy, budget) compiles its own steps; dropping them bounds the process's memory maps (a
            # long sweep otherwise ended in "LLVM compilation error: Cannot allocate memory" on a default
            # vm.max_map_count)
            if clear_compiled:
                jax.clear_caches()
    # the report covers every task, length and cell the checkpoint holds for this setting, not only those
    # named in this call (resuming one task must not drop the others from the tables)
    for (task, n_tokens, _), have in sorted(done.items(), key=lambda item: item[0][2]):
        for key, values in have.items():
            scores.setdefault((task, n_tokens, key), []).extend(values)
    report_tasks = list(dict.fromkeys([*tasks, *(t for t, _, _ in done)]))
    report_lengths = sorted({*lengths, *(n for _, n, _ in done)})
    report_cells = [_parse_cell_key(key) for key in dict.fromkeys(
        [_cell_key(p, b) for p, b in cells] + [key for have in done.values() for key in have])]
    report_policies = list(dict.fromkeys([*policies, *(p for p, _ in report_cells)]))
    report_budgets = sorted({*budgets, *(b for _, b in report_cells if b is not None)})
    rows = []
    for task in report_tasks:
        for n_tokens in report_lengths:
            for spec, budget in report_cells:
                values = scores.get((task, n_tokens, _cell_key(spec, budget)))
                if values:
                    rows.append({"task": task, "length": n_tokens, "policy": spec, "budget": budget,
                                 "accuracy": float(np.mean(values)), "correct": int(sum(v == 1.0 for v in values)),
                                 "samples": len(values)})
    latency_rows = []
    if latency:
        for n_tokens in tqdm(lengths, desc="latency", disable=not progress):
            samples = retrieval.task_samples(model, tasks[0], n_tokens, latency_batch, seed, num_records)
            prompts = [retrieval.split_sample(model, s, tasks[0])[0] for s in samples]
            budget = max(budgets)
            timed = time_decodes(model, {p: build_policy(p, None if p == "full" else budget, dense_layers)
                                         for p in policies}, prompts)
            latency_rows += [{"length": n_tokens, "policy": p, "budget": None if p == "full" else budget, **timed[p]}
                             for p in policies]
    return {
        "machine": machine_info(), "policies": report_policies, "budgets": report_budgets, "lengths": report_lengths,
        "tasks": report_tasks, "num_samples": num_samples, "num_records": num_records, "dense_layers": dense_layers,
        "seed": seed, "question_in_prefill": question_in_prefill, "accuracy": rows, "latency": latency_rows,
        "seconds": {f"{t} {n}": round(v, 1) for (t, n), v in seconds.items()},
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
    from ._report import load_line

    return accuracy_table(result) + "\n\n" + load_line(result)


def selection_headline(results: list, budgets=(128, 256)) -> str:
    """The README's selection digest: one row per policy, one column per (task, length, budget) over the
    sweeps given (e.g. the 2K and the 4K selection sweeps) at `budgets` (the aim's), then the samples
    behind each column. Sweeps of the same cells with other seeds are pooled (`eval.selection_aim.pooled`)."""
    from .selection_aim import SHORT_TASK as short, pooled

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
                       question_in_prefill=args.question_in_prefill)
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
