"""CacheClip against full prefill, direct reuse, APE-style parallel encoding and CacheBlend on synthetic
multi-document RAG with the shipped model: accuracy against recompute ratio, and prefill time.

A prompt is `<s>` + a short system prefix + 8 chunks of 256 tokens + a multi-key question. The chunks are
the shipped filler holding records "{key} d d d d ." (kvjax.tasks.rag_records); the asked record straddles a
chunk boundary ("tiger 4 7 | 1 9 .": the second chunk's first tokens were encoded without what precedes
them), so answering needs attention across chunks. A control set asks a record that lies inside one chunk.
Answers: greedy decoding through `kvjax.decode_step`, exact match of the 4 digits.

Prefill time: every method from the same prompts in one run, warm (compiled beforehand), interleaved
round-robin so that load on the machine hits all methods alike; median of the repeats. Chunk caches are
computed beforehand (offline, as in the paper); a method's time covers store lookup, assembly (rotation),
auxiliary scoring, selection, the recomputation and writing the paged KV state.

With `--task real` (for real models, e.g. `--model smollm2-135m`) the prompts are real prose chunks in the
chat template with cross-chunk facts (`kvjax.tasks.rag_real`): a fact cut at a random token across a
boundary (straddle), cut right before its value (split), a two-hop question over two chunks (two_hop),
and the control (inside); scored by RULER's string match. Written as bench_cacheclip_real.*.

    python -m eval.bench_cacheclip --model /path/to/trained-model   # --out DIR (default ./kvjax-results/cacheclip)
    python -m eval.bench_cacheclip --task real --model smollm2-135m --samples 20
    python -m eval.bench_cacheclip --quick                          # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from .lib.report import default_out, machine_info, markdown_table, write_outputs
from kvjax.tasks import synthetic
from kvjax.tasks.rag_records import rag_prompt

DEFAULT_MODEL = "kvjax/assets/tiny-llama"


# --------------------------------------------------------------------------------------------- methods


def method_table(ratios, blend_ratios, aux_layers, tuned_aux: str | None = None):
    """name -> (rag_prefill method, ratio, extra kwargs). With `tuned_aux` (a `train.cacheclip_aux` output's
    `aux/` directory) also CacheClip with the tuned auxiliary model, which prefills the prompt itself (its
    layers are no longer the main model's, so it cannot read the main model's reused K/V)."""
    table = {"full": ("full", None, {}), "recompute_all": ("recompute_all", 1.0, {}), "reuse": ("reuse", None, {}),
             "ape": ("ape", None, {})}
    for r in blend_ratios:
        table[f"cacheblend@{r:g}"] = ("cacheblend", r, {})
    for r in ratios:
        table[f"cacheclip@{r:g}"] = ("cacheclip", r, {"aux_layers": aux_layers})
    table[f"cacheclip-nogroup@{0.2:g}"] = ("cacheclip", 0.2, {"aux_layers": aux_layers, "grouping": False})
    if tuned_aux:
        for r in ratios:
            table[f"cacheclip-untuned-full@{r:g}"] = ("cacheclip", r, {"aux_layers": aux_layers, "aux_context": "full"})
            table[f"cacheclip-tuned@{r:g}"] = ("cacheclip", r, {"tuned_aux": tuned_aux})
        # the tuning's own recall is measured on the raw top tokens: the same selection, without window grouping
        table[f"cacheclip-tuned-nogroup@{0.2:g}"] = ("cacheclip", 0.2, {"tuned_aux": tuned_aux, "grouping": False})
    return table


def run_method(model, store, request, spec, aux_cache):
    from kvjax.rag import AuxScorer, rag_prefill

    method, ratio, extra = spec
    kwargs = {}
    if method == "recompute_all":
        ratio = None
    if method == "cacheclip":
        if "tuned_aux" in extra:
            key = ("tuned", extra["tuned_aux"])
            if key not in aux_cache:
                from kvjax.rag.aux_tuning import load_aux

                aux_cache[key] = AuxScorer(load_aux(model, extra["tuned_aux"]), context="full")
        else:
            key = (extra["aux_layers"], extra.get("aux_context", "reuse"))
            if key not in aux_cache:
                aux_cache[key] = AuxScorer.truncated(model, *key)
        kwargs = {"aux": aux_cache[key], "grouping": extra.get("grouping", True)}
    prefix, chunks, query = request
    return rag_prefill(model, store, prefix, chunks, query, method, ratio=ratio, max_new_tokens=8, **kwargs)


def correct(model, result, tokenizer, meta) -> bool:
    """Whether the greedy answer is right: real-text requests (`kvjax.tasks.rag_real`) by RULER's string
    match over `max_new_tokens`, the shipped model's records by exact match of the digits."""
    from kvjax.rag import greedy_continue

    request = meta.get("request")
    if request is None:
        return answer(model, result, tokenizer, len(meta["answer"])) == meta["answer"]
    tokens = greedy_continue(model, result, request.max_new_tokens)
    return request.correct(tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True))


