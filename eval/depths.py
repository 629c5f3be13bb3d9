"""Accuracy by needle depth from a sweep's checkpoint: where in the context each policy loses the needle.

The sweep (`eval.sweep`) checkpoints every cell's per-sample scores batch by batch; the samples are
rebuilt here from the same seed (they are deterministic: `eval.lib.retrieval.task_samples`), so each score gets
its needle's realised depth (the fraction of the filler before it). One table per (task, length) at one
budget (default the sweep's largest): rows = policies, columns = depth bins; and a plot of the same.

    python -m eval.depths --checkpoint results/real/retrieval.batches.jsonl --model smollm2-135m \\
        --tasks real_passkey niah_single --lengths 2048 4096 --samples 50 --batch-size 10 --dense-layers 0
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from .lib import retrieval
from .lib.report import markdown_table, write_outputs
from .lib.tables import recorded_load

DEFAULT_BINS = 5


def scores_by_depth(checkpoint: str, samples_of, tasks, lengths, setting: dict, budget: int | None) -> dict:
    """{(task, length): {policy: [(depth, score), ...]}} for the cells at `budget` (and full attention's), from checkpoint rows of `setting`. `samples_of(task, length)` rebuilds the sweep's samples."""
    batches = -(-setting["samples"] // setting["batch_size"])
    out: dict = {}
    with open(checkpoint) as f:
        rows = [json.loads(line) for line in f]
    for task in tasks:
        for length in lengths:
            mine = [r for r in rows if r["task"] == task and r["length"] == length and r.get("setting") == setting]
            if not mine:
                continue
            samples = samples_of(task, length)
            cells: dict = {}
            for row in mine:
                depths = [s.depth for s in samples[row["batch"]::batches]]  # the sweep's strided batches
                for key, values in row["scores"].items():
                    policy, _, cell_budget = key.rpartition("@") if "@" in key else (key, "", None)
                    if cell_budget is None or cell_budget == str(budget):
                        cells.setdefault(policy, []).extend(zip(depths, values))
            out[(task, length)] = cells
    return out


def binned(pairs, bins: int) -> list[float | None]:
    """Mean score per depth bin [k/bins, (k+1)/bins) (the last bin closed)."""
    edges = np.linspace(0, 1, bins + 1)
    out = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        hits = [s for d, s in pairs if lo <= d < hi or (k == bins - 1 and d == hi)]
        out.append(float(np.mean(hits)) if hits else None)
    return out


def depth_block(task: str, length: int, budget, bins: int, rows) -> str:
    """One (task, length) table; `rows` are (policy, accuracy per depth bin, samples)."""
    labels = [f"{lo:.1f}-{hi:.1f}" for lo, hi in zip(np.linspace(0, 1, bins + 1)[:-1], np.linspace(0, 1, bins + 1)[1:])]
    body = [[policy] + ["" if a is None else f"{100 * a:.0f}%" for a in by_depth] + [samples]
            for policy, by_depth, samples in rows]
    return (f"**{task}**, {length} tokens, budget {budget} (accuracy by needle depth)\n\n"
            + markdown_table(["policy"] + [f"depth {x}" for x in labels] + ["samples"], body))


def depth_tables(found: dict, policies, bins: int, budget) -> str:
    return "\n".join(depth_block(task, length, budget, bins,
                                 [(p, binned(cells[p], bins), len(cells[p])) for p in policies if p in cells])
                     for (task, length), cells in found.items())


def depth_table(payload: dict, task: str, length: int) -> str:
    """The (task, length) table of `depth_tables`, from the JSON `main` writes (its rows in the JSON's order)."""
    rows = [(r["policy"], r["by_depth"], r["samples"]) for r in payload["accuracy_by_depth"]
            if (r["task"], r["length"]) == (task, length)]
    return depth_block(task, length, payload["budget"], payload["bins"], rows)


def passkey_4k(payload: dict) -> str:
    """The committed JSON's passkey at 4K as the docs show it: `depth_table` with the run's load."""
    return depth_table(payload, "real_passkey", 4096) + "\n" + recorded_load(payload)


def plot(found: dict, policies, bins: int, budget, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centers = (np.arange(bins) + 0.5) / bins
    fig, axes = plt.subplots(1, len(found), figsize=(4.2 * len(found), 3.6), squeeze=False)
    for ax, ((task, length), cells) in zip(axes[0], found.items()):
        for policy in policies:
            if policy in cells:
                values = binned(cells[policy], bins)
                ax.plot(centers, [np.nan if v is None else 100 * v for v in values], marker="o", label=policy,
                        color="black" if policy == "full" else None, ls="--" if policy == "full" else "-")
        ax.set_title(f"{task}, {length} tokens, budget {budget}", fontsize=9)
        ax.set_xlabel("needle depth")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a sweep's .batches.jsonl")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--lengths", nargs="+", type=int, required=True)
    parser.add_argument("--policies", nargs="+", default=None, help="rows, in order (default: every policy found)")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--bins", type=int, default=DEFAULT_BINS)
    parser.add_argument("--samples", type=int, required=True, help="the sweep's --samples")
    parser.add_argument("--batch-size", type=int, required=True, help="the sweep's --batch-size")
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--question-in-prefill", action="store_true")
    parser.add_argument("--out", default=None, help="default: beside the checkpoint")
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)

    import kvjax

    model = kvjax.load_model(args.model)
    setting = {"samples": args.samples, "records": args.records, "seed": args.seed, "dense_layers": args.dense_layers,
               "batch_size": args.batch_size}
    if args.question_in_prefill:
        setting["question_in_prefill"] = True
    found = scores_by_depth(
        args.checkpoint,
        lambda task, n: retrieval.task_samples(model, task, n, args.samples, args.seed, args.records),
        args.tasks, args.lengths, setting, args.budget,
    )
    if not found:
        raise SystemExit(f"no rows of setting {setting} for {args.tasks} x {args.lengths} in {args.checkpoint}")
    policies = args.policies or sorted({p for cells in found.values() for p in cells}, key=lambda p: (p != "full", p))
    table = depth_tables(found, policies, args.bins, args.budget)
    payload = {"checkpoint": args.checkpoint, "setting": setting, "budget": args.budget, "bins": args.bins,
               "accuracy_by_depth": [{"task": t, "length": n, "policy": p, "by_depth": binned(v, args.bins),
                                      "samples": len(v)} for (t, n), cells in found.items() for p, v in cells.items()]}
    out = args.out or os.path.dirname(os.path.abspath(args.checkpoint))
    name = args.name or os.path.basename(args.checkpoint).split(".")[0] + f"_depths_b{args.budget}"
    paths = write_outputs(out, name, payload, table)
    plot(found, policies, args.bins, args.budget, paths["json"].replace(".json", ".png"))
    print(table)
    return payload


if __name__ == "__main__":
    main()
