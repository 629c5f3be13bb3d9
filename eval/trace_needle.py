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

`--chunks LOCRET_SPEC` traces Locret's chunked prefill instead (`chunk_trace`, several `--sample`s): the needle
kept after every chunk, a single-chunk run, and what one pooled eviction keeps by the heads' scores, by their
training label (KVzip's score) and by the oracle label, with where each puts the budget by position.

    kvjax eval trace-needle --task real_passkey --length 2048 --sample 3 --policies snapkv h2o quest --budget 256
    kvjax eval trace-needle --task niah_single --length 4096 --sample 10 20 --budget 512 \
        --chunks "locret:heads=smollm2-135m,stabilizers=64,local_tail=64"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from .lib import retrieval
from .lib.needles import answer_ids, kept_overlap, kept_share, needle_attention, needle_span, value_span
from .lib.policies import build_policy
from .lib.report import default_out, markdown_table, write_and_print, write_outputs


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


TENTHS = 10  # position bins of the budget-by-position rows


def chunk_trace(model, task: str, length: int, sample_index: int, spec: str, budget: int, chunk: int = 512,
                seed: int = 0, num_samples: int = 50) -> dict:
    """One sample's needle through Locret's prefill (`spec` at `budget`): the chunked run (chunks of `chunk`,
    the needle kept after each) and a single-chunk run (the context scored at once, then evicted), each answered;
    and what one eviction with the policy's spread keeps when every token is ranked by the chunked run's scores,
    the single chunk's (dense) scores, KVzip's score (the shipped heads' training label, log) and the oracle label
    (question and gold answer, `eval.locret_oracle`). Per scorer: the needle kept per [layer, kv head], slots per
    layer, the budget by position tenth, the needle's best rank in units of the pool."""
    import jax.numpy as jnp

    from kvjax.cache.compaction import kept_positions
    from kvjax.engine.generation import continue_rows
    from kvjax.locret.labels import Batch, kvzip_targets

    from kvjax.policies.locret import Locret

    from .lib.locret_labels import LabelScoredLocret, batch_labels, recorded_prefill

    sample = retrieval.task_samples(model, task, length, num_samples, seed)[sample_index]
    span = needle_span(model, sample)
    mass = needle_attention(model, sample.context_ids + sample.question_ids, span)  # [L, Hq]
    context, question, max_new = retrieval.split_sample(model, sample, task)
    policy = build_policy(spec, budget, 0)
    evicted = len(context) - policy.local_tail  # what the evictions rank; the tail is appended after
    out = {"task": task, "length": length, "sample": sample_index, "budget": budget, "depth": sample.depth,
           "policy": spec, "chunk": chunk, "needle_tokens": [int(span[0]), int(span[-1])], "evicted_tokens": evicted,
           "answer": sample.answer, "mass": mass.tolist(), "runs": {}, "scorers": {}}
    T = len(context)
    prefix = np.zeros((1, -(-T // chunk) * chunk), np.int32)
    prefix[0, :T] = context
    batch = Batch(jnp.asarray(prefix), jnp.asarray([T], jnp.int32), jnp.zeros((1, 1), jnp.int32),
                  jnp.ones((1,), jnp.int32))
    labels = {"KVzip's score (the heads' label)": np.asarray(kvzip_targets(model, batch, chunk_size=chunk).labels),
              "oracle label": batch_labels(model, [context], [question + answer_ids(model, sample)], chunk)}
    options = {f.name: getattr(policy, f.name) for f in dataclasses.fields(Locret) if f.name != "heads"}
    runs = {"chunked": (policy, chunk), "one chunk": (policy, -(-evicted // chunk) * chunk),
            **{f"chunked, by {name}": (LabelScoredLocret(**options, labels=jnp.asarray(values)), chunk)
               for name, values in labels.items()}}
    scores = {}
    for run, (scorer, size) in runs.items():
        if scorer is policy:  # the heads' runs record their scores and each chunk's kept slots
            state, logits, recorded, after = recorded_prefill(model, scorer, context, len(question) + max_new, size)
            scores[f"heads, {run} run"] = recorded[:, :evicted]
        else:
            (state, logits), after = retrieval.policy_state(model, None, scorer, [context], len(question) + max_new,
                                                            chunk_size=size), {}
        final = kept_positions(state)
        tokens = continue_rows(model, state, logits, [np.asarray(question, np.int32)], max_new, scorer)
        scored = retrieval.score_sample(model, sample, task, length, tokens[0])
        out["runs"][run] = {"score": scored.score if scored.score is not None else float(scored.correct),
                            "answer_text": scored.text, "kept_share": kept_share(state, span, kept=final).tolist(),
                            "after_chunk": {str(seen): [[float(np.isin(span, h).mean()) for h in layer] for layer in kept]
                                            for seen, kept in after.items()},
                            "slots": [[len(h) for h in layer[0]] for layer in final]}
    sinks = np.arange(evicted) < policy.sink_size
    for name, values in labels.items():
        scores[name] = np.where(sinks[None, :, None], np.inf, values[:, 0, :evicted])
    for name, values in scores.items():
        keep = one_eviction(values, policy)
        out["scorers"][name] = {"kept_share": keep[:, span].mean(axis=1).tolist(),
                                "slots": keep.sum(axis=1).tolist(), "by_tenth": by_tenth(keep, ~sinks).tolist(),
                                "needle_rank": pool_rank(values, span, policy).tolist()}
    dense, label = (zscored(scores[n][:, ~sinks]) for n in ("heads, one chunk run", "KVzip's score (the heads' label)"))
    chunked = (scores["heads, chunked run"] - scores["heads, one chunk run"])[:, ~sinks]
    tenth = np.minimum(np.arange(evicted) * TENTHS // evicted, TENTHS - 1)[~sinks]
    out["heads_minus_label_z"] = [float((dense - label)[:, tenth == i].mean()) for i in range(TENTHS)]
    out["heads_label_corr"] = [float(np.corrcoef(dense[:, tenth == i].ravel(), label[:, tenth == i].ravel())[0, 1])
                               for i in range(TENTHS)]
    out["chunked_minus_dense"] = [float(chunked[:, tenth == i].mean()) for i in range(TENTHS)]
    needle = span[span >= policy.sink_size] - policy.sink_size  # positions after the sinks
    out["needle_z"] = {"heads": float(dense[:, needle].mean()), "label": float(label[:, needle].mean())}
    return out


def one_eviction(scores: np.ndarray, policy) -> np.ndarray:
    """bool[L, T, H]: what one eviction of `scores f32[L, T, H]` keeps under `policy`'s spread: each kv head's
    `evict_budget` best (pool="head"), or the pool's `evict_budget * H * L` best over every head's `head_bound`
    best slots (pool="all", ties at the threshold kept), as `kvjax.engine.step.pooled_threshold` ranks them."""
    L, T, H = scores.shape
    rank = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1)  # per kv head, 0 = best
    if policy.pool == "head":
        return rank < policy.evict_budget
    cap = min(policy.head_bound, T)
    candidates = np.sort(scores, axis=1)[:, ::-1][:, :cap]
    threshold = np.sort(candidates.ravel())[::-1][min(policy.evict_budget * H * L, candidates.size) - 1]
    return (scores >= threshold) & (rank < cap)


def pool_rank(scores: np.ndarray, span: np.ndarray, policy) -> np.ndarray:
    """f32[L, H]: the rank of the needle's best token among all `scores f32[L, T, H]` (per head with pool="head"),
    in units of the evicted budget (the pool's for pool="all"): below 1 means one eviction keeps it."""
    L, T, H = scores.shape
    if policy.pool == "head":
        return np.array([[(scores[l, :, h] > scores[l, span, h].max()).sum() / policy.evict_budget for h in range(H)]
                         for l in range(L)])
    ordered = np.sort(scores.ravel())
    above = ordered.size - np.searchsorted(ordered, scores[:, span].max(axis=1), side="right")  # [L, H]
    return above / (policy.evict_budget * H * L)


def by_tenth(keep: np.ndarray, ranked: np.ndarray) -> np.ndarray:
    """f32[TENTHS]: the share of `keep bool[L, T, H]`'s kept slots among `ranked` positions (bool[T], the sinks
    left out) in each tenth of the T positions."""
    T = keep.shape[1]
    tenth = np.minimum(np.arange(T) * TENTHS // T, TENTHS - 1)
    counts = np.array([keep[:, (tenth == i) & ranked].sum() for i in range(TENTHS)], np.float64)
    return counts / max(counts.sum(), 1)


def zscored(scores: np.ndarray) -> np.ndarray:
    """`scores f32[L, T, H]` standardised over the whole sequence (all layers and heads), as the heads'
    training normalises its labels (`--label-norm sequence`)."""
    return (scores - scores.mean()) / scores.std()


def mass_weighted(share: np.ndarray, mass: np.ndarray) -> float:
    """`share f32[L, H]` averaged with the needle's attention `mass f32[L, Hq]` summed over each kv head's group."""
    share = np.asarray(share)
    head_mass = mass.reshape(mass.shape[0], share.shape[1], -1).sum(-1)
    return float((share * head_mass).sum() / head_mass.sum())


def reading_head(sample: dict, scorers) -> str:
    """'l.h: a% / b% / ...': the needle kept by one eviction of each of `scorers` in the kv head whose query group
    puts the most attention on it (layer l, kv head h)."""
    mass = np.asarray(sample["mass"])
    H = np.asarray(sample["scorers"][scorers[0]]["kept_share"]).shape[1]
    l, h = np.unravel_index(np.argmax(mass.reshape(mass.shape[0], H, -1).sum(-1)), (mass.shape[0], H))
    return f"{l}.{h}: " + " / ".join(f"{100 * sample['scorers'][n]['kept_share'][l][h]:.0f}%" for n in scorers)


def chunk_table(result: dict) -> str:
    """The chunk traces of `result["samples"]` (`chunk_trace`'s): answers and the needle kept (weighted by the
    needle's attention mass) per run and scorer; kept after each chunk; the budget by position tenth."""
    samples = result["samples"]
    scorers = list(samples[0]["scorers"])
    run_names = list(samples[0]["runs"])
    rows, chunk_rows = [], []
    for s in samples:
        mass = np.asarray(s["mass"])
        runs = s["runs"]
        top = np.argsort(mass.max(axis=1))[::-1][:5]
        label = np.asarray(s["scorers"][scorers[2]]["slots"])
        rows.append([f"{s['task']} {s['sample']} ({s['depth']:.2f})",
                     " / ".join(f"{runs[r]['score']:.0f}" for r in runs),
                     *[f"{100 * mass_weighted(runs[r]['kept_share'], mass):.0f}%" for r in runs],
                     *[f"{100 * mass_weighted(s['scorers'][n]['kept_share'], mass):.0f}%" for n in scorers],
                     " / ".join(f"{np.median(np.asarray(s['scorers'][n]['needle_rank'])[top].min(axis=1)):.2f}"
                                for n in scorers[1:]),
                     f"{np.asarray(runs['chunked']['slots'])[top].mean():.0f} / {label[top].mean():.0f}",
                     reading_head(s, [scorers[0], *scorers[2:]])])
        first = s["needle_tokens"][1]
        chunk_rows.append([f"{s['task']} {s['sample']} ({s['depth']:.2f})", first // s["chunk"] + 1,
                           *[f"{100 * mass_weighted(k, mass):.0f}" if int(seen) > first else "-"
                             for seen, k in s["runs"]["chunked"]["after_chunk"].items()]])
    width = max(len(r) for r in chunk_rows)
    chunk_rows = [r + [""] * (width - len(r)) for r in chunk_rows]
    tenth_rows = [[f"budget share: {n}", *[f"{100 * v:.0f}" for v in np.mean([s["scorers"][n]["by_tenth"] for s in samples], 0)]]
                  for n in scorers]
    for key, what, fmt in (("heads_minus_label_z", "heads' z-score minus the label's (single chunk)", "{:+.2f}"),
                           ("heads_label_corr", "correlation of the heads' scores with the label", "{:.2f}"),
                           ("chunked_minus_dense", "chunked run's score minus the single chunk's", "{:+.2f}")):
        tenth_rows.append([what, *[fmt.format(v) for v in np.mean([s[key] for s in samples], 0)]])
    s0 = samples[0]
    head = (f"Locret's prefill traced: {s0['policy']}, budget {s0['budget']}, {s0['length']} tokens, chunks of "
            f"{s0['chunk']}. Needle kept = the share of the needle's tokens held, weighted by the attention full "
            f"attention's question puts on them (per kv head); the runs are Locret's (heads), chunked and in one "
            f"chunk, and Locret scoring by a label instead (chunked); 'one eviction' ranks every context token before the "
            f"tail at once by the named scores with the policy's spread; the rank is the needle's best token's in "
            f"the 5 layers that read it most (median over them), in units of the pool (below 1: kept).\n\n")
    return (head + markdown_table(
        ["sample (depth)", "answered: " + " / ".join(run_names), *[f"kept: {r} run" for r in run_names],
         *[f"one eviction by {n}" for n in scorers],
         "needle's rank: " + " / ".join(scorers[1:]), "slots per kv head in the reading layers: chunked run / label",
         "kept in the kv head that reads it most (layer.head): " + " / ".join([scorers[0], *scorers[2:]])],
        rows) + "\nThe chunked run: needle kept (weighted, %) after each chunk's eviction ('-': not all appended yet)\n\n"
        + markdown_table(["sample (depth)", "needle's chunk", *[str(i + 1) for i in range(width - 2)]], chunk_rows)
        + f"\nBy position tenth of the evicted context (mean over the {len(samples)} samples)\n\n"
        + markdown_table(["", *[f"{i / TENTHS:.1f}" for i in range(TENTHS)]], tenth_rows))


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
    parser.add_argument("--sample", type=int, nargs="+", default=[0],
                        help="which of the sweep's --samples (depth sample / (samples - 1)); several with --chunks")
    parser.add_argument("--samples", type=int, default=50, help="the sweep's sample count (the samples' depths spread over it)")
    parser.add_argument("--policies", nargs="+", default=["quest", "snapkv", "ada_snapkv", "h2o", "streaming"],
                        help="policy specs; oracle[:LOCRET OPTIONS] is Locret scored by its oracle labels")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--dense-layers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", default=None, metavar="LOCRET_SPEC",
                        help="trace this Locret's chunked prefill of each --sample instead (chunk_trace)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (--chunks)")
    parser.add_argument("--question-in-prefill", action="store_true",
                        help="compress the question with the context (SnapKV's setting)")
    parser.add_argument("--out", default=default_out("trace_needle"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)

    import kvjax

    model = kvjax.load_model(args.model)
    if args.chunks:
        result = {"samples": [chunk_trace(model, args.task, args.length, i, args.chunks, args.budget, args.chunk, args.seed,
                                          args.samples) for i in args.sample]}
        name = args.name or f"chunks_{args.task}_{args.length}_b{args.budget}"
        write_and_print(args.out, name, result, chunk_table(result))
        return result
    if len(args.sample) != 1:
        parser.error("one --sample, unless --chunks")
    args.sample = args.sample[0]
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