def answer(model, result, tokenizer, num_digits: int) -> str | None:
    """The greedy answer's digits. The model does not stop after a record's digits (it goes on with more), so
    exactly as many tokens as the answer has digits are decoded."""
    from kvjax.rag import greedy_continue

    tokens = greedy_continue(model, result, num_digits)
    return synthetic.first_integer(tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True))


def block(result):
    jax.block_until_ready((result.state, result.logits))
    return result


def straddler_recall(result, request_meta) -> float | None:
    """Share of the asked record's tokens after the chunk boundary that were recomputed."""
    slots = request_meta.get("after_boundary")
    if result.recomputed is None or slots is None or not len(slots):
        return None
    return float(np.isin(slots, result.recomputed).mean())


# ---------------------------------------------------------------------------------------------- main


def main(argv=None):
    from tqdm import tqdm

    import kvjax
    from kvjax.rag import ChunkStore

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--samples", type=int, default=50, help="prompts per question set")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-len", type=int, default=256)
    parser.add_argument("--records", type=int, default=6)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--blend-ratios", type=float, nargs="+", default=[0.1, 0.15, 0.2, 0.4])
    parser.add_argument("--aux-layers", type=int, default=None, help="auxiliary model = the first N layers")
    parser.add_argument("--tuned-aux", default=None,
                        help="a tuned auxiliary model (train.cacheclip_aux's aux/ directory): adds cacheclip-tuned@r")
    parser.add_argument("--aux-sweep", action="store_true", help="also CacheClip@0.2 with every aux depth and the full-prefill aux")
    parser.add_argument("--timing-prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=default_out("cacheclip"))
    parser.add_argument("--task", choices=["records", "real"], default="records",
                        help="records: the shipped model's synthetic records; real: cross-chunk facts in real text "
                             "(kvjax.tasks.rag_real: straddle, split, two_hop, inside), for real models")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.chunks, args.chunk_len, args.timing_prompts, args.repeats = 4, 4, 64, 1, 2

    model = kvjax.load_model(args.model)
    tok = model.tokenizer
    L = model.cfg.num_layers
    aux_layers = args.aux_layers or max(1, L // 2)
    methods = method_table(args.ratios, args.blend_ratios, aux_layers, args.tuned_aux)
    if args.aux_sweep:
        for n in range(1, L):
            methods[f"cacheclip@0.2 aux={n}"] = ("cacheclip", 0.2, {"aux_layers": n})
        methods[f"cacheclip@0.2 aux={aux_layers} full-aux"] = ("cacheclip", 0.2, {"aux_layers": aux_layers, "aux_context": "full"})
    rng = np.random.default_rng(args.seed)

    sets = {}
    if args.task == "records":
        for name, straddle in (("straddling", True), ("within-chunk", False)):
            prompts = []
            for _ in range(args.samples):
                prefix, chunk_ids, question, meta = rag_prompt(tok, rng, args.chunks, args.chunk_len, args.records, straddle)
                prompts.append(((prefix, chunk_ids, question), meta))
            sets[name] = prompts
    else:  # real text, every kind of kvjax.tasks.rag_real
        from kvjax.tasks import rag_real

        for kind in rag_real.KINDS:
            requests = rag_real.rag_requests(tok, kind, args.samples, rng, num_chunks=args.chunks,
                                             chunk_len=args.chunk_len)
            sets[kind] = [((r.prefix, r.chunks, r.query), {"request": r, "after_boundary": r.after_boundary})
                          for r in requests]
        prefix = requests[0].prefix
    first_set = next(iter(sets))

    store = ChunkStore(model)
    t0 = time.perf_counter()
    for prompts in sets.values():
        for (pre, chunks, _), _ in prompts:
            store.chunks(pre, chunks)
    precompute_s = time.perf_counter() - t0

    aux_cache: dict = {}
    accuracy: dict = {name: {} for name in sets}
    recall: dict = {}
    ratio_used: dict = {}
    for set_name, prompts in sets.items():
        for (request, meta) in tqdm(prompts, desc=f"accuracy ({set_name})"):
            for name, spec in methods.items():
                result = run_method(model, store, request, spec, aux_cache)
                ratio_used[name] = result.recompute_ratio
                r = straddler_recall(result, meta)
                if r is not None:
                    recall.setdefault(name, []).append(r)
                accuracy[set_name].setdefault(name, []).append(correct(model, result, tok, meta))

    # timing: warm, interleaved, median
    timing_prompts = [req for req, _ in sets[first_set][: args.timing_prompts]]
    times: dict = {name: [] for name in methods}
    for _ in tqdm(range(args.repeats), desc="timing"):
        for request in timing_prompts:
            for name, spec in methods.items():
                t = time.perf_counter()
                block(run_method(model, store, request, spec, aux_cache))
                times[name].append(time.perf_counter() - t)
    median = {name: statistics.median(v) for name, v in times.items()}

    # auxiliary scoring alone, for the breakdown
    from kvjax.rag import assemble

    aux_times = []
    aux = aux_cache[(aux_layers, "reuse")]
    for _ in range(args.repeats):
        for prefix_ids, chunks, query in timing_prompts:
            ctx = assemble(model, store, prefix_ids, chunks, query, max_new_tokens=8)
            t = time.perf_counter()
            aux.scores(ctx)
            aux_times.append(time.perf_counter() - t)

    full_acc = {s: float(np.mean(accuracy[s]["full"])) for s in sets}
    rows, results = [], {}
    for name, spec in methods.items():
        entry = {
            "method": spec[0], "ratio": spec[1], "recompute_ratio": ratio_used[name],
            "prefill_ms_median": 1e3 * median[name], "prefill_ms_all": [1e3 * t for t in times[name]],
            "speedup_vs_full": median["full"] / median[name],
        }
        for s in sets:
            acc = float(np.mean(accuracy[s][name]))
            entry[f"accuracy_{s}"] = acc
            entry[f"relative_accuracy_{s}"] = acc / full_acc[s] if full_acc[s] else None
        entry["straddler_recall"] = float(np.mean(recall[name])) if name in recall else None
        results[name] = entry
        rows.append([
            name, f"{entry['recompute_ratio']:.0%}" if spec[1] is not None or name == "full" else "0%",
            *(f"{entry[f'accuracy_{s}']:.2f}" for s in sets),
            "" if entry["straddler_recall"] is None else f"{entry['straddler_recall']:.2f}",
            f"{entry['prefill_ms_median']:.1f}", f"{entry['speedup_vs_full']:.2f}x",
        ])
    payload = {
        "machine": machine_info(),
        "model": args.model,
        "model_config": {"layers": L, "hidden": model.cfg.hidden_size, "heads": model.cfg.num_heads,
                         "kv_heads": model.cfg.num_kv_heads, "head_dim": model.cfg.head_dim},
        "setup": {"task": args.task, "sets": list(sets), "samples_per_set": args.samples, "chunks": args.chunks, "chunk_len": args.chunk_len,
                  "records": args.records, "prefix_tokens": int(len(prefix)), "aux_layers": aux_layers,
                  "timing_prompts": args.timing_prompts, "repeats": args.repeats, "seed": args.seed,
                  "store_form": store.form, "chunk_precompute_s": precompute_s},
        "aux_scoring_ms_median": 1e3 * statistics.median(aux_times),
        "results": results,
    }
    header = ["method", "recomputed", *(f"acc {s}" for s in sets), "straddler recall", "prefill ms", "speedup vs full"]
    table = markdown_table(header, rows)
    what = f"{args.records} records" if args.task == "records" else "real text (kvjax.tasks.rag_real), chat template"
    table += (f"\n{args.samples} prompts per set, {args.chunks} chunks x {args.chunk_len} tokens, {what}; "
              f"auxiliary model = the first {aux_layers} of {L} layers (scoring alone: "
              f"{payload['aux_scoring_ms_median']:.1f} ms median). Prefill: median of {args.repeats} x "
              f"{args.timing_prompts} warm runs, interleaved; {payload['machine'].get('cpu_model', '')}, "
              f"{payload['machine']['cpu_count']} cores, JAX {payload['machine']['jax']} CPU.\n")
    paths = write_outputs(args.out, "bench_cacheclip" + ("" if args.task == "records" else "_real"), payload, table)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(table)
    return payload


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["results"]
    first = payload["setup"].get("sets", ["straddling"])[0]
    fig, (acc_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, marker in (("cacheclip", "o"), ("cacheblend", "s")):
        points = sorted((v["ratio"], v[f"accuracy_{first}"]) for k, v in results.items()
                        if v["method"] == method and "nogroup" not in k and "aux" not in k)
        acc_ax.plot([100 * r for r, _ in points], [a for _, a in points], marker=marker, label=method)
    for name, style in (("full", "k-"), ("reuse", "r--"), ("ape", "m:")):
        acc_ax.axhline(results[name][f"accuracy_{first}"], color=style[0], linestyle=style[1:], label=name)
    acc_ax.set_xlabel("recomputed chunk tokens (%)")
    acc_ax.set_ylabel(f"accuracy, {first} set")
    acc_ax.set_ylim(-0.02, 1.02)
    acc_ax.legend()
    names = list(results)
    time_ax.barh(names, [results[n]["prefill_ms_median"] for n in names])
    time_ax.set_xlabel("prefill time (ms, median)")
    time_ax.invert_yaxis()
    setup = payload["setup"]
    fig.suptitle(f"CacheClip vs baselines: {setup['chunks']} chunks x {setup['chunk_len']} tokens ({setup.get('task', 'records')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
