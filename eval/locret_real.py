"""Locret on the real model, read out of the retrieval sweeps: Locret beside full attention and the
evictors its paper compares with (SnapKV, Ada-SnapKV, H2O, StreamingLLM), per task and context, at every
budget the sweeps measured, with each budget's share of the context (Locret's paper uses 1/16 and 1/8).

Nothing is run here: the cells come from the sweeps' JSON (`eval.sweep`, committed under
`results/real/`), so this table and the sweep's agree by construction. Writes locret_real.{json,md,png}.

    python -m eval.locret_real --sweeps results/real/retrieval.json results/real/retrieval_8k.json \\
        --out results/locret
"""

from __future__ import annotations

import argparse
import json

from .lib.report import markdown_table, write_outputs

COMPARED = ("full", "snapkv", "ada_snapkv", "h2o", "streaming")
COLORS = {"snapkv": "C3", "ada_snapkv": "C0", "h2o": "C1", "streaming": "C4", "locret": "C2"}  # same in every panel


def is_locret(policy: str) -> bool:
    return policy.split(":")[0] == "locret"


def locret_cells(sweep_paths: list[str]) -> list[dict]:
    """The sweeps' cells of Locret and the compared policies, for every (task, length) where Locret has one.
    Each cell: task, length, policy, budget (None: full attention), accuracy, correct, samples."""
    cells = []
    for path in sweep_paths:
        with open(path) as f:
            cells += json.load(f)["accuracy"]
    with_locret = {(c["task"], c["length"]) for c in cells if is_locret(c["policy"]) and c["samples"]}
    return [c for c in cells if (c["task"], c["length"]) in with_locret and c["samples"]
            and (is_locret(c["policy"]) or c["policy"] in COMPARED)]


def tables(cells: list[dict]) -> str:
    """One Markdown table per (task, length): rows = policies (full first, Locret last), columns = budgets
    with their share of the context; a cell with fewer samples than the most in its table says n."""
    parts = []
    for task, length in sorted({(c["task"], c["length"]) for c in cells}, key=lambda k: (k[1], k[0])):
        mine = [c for c in cells if c["task"] == task and c["length"] == length]
        budgets = sorted({c["budget"] for c in mine if c["budget"] is not None})
        most = max(c["samples"] for c in mine)
        policies = ["full"] + [p for p in COMPARED[1:] if any(c["policy"] == p for c in mine)]
        policies += sorted({c["policy"] for c in mine if is_locret(c["policy"])})
        rows = []
        for policy in policies:
            row = [policy]
            for budget in budgets:
                found = [c for c in mine if c["policy"] == policy and (c["budget"] == budget or policy == "full")]
                if not found:
                    row.append("")
                    continue
                cell = found[0]
                text = f"{100 * cell['accuracy']:.0f}%"
                row.append(text if cell["samples"] == most else f"{text} (n={cell['samples']})")
            rows.append(row)
        headers = ["policy"] + [f"{b} (1/{round(length / b)})" for b in budgets]
        parts.append(f"**{task}**, {length} tokens (accuracy, {most} samples a cell unless marked)\n\n"
                     + markdown_table(headers, rows))
    return "\n\n".join(parts) + "\n"


def plot(cells: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(c["task"], c["length"]) for c in cells}, key=lambda k: (k[1], k[0]))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (task, length) in zip(axes[0], keys):
        mine = [c for c in cells if c["task"] == task and c["length"] == length]
        for policy in sorted({c["policy"] for c in mine}):
            points = sorted((c["budget"] / length, c["accuracy"]) for c in mine
                            if c["policy"] == policy and c["budget"] is not None)
            if policy == "full":
                ax.axhline(mine[[c["policy"] for c in mine].index("full")]["accuracy"], color="black", ls="--",
                           label="full")
            elif points:
                xs, ys = zip(*points)
                name = "locret" if is_locret(policy) else policy
                ax.plot(xs, ys, marker="o", lw=2.5 if is_locret(policy) else 1, color=COLORS.get(name), label=name)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}, {length} tokens", fontsize=9)
        ax.set_xlabel("budget / context")
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", nargs="+", default=["results/real/retrieval.json",
                                                         "results/real/retrieval_8k.json"])
    parser.add_argument("--out", default="results/locret")
    parser.add_argument("--name", default="locret_real")
    args = parser.parse_args(argv)
    cells = locret_cells(args.sweeps)
    if not cells:
        raise SystemExit(f"no Locret cells in {', '.join(args.sweeps)}: run eval.sweep with a locret policy first")
    paths = write_outputs(args.out, args.name, {"sweeps": args.sweeps, "cells": cells}, tables(cells))
    paths["png"] = f"{args.out}/{args.name}.png"
    plot(cells, paths["png"])
    print(open(paths["md"]).read())
    print(json.dumps(paths))
    return paths


if __name__ == "__main__":
    main()
