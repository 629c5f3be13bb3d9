"""Locret with perfect heads: every token scored by its own training label, an upper bound on what
retaining heads can do on a task.

Locret's heads learn to predict, for each context token and kv head, the largest pre-softmax attention
logit that any query of the answer gives it (`kvjax.locret.labels`). Here the labels themselves are the
scores: for each sample the frozen model reads context + question + gold answer, densely, and those
labels drive Locret's own chunked-prefill eviction (`LabelScoredLocret`: Locret with the heads replaced
by a lookup of the labels). The oracle knows the question, which no head can, so it bounds the method
from above:

- if the oracle keeps the needle and answers, the heads fall short of their labels (capacity, training,
  data);
- if it fails too, the labels or the eviction itself are the limit, and better heads cannot help.

Cells per batch (the sweep's samples and batches, so they compare with the sweep's Locret cells):

- `locret`: the heads named by `--heads`, at every budget;
- `oracle`: labels as scores at every budget, chunked as Locret prefills (`--chunk`);
- `oracle, one chunk`: the labels at every budget, the whole context prefilled densely as one chunk and
  evicted once: what the labels select when no later chunk is computed from an evicted cache.

Each cell reports accuracy and the share of the asked needle's tokens kept (mean over layers and kv heads,
read from the state after prefill). The run resumes by batch from `<name>.batches.jsonl`.

    python -m eval.locret_oracle --model smollm2-135m --tasks real_passkey niah_single --length 4096 \\
        --budgets 256 512 --batches 2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.policies.locret import Locret

from .lib import retrieval
from .lib.locret_labels import LabelScoredLocret, batch_labels
from .lib.needles import answer_ids, needle_kept, needle_span
from .lib.report import machine_info, markdown_table, write_and_print
from .lib.sweep import pool_batches


def run_batch(model, samples, task: str, length: int, budgets, heads, stabilizers: int, local_tail: int,
              chunk: int, progress=None) -> dict:
    """{cell key: {"scores": [per sample], "needle_kept": [per sample]}} for one batch of samples."""
    from kvjax.engine.generation import continue_rows

    split = [retrieval.split_sample(model, s, task) for s in samples]
    contexts = [c for c, _, _ in split]
    labels = jnp.asarray(batch_labels(model, contexts, [q + answer_ids(model, s) for (_, q, _), s in zip(split, samples)],
                                      chunk))
    questions = [np.asarray(q, np.int32) for _, q, _ in split]
    max_new = max(m for _, _, m in split)
    reserve = max(len(q) for q in questions) + max_new
    spans = [needle_span(model, s) for s in samples]
    one_chunk = -(-max(map(len, contexts)) // chunk) * chunk
    settings = {"stabilizers": stabilizers, "local_tail": local_tail}
    cells = {}
    for budget in budgets:
        cells[f"locret@{budget}"] = (Locret(token_budget=budget, heads=heads, **settings), chunk)
        cells[f"oracle@{budget}"] = (LabelScoredLocret(token_budget=budget, labels=labels, **settings), chunk)
        cells[f"oracle, one chunk@{budget}"] = (LabelScoredLocret(token_budget=budget, labels=labels, **settings),
                                                one_chunk)
    out = {}
    for key, (policy, chunk_size) in cells.items():
        state, logits = retrieval.policy_state(model, None, policy, contexts, reserve, chunk_size=chunk_size)
        kept = needle_kept(state, spans)  # before decoding donates the state
        tokens = continue_rows(model, state, logits, questions, max_new, policy)
        scored = [retrieval.score_sample(model, s, task, length, row) for s, row in zip(samples, np.asarray(tokens))]
        out[key] = {"scores": [r.score if r.score is not None else float(r.correct) for r in scored],
                    "needle_kept": kept}
        if progress is not None:
            progress.update(1)
    return out


def run(model, tasks, length: int, budgets, heads, num_samples: int = 50, batch_size: int = 10,
        max_batches: int | None = None, stabilizers: int = 64, local_tail: int = 64, chunk: int = 512, seed: int = 0,
        checkpoint: str | None = None, progress: bool = True) -> dict:
    """Every task's batches (the sweep's: `samples[index::batches]`), resumed from `checkpoint`; returns the
    report {"cells": [{task, length, cell, budget, accuracy, needle_kept, samples}], ...}."""
    from tqdm import tqdm

    setting = {"length": length, "samples": num_samples, "batch_size": batch_size, "seed": seed,
               "stabilizers": stabilizers, "local_tail": local_tail, "chunk": chunk, "heads": str(heads)}
    done: dict = {}
    if checkpoint and os.path.exists(checkpoint):
        with open(checkpoint) as f:
            for line in f:
                row = json.loads(line)
                if row["setting"] == setting:
                    done.setdefault((row["task"], row["batch"]), {}).update(row["cells"])
    batches = -(-num_samples // batch_size)
    per_batch = 3 * len(budgets)
    for task in tasks:
        samples = None
        wanted = range(batches if max_batches is None else min(batches, max_batches))
        bar = tqdm(total=len(wanted) * per_batch, desc=f"{task} {length}", disable=not progress)
        for index in wanted:
            have = done.get((task, index), {})
            if all(f"{name}@{b}" in have for b in budgets for name in ("locret", "oracle", "oracle, one chunk")):
                bar.update(per_batch)
                continue
            if samples is None:
                samples = retrieval.task_samples(model, task, length, num_samples, seed)
            started = time.perf_counter()
            new = run_batch(model, samples[index::batches], task, length, budgets, heads, stabilizers, local_tail,
                            chunk, progress=bar)
            done[(task, index)] = new
            if checkpoint:
                with open(checkpoint, "a") as f:
                    f.write(json.dumps({"task": task, "batch": index, "cells": new, "setting": setting,
                                        "seconds": round(time.perf_counter() - started, 1)}) + "\n")
        bar.close()
        jax.clear_caches()
    pooled = pool_batches(done)
    cells = []
    for task in tasks:
        for (t, key), values in pooled.items():
            if t != task:
                continue
            name, budget = key.rsplit("@", 1)
            cells.append({"task": task, "length": length, "cell": name, "budget": int(budget),
                          "accuracy": float(np.mean(values["scores"])), "needle_kept": float(np.mean(values["needle_kept"])),
                          "samples": len(values["scores"])})
    return {"machine": machine_info(), "setting": setting, "cells": cells}


def table(result: dict) -> str:
    """Per task: rows = cells (locret, oracle, oracle in one chunk), columns = budgets, "accuracy (needle
    tokens kept)"."""
    parts = []
    for task in dict.fromkeys(c["task"] for c in result["cells"]):
        mine = [c for c in result["cells"] if c["task"] == task]
        budgets = sorted({c["budget"] for c in mine})
        rows = []
        for name in dict.fromkeys(c["cell"] for c in mine):
            row = [name]
            for budget in budgets:
                found = [c for c in mine if c["cell"] == name and c["budget"] == budget]
                row.append(f"{100 * found[0]['accuracy']:.0f}% ({100 * found[0]['needle_kept']:.0f}%)" if found else "")
            rows.append(row)
        n = max(c["samples"] for c in mine)
        length = result["setting"]["length"]
        parts.append(f"**{task}**, {length} tokens, {n} samples: accuracy (share of the needle's tokens kept, "
                     "mean over layers and kv heads)\n\n"
                     + markdown_table(["cell"] + [f"{b} (1/{round(length / b)})" for b in budgets], rows))
    return "\n\n".join(parts) + "\n"


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(c["task"] for c in result["cells"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.8 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [c for c in result["cells"] if c["task"] == task]
        budgets = sorted({c["budget"] for c in mine})
        names = list(dict.fromkeys(c["cell"] for c in mine))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [next((c["accuracy"] for c in mine if c["cell"] == name and c["budget"] == b), 0.0) for b in budgets]
            ax.bar(np.arange(len(budgets)) + i * width, ys, width, label=name)
        ax.set_xticks(np.arange(len(budgets)) + width * (len(names) - 1) / 2, [str(b) for b in budgets])
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("budget (tokens)")
        ax.set_title(f"{task}, {result['setting']['length']} tokens", fontsize=9)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    from kvjax.models.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--heads", default=None, help="retaining heads to compare (default: the model's shipped heads)")
    parser.add_argument("--tasks", nargs="+", default=["real_passkey", "niah_single"], choices=retrieval.REAL_TASKS)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--batches", type=int, default=None, help="batches per task in this call (resume later)")
    parser.add_argument("--stabilizers", type=int, default=64)
    parser.add_argument("--local-tail", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", default="results/locret")
    parser.add_argument("--name", default="locret_oracle")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    heads = args.heads or args.model
    os.makedirs(args.out, exist_ok=True)
    result = run(model, args.tasks, args.length, args.budgets, heads, args.samples, args.batch_size, args.batches,
                 args.stabilizers, args.local_tail, args.chunk,
                 checkpoint=os.path.join(args.out, f"{args.name}.batches.jsonl"))
    return write_and_print(args.out, args.name, result, table(result), plot)


if __name__ == "__main__":
    main()
