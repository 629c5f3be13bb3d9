"""Full-attention accuracy of a model on the retrieval tasks, by length and by number of records.

The shipped default model's report card (docs/default_model.md): passkey, and multi-key with several
record counts, at several prompt lengths, with Quest's protocol (question fed by decode).

    python -m eval.model_accuracy --model tiny --lengths 512 1024 2048 4096 --records 2 4 8 --samples 100
"""

from __future__ import annotations

import argparse
import json
import sys

from .lib import retrieval
from .lib.report import default_out, machine_info, markdown_table, write_outputs


def run(model, lengths, record_counts, samples: int, seed: int = 0) -> dict:
    import kvjax
    from tqdm import tqdm

    policy = kvjax.make_policy("full")
    cells = [("passkey", None, n) for n in lengths] + [("multikey", r, n) for r in record_counts for n in lengths]
    rows = []
    for task, records, n in tqdm(cells, desc="accuracy"):
        scored = retrieval.run_task(model, policy, task, n, samples, seed, records or 1)
        rows.append({"task": task, "records": records, "length": n, "accuracy": retrieval.accuracy(scored),
                     "samples": len(scored), "by_depth": retrieval.accuracy_by_depth(scored)})
    return {"machine": machine_info(), "lengths": list(lengths), "records": list(record_counts), "samples": samples,
            "seed": seed, "rows": rows}


def table(result: dict) -> str:
    names = ["passkey"] + [f"multi-key, {r} records" for r in result["records"]]
    keyed = {(r["task"] if r["task"] == "passkey" else f"multi-key, {r['records']} records", r["length"]): r["accuracy"]
             for r in result["rows"]}
    rows = [[name] + [f"{100 * keyed[(name, n)]:.1f}%" for n in result["lengths"]] for name in names]
    return (markdown_table(["task"] + [f"{n} tokens" for n in result["lengths"]], rows)
            + f"\nExact match (first integer), full attention, {result['samples']} samples per cell, seed {result['seed']}.\n")


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    series = [("passkey", None)] + [("multikey", r) for r in result["records"]]
    for task, records in series:
        cells = sorted((r for r in result["rows"] if r["task"] == task and r["records"] == records), key=lambda r: r["length"])
        label = "passkey" if task == "passkey" else f"multi-key {records}"
        ax.plot([r["length"] for r in cells], [100 * r["accuracy"] for r in cells], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("exact match %")
    ax.set_ylim(-5, 105)
    ax.legend(fontsize=8)
    ax.set_title("shipped model, full attention")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--records", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=default_out("default_model"))
    args = parser.parse_args(argv)

    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    model = kvjax.load_model(args.model)
    result = run(model, args.lengths, args.records, args.samples, args.seed)
    result["model"] = args.model
    md = table(result)
    paths = write_outputs(args.out, "model_accuracy", result, md)
    paths["png"] = plot(result, f"{args.out}/model_accuracy.png")
    print(md)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
