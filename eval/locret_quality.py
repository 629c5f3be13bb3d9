"""Locret against SnapKV and H2O at the same budget on the multi-key needle task (the shipped model).

    python -m eval.locret_quality                         # trains heads first (a few minutes), then evaluates
    python -m eval.locret_quality --heads runs/locret/heads

Training data: synthetic long-document QA in LongAlpaca's format (`kvjax.tasks.longalpaca`), heads
trained by `train.locret`. Evaluation: multi-key needle prompts (4 records) of about `--length` tokens;
the question's tokens arrive as decode steps after compression (`decode_last`), answers are greedy and
scored by exact match of the digits. Every policy leaves `--dense-layers` layers whole (1: the shipped
model's layer 0 holds a hand-set previous-token head). Writes locret_quality.* under --out (default ./kvjax-results/locret).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from .lib.report import default_out, machine_info, markdown_table, write_outputs
from .lib.retrieval import accuracy, answer_samples

DEFAULT_MODEL = "tiny"


def train_heads(model_dir: str, out: str, rows: int, steps: int, seed: int) -> str:
    from kvjax.tasks.longalpaca import multikey_rows, write_jsonl
    from kvjax.train import locret as train_locret

    os.makedirs(out, exist_ok=True)
    data = write_jsonl(multikey_rows(np.random.default_rng(seed + 1000), rows, (900, 1900)), os.path.join(out, "train.jsonl"))
    run = os.path.join(out, "heads_run")
    train_locret.main([
        "--model", model_dir, "--data", data, "--out", run, "--steps", str(steps), "--warmup", str(max(steps // 6, 1)),
        "--chunk-size", "1024", "--max-length", "2048", "--max-answer", "16", "--save-every", str(steps), "--lr", "1e-3",
        "--seed", str(seed),
    ])
    return os.path.join(run, "heads")


def training_summary(heads: str) -> dict | None:
    """`train.locret`'s summary.json beside the heads (throughput, final loss), when there is one."""
    import json

    path = os.path.join(os.path.dirname(os.path.abspath(heads)), "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    return {k: summary[k] for k in ("steps_done", "final_loss", "examples", "steps_per_second", "tokens_per_second", "timed_steps")}


def evaluate(model, policy, samples, chunk: int, batch: int) -> tuple[float, float]:
    """(exact-match accuracy, seconds), with the question fed as decode steps (eval.lib.retrieval's protocol)."""
    began = time.perf_counter()
    scored = answer_samples(model, policy, samples, "multikey", 0, batch_size=batch, chunk_size=chunk)
    return accuracy(scored), time.perf_counter() - began


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--heads", default=None, help="trained heads (orbax dir or .safetensors); trained here when absent")
    p.add_argument("--train-rows", type=int, default=400)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128])
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--length", type=int, default=1500, help="prompt tokens")
    p.add_argument("--records", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (Locret evicts after each)")
    p.add_argument("--dense-layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=default_out("locret"))
    p.add_argument("--work", default="runs/locret_quality", help="training data, checkpoints and heads go here")
    args = p.parse_args(argv)

    import kvjax
    from tqdm import tqdm
    from kvjax.tasks.synthetic import multikey_sample

    os.makedirs(args.out, exist_ok=True)
    heads = args.heads or train_heads(args.model, args.work, args.train_rows, args.train_steps, args.seed)
    model = kvjax.load_model(args.model)
    rng = np.random.default_rng(args.seed)
    samples = [multikey_sample(rng, args.length, args.records) for _ in range(args.samples)]
    dense = args.dense_layers
    runs = [("full", None, kvjax.make_policy("full"))]
    for b in args.budgets:
        runs += [
            ("locret", b, kvjax.make_policy(
                "locret", token_budget=b, stabilizers=b // 4, local_tail=b // 8, heads=heads, dense_layers=dense
            )),
            ("snapkv", b, kvjax.make_policy("snapkv", token_budget=b, dense_layers=dense)),
            ("h2o", b, kvjax.make_policy("h2o", token_budget=b, dense_layers=dense)),
        ]
    payload = {
        "machine": machine_info(),
        "model": args.model,  # as given: committed results carry no absolute path of the machine
        "heads": heads,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
        "locret_options": "stabilizers = budget // 4, local_tail = budget // 8",
        "heads_training": training_summary(heads),
        "results": [],
    }
    headers = ["policy", "token budget", "exact match", "seconds"]
    for name, budget, policy in tqdm(runs, desc="policies", unit="policy"):
        accuracy, seconds = evaluate(model, policy, samples, args.chunk, args.batch)
        payload["results"].append({"policy": name, "token_budget": budget, "accuracy": accuracy, "seconds": seconds})
        tqdm.write(str(payload["results"][-1]))
        rows = [[r["policy"], r["token_budget"] or "all", round(r["accuracy"], 3), round(r["seconds"], 1)] for r in payload["results"]]
        write_outputs(args.out, "locret_quality", payload, markdown_table(headers, rows))  # after each policy
        plot(payload["results"], os.path.join(args.out, "locret_quality.png"))
    print(markdown_table(headers, rows))
    return payload


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["token_budget"] for r in results if r["token_budget"]})
    names = ["locret", "snapkv", "h2o"]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        acc = [next((r["accuracy"] for r in results if r["policy"] == name and r["token_budget"] == b), np.nan) for b in budgets]
        ax.bar(np.arange(len(budgets)) + i * width, acc, width, label=name)
    full = next((r["accuracy"] for r in results if r["policy"] == "full"), None)
    if full is not None:
        ax.axhline(full, color="black", linestyle="--", label="full cache")
    ax.set_xticks(np.arange(len(budgets)) + width, [str(b) for b in budgets])
    ax.set_xlabel("token budget (slots per kv head)")
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1.05)
    ax.set_title("Multi-key needle (4 records), question after compression")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
