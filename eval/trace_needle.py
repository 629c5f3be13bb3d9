"""Why a policy misses a needle: where full attention finds it, and whether each policy kept it there.

For one real-text sample (`kvjax.tasks.needles`), the full model is run densely over context + question
and, per layer and query head, the attention mass that the question's last token (the one whose logits
give the first answer token) puts on the asked needle's tokens is recorded: the heads that retrieve.
Then each policy's state after compression is derived from one shared prefill of the context, and, per
layer and kv head, the share of the needle's tokens it kept is read from `kvjax.cache.compaction.kept_positions`.
A policy that fails while its heads kept the needle lost it elsewhere (at decode, in Quest's page
choice); one that evicted the needle in the retrieving heads lost it at compression. JSON, Markdown and a
heatmap PNG (mass per head; kept share per head for each policy).

    kvjax eval trace-needle --task real_passkey --length 2048 --sample 3 --policies snapkv h2o quest --budget 256
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .lib import retrieval
from .lib.needles import kept_share, needle_attention, needle_span, value_span
from .lib.policies import build_policy
from .lib.report import default_out, markdown_table, write_outputs


def trace(model, task: str, length: int, sample_index: int, policies, budget: int, dense_layers: int = 0,
          seed: int = 0, question_in_prefill: bool = False, num_samples: int = 50) -> dict:
    from kvjax.engine.generation import continue_rows
    from kvjax.engine.shared_prefill import shared_prefill

    if not 0 <= sample_index < num_samples:
        raise ValueError(f"sample {sample_index} is not among the {num_samples} samples")
    # the sweep's samples (same count and seed): sample i sits at depth i / (num_samples - 1)
    sample = retrieval.task_samples(model, task, length, num_samples, seed)[sample_index]
    span = needle_span(model, sample)
    mass = needle_attention(model, sample.context_ids + sample.question_ids, span)
    context, question, max_new = retrieval.split_sample(model, sample, task)
    if question_in_prefill:  # SnapKV's setting: the question is compressed with the context
        context, question = context + question, []
    values = value_span(model, sample, span)
    built = {p: build_policy(p, None if p == "full" else budget, dense_layers) for p in ("full", *policies)}
    reserve = len(question) + max_new
    shared = shared_prefill(model, [context], [p for p in built.values() if not retrieval.compresses_in_prefill(p)],
                            reserve_tokens=reserve)
    out = {"task": task, "length": length, "sample": sample_index, "budget": budget, "depth": sample.depth,
           "question_in_prefill": question_in_prefill, "value_tokens": [int(values[0]), int(values[-1])],
           "answer": sample.answer, "needle_tokens": [int(span[0]), int(span[-1])], "mass": mass.tolist(), "policies": {}}
    for name, policy in built.items():
        state, logits = retrieval.policy_state(model, shared, policy, [context], reserve)
        share, value_share = kept_share(state, span), kept_share(state, values)  # before decoding donates the state
        tokens = continue_rows(model, state, logits, [np.asarray(question, np.int32)], max_new, policy)
        scored = retrieval.score_sample(model, sample, task, length, tokens[0])
        out["policies"][name] = {"kept_share": share.tolist(), "value_kept_share": value_share.tolist(),
                                 "answer_text": scored.text,
                                 "score": scored.score if scored.score is not None else float(scored.correct)}
    return out


def trace_table(result: dict) -> str:
    mass = np.asarray(result["mass"])  # [L, Hq]
    per_layer = mass.max(axis=1)
    top = np.argsort(per_layer)[::-1][:5]
    rows = []
    for name, r in result["policies"].items():
        share = np.asarray(r["kept_share"])  # [L, H]
        G = mass.shape[1] // share.shape[1]
        head_mass = mass.reshape(mass.shape[0], share.shape[1], G).sum(-1)  # [L, H]
        weighted = float((share * head_mass).sum() / head_mass.sum())
        # a trace from before the value's tokens were recorded (`value_kept_share`) has no such column
        value = [f"{100 * np.mean(r['value_kept_share']):.0f}%"] if "value_kept_share" in r else []
        rows.append([name, f"{r['score']:.2f}", repr(r["answer_text"][:40]), f"{100 * share.mean():.0f}%",
                     f"{100 * weighted:.0f}%", *value, " ".join(f"{100 * share[l].mean():.0f}" for l in top)])
    setting = ", question prefilled with the context" if result.get("question_in_prefill") else ""
    head = (f"Needle trace: {result['task']}, {result['length']} tokens{setting}, sample {result['sample']} (depth "
            f"{result['depth']:.2f}, answer {result['answer']}), budget {result['budget']}. Layers where the question's "
            f"last token puts the most mass on the needle: {', '.join(f'{l} ({per_layer[l]:.2f})' for l in top)}\n\n")
    with_value = ["value tokens kept"] if all("value_kept_share" in r for r in result["policies"].values()) else []
    return head + markdown_table(
        ["policy", "score", "answer", "needle kept (all heads)", "kept, weighted by needle mass",
         *with_value, "kept % in the top layers"], rows)


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["policies"] if n != "full"]
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(2.6 * (1 + len(names)), 4.2), squeeze=False)
    ax = axes[0][0]
    im = ax.imshow(np.asarray(result["mass"]), aspect="auto", cmap="viridis")
    ax.set_title("needle mass (full)")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, fraction=0.05)
    for ax, name in zip(axes[0][1:], names):
        ax.imshow(np.asarray(result["policies"][name]["kept_share"]), aspect="auto", cmap="Greens", vmin=0, vmax=1)
        ax.set_title(f"{name}: kept (score {result['policies'][name]['score']:.0f})", fontsize=8)
        ax.set_xlabel("kv head")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Where full attention finds a needle and which policies kept it")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="real_passkey", choices=list(retrieval.REAL_TASKS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--sample", type=int, default=0, help="which of the sweep's --samples (depth sample / (samples - 1))")
    parser.add_argument("--samples", type=int, default=50, help="the sweep's sample count (the samples' depths spread over it)")
    parser.add_argument("--policies", nargs="+", default=["quest", "snapkv", "ada_snapkv", "h2o", "streaming"])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--dense-layers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--question-in-prefill", action="store_true",
                        help="compress the question with the context (SnapKV's setting)")
    parser.add_argument("--out", default=default_out("trace_needle"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)

    import kvjax

    model = kvjax.load_model(args.model)
    result = trace(model, args.task, args.length, args.sample, args.policies, args.budget, args.dense_layers, args.seed,
                   args.question_in_prefill, args.samples)
    name = args.name or (f"{args.task}_{args.length}_s{args.sample}_b{args.budget}"
                         + ("_question_prefilled" if args.question_in_prefill else ""))
    table = trace_table(result)
    paths = write_outputs(args.out, name, result, table)
    paths["png"] = plot(result, f"{args.out}/{name}.png")
    print(table)
    print(json.dumps(paths), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
