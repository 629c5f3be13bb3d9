"""Why a policy misses a needle: where full attention finds it, and whether each policy kept it there.

For one real-text sample (`kvjax.tasks.needles`), the full model is run densely over context + question
and, per layer and query head, the attention mass that the question's last token (the one whose logits
give the first answer token) puts on the asked needle's tokens is recorded: the heads that retrieve.
Then each policy's state after compression is derived from one shared prefill of the context, and, per
layer and kv head, the share of the needle's tokens it kept is read from `kvjax.cache.compaction.kept_positions`.
A policy that fails while its heads kept the needle lost it elsewhere (at decode, in Quest's page
choice); one that evicted the needle in the retrieving heads lost it at compression. JSON, Markdown and a
heatmap PNG (mass per head; kept share per head for each policy). Each policy's kept slots are also
compared with every other's (the share of theirs it keeps); `oracle[:OPTIONS]` is Locret scored by its
oracle labels (`eval.locret_oracle`), so a trace sets the heads' choice beside the labels' top slots.

    kvjax eval trace-needle --task real_passkey --length 2048 --sample 3 --policies snapkv h2o quest --budget 256
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .lib import retrieval
from .lib.needles import answer_ids, kept_overlap, kept_share, needle_attention, needle_span, value_span
from .lib.policies import build_policy
from .lib.report import default_out, markdown_table, write_outputs


def trace(model, task: str, length: int, sample_index: int, policies, budget: int, dense_layers: int = 0,
          seed: int = 0, question_in_prefill: bool = False, num_samples: int = 50) -> dict:
    from kvjax.cache.compaction import kept_positions
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
    built = {p: build_policy(p, None if p == "full" else budget, dense_layers) for p in ("full", *policies)
             if p.partition(":")[0] != "oracle"}
    for name in [p for p in policies if p.partition(":")[0] == "oracle"]:
        built[name] = oracle_policy(model, name, budget, dense_layers, context, question + answer_ids(model, sample))
    reserve = len(question) + max_new
    shared = shared_prefill(model, [context], [p for p in built.values() if not retrieval.compresses_in_prefill(p)],
                            reserve_tokens=reserve)
    out = {"task": task, "length": length, "sample": sample_index, "budget": budget, "depth": sample.depth,
           "question_in_prefill": question_in_prefill, "value_tokens": [int(values[0]), int(values[-1])],
           "answer": sample.answer, "needle_tokens": [int(span[0]), int(span[-1])], "mass": mass.tolist(), "policies": {}}
    kept = {}
    for name, policy in built.items():
        state, logits = retrieval.policy_state(model, shared, policy, [context], reserve)
        kept[name] = kept_positions(state)  # before decoding donates the state
        share, value_share = kept_share(state, span, kept=kept[name]), kept_share(state, values, kept=kept[name])
        tokens = continue_rows(model, state, logits, [np.asarray(question, np.int32)], max_new, policy)
        scored = retrieval.score_sample(model, sample, task, length, tokens[0])
        out["policies"][name] = {"kept_share": share.tolist(), "value_kept_share": value_share.tolist(),
                                 "answer_text": scored.text,
                                 "score": scored.score if scored.score is not None else float(scored.correct),
                                 "kept_slots": [[len(h) for h in layer[0]] for layer in kept[name]]}
    for name in [n for n in out["policies"] if n != "full"]:  # what each keeps of every other's kept slots
        out["policies"][name]["keeps_of"] = {other: kept_overlap(kept[name], kept[other]).tolist()
                                             for other in kept if other not in (name, "full")}
    return out


def oracle_policy(model, spec: str, budget: int, dense_layers: int, context, answer):
    """`oracle[:OPTIONS]`: Locret with `OPTIONS` (`pool=all`, ...) scoring each context token by its oracle label
    (`eval.locret_oracle`: the largest logit the question's and the gold `answer`'s queries give it)."""
    import jax.numpy as jnp

    from kvjax.policies.options import parse_policy_options

    from .lib.locret_labels import LabelScoredLocret, batch_labels

    _, _, options = spec.partition(":")
    fields = {"token_budget": budget, "dense_layers": dense_layers,
              **parse_policy_options("locret", options.split(",") if options else [])}
    return LabelScoredLocret(**fields, labels=jnp.asarray(batch_labels(model, [context], [answer], chunk=512)))


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
         *with_value, "kept % in the top layers"], rows) + overlap_table(result, top)


def overlap_table(result: dict, top) -> str:
    """What each policy keeps of the others' kept slots (all layers and kv heads, then the top layers), and how
    its slots spread over layers; empty for a trace from before these were recorded."""
    named = {n: r for n, r in result["policies"].items() if "keeps_of" in r and n != "full"}
    if not named:
        return ""
    others = list(named)
    short = {n: n.split(":")[0] for n in others}
    short = short if len(set(short.values())) == len(short) else {n: n for n in others}
    rows = []
    for name, r in named.items():
        slots = np.asarray(r["kept_slots"]).mean(axis=1)  # [L]: slots per kv head, each layer
        cells = []
        for other in others:
            if other == name:
                cells.append("")
                continue
            share = np.asarray(r["keeps_of"][other])  # [L, H]
            weight = np.asarray(named[other]["kept_slots"])
            cells.append(f"{100 * (share * weight).sum() / weight.sum():.0f}% ("
                         + " ".join(f"{100 * share[l].mean():.0f}" for l in top) + ")")
        rows.append([short[name], f"{slots.mean():.0f} ({slots.min():.0f}-{slots.max():.0f})",
                     " ".join(f"{slots[l]:.0f}" for l in top), *cells])
    return ("\n\nSlots each policy kept, and the share of another's kept slots it also kept (all layers and kv "
            "heads; in brackets the top layers above)\n\n" + markdown_table(
                ["policy", "slots per kv head, mean (min-max over layers)", "slots in the top layers",
                 *[f"keeps of {short[o]}'s" for o in others]], rows))


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
    parser.add_argument("--policies", nargs="+", default=["quest", "snapkv", "ada_snapkv", "h2o", "streaming"],
                        help="policy specs; oracle[:LOCRET OPTIONS] is Locret scored by its oracle labels")
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
