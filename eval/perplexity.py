"""PG19-style perplexity by token-by-token decode (Quest's, StreamingLLM's and H2O's language-modelling measure).

A prefix of the text is prefilled (and compressed, for methods that compress); every following token is
then fed through a decode step (`kvjax.engine.generation.feed_tokens`), so each prediction reads the cache the
policy keeps (Quest's selection, H2O's and TOVA's eviction) exactly as generation would. The score is the
mean negative log-likelihood of each next token and its exponential (`eval.lib.perplexity`).

As a program, every policy at every budget on real-text windows of a real model, each batch prefilled
once and every policy derived from it (`kvjax.engine.shared_prefill`); JSON, a Markdown table and a plot of
perplexity against budget:

    kvjax eval perplexity-sweep --model smollm2-135m --context 2048 --continuation 128 --texts 10
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Sequence

import numpy as np

from kvjax.engine.generation import feed_tokens
from kvjax.engine.shared_prefill import derive, shared_prefill
from kvjax.tasks import needles

from .lib.policies import DEFAULT_POLICIES, build_policy, cell_key, sweep_cells
from .lib.report import default_out, machine_info, markdown_table, write_outputs


def perplexity_sweep(model, policies: Sequence[str], budgets: Sequence[int], context: int, continuation: int,
                     num_texts: int, batch_size: int = 10, dense_layers: int = 0, seed: int = 0,
                     progress: bool = True) -> dict:
    """Decode perplexity of `num_texts` real-text windows (`context` tokens prefilled, `continuation` scored)
    under every policy spec (`eval.lib.policies.build_policy`) at every budget; `full` once."""
    from tqdm import tqdm

    texts = needles.perplexity_texts(model.tokenizer, context, continuation, num_texts, seed)
    cells = sweep_cells(policies, budgets)
    nll = {cell_key(p, b): [] for p, b in cells}
    started = time.perf_counter()
    bar = tqdm(total=len(cells) * -(-num_texts // batch_size), desc=f"perplexity {context}", disable=not progress)
    built = {cell_key(p, b): build_policy(p, b, dense_layers) for p, b in cells}
    for start in range(0, num_texts, batch_size):
        batch = texts[start : start + batch_size]
        shared = shared_prefill(model, [t.context_ids for t in batch], list(built.values()),
                                reserve_tokens=continuation)
        for key, policy in built.items():
            state, logits = derive(model, shared, policy)
            _, _, values = feed_tokens(model, state, logits, [np.asarray(t.continuation_ids, np.int32) for t in batch],
                                       policy, return_nll=True)
            nll[key].append(values)
            bar.update(1)
        del shared
    bar.close()
    rows = []
    for spec, budget in cells:
        values = np.concatenate(nll[cell_key(spec, budget)]).astype(np.float64)
        mean = float(np.nanmean(values))
        rows.append({"policy": spec, "budget": budget, "nll": mean, "perplexity": math.exp(mean),
                     "tokens": int(np.isfinite(values).sum())})
    return {"machine": machine_info(), "policies": list(policies), "budgets": list(budgets), "context": context,
            "continuation": continuation, "num_texts": num_texts, "dense_layers": dense_layers, "seed": seed,
            "rows": rows, "seconds": round(time.perf_counter() - started, 1)}


def perplexity_table(result: dict) -> str:
    """Rows = policies, columns = budgets: perplexity of the continuation (full's in every column)."""
    budgets = result["budgets"]
    cells = {(r["policy"], r["budget"]): r["perplexity"] for r in result["rows"]}
    rows = []
    for name in result["policies"]:
        if name == "full":
            rows.append([name] + [f"{cells[(name, None)]:.2f}"] * len(budgets))
        else:
            rows.append([name] + [f"{cells[(name, b)]:.2f}" if (name, b) in cells else "" for b in budgets])
    return (f"Decode perplexity, {result['num_texts']} real-text windows, {result['context']} tokens prefilled, "
            f"{result['continuation']} scored\n\n" + markdown_table(["policy"] + [f"budget {b}" for b in budgets], rows))


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in result["policies"]:
        cells = sorted((r for r in result["rows"] if r["policy"] == name), key=lambda r: r["budget"] or 0)
        if name == "full":
            ax.axhline(cells[0]["perplexity"], color="black", ls="--", label="full")
        else:
            ax.plot([r["budget"] for r in cells], [r["perplexity"] for r in cells], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("token budget")
    ax.set_ylabel("perplexity")
    ax.set_title(f"decode perplexity, {result['context']} + {result['continuation']} tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Decode perplexity on real text, every policy at every budget")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--budgets", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--texts", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--dense-layers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=default_out("perplexity"))
    parser.add_argument("--name", default="perplexity")
    args = parser.parse_args(argv)

    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    model = kvjax.load_model(args.model)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; perplexity on real text needs one")
    result = perplexity_sweep(model, args.policies, args.budgets, args.context, args.continuation, args.texts,
                              args.batch_size, args.dense_layers, args.seed)
    result["model"] = args.model
    table = perplexity_table(result)
    paths = write_outputs(args.out, args.name, result, table)
    paths["png"] = plot(result, f"{args.out}/{args.name}.png")
    print(table)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
