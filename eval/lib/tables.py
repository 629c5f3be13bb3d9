"""Renderers of the README's and docs' tables whose program writes no table of that shape itself.

Each takes the committed JSON (a list where a block names several paths) and returns the block's Markdown,
ending with the run's load: `<!-- render eval.lib.tables:dispatch results/dispatch/bench_dispatch.json -->`."""

from __future__ import annotations

from .report import load_line, markdown_table


def same_cell(results: list, row: dict, policy: str, kv_dtype: str | None = None) -> dict | None:
    """The result of `policy` at `row`'s context (and `kv_dtype`, default the row's)."""
    kv_dtype = kv_dtype or row["kv_dtype"]
    return next((r for r in results if r["context"] == row["context"] and r["policy"] == policy
                 and r["kv_dtype"] == kv_dtype), None)


def vs_snapkv(row: dict, results: list) -> list[str]:
    """Decode speed and prefill time against SnapKV's at the same context (the policies issue's aims)."""
    snap = same_cell(results, row, "snapkv")
    if snap is None:
        return ["", ""]
    return [f"{100 * row['decode_tokens_per_s'] / snap['decode_tokens_per_s']:.0f}%",
            f"{row['prefill_s'] / snap['prefill_s']:.2f}x"]


def _ratio(x) -> str:
    return "" if x is None else f"{x:.2f}x"


def dispatch(payload: dict) -> str:
    """`kvjax bench dispatch`: tokens/s at each number of decode steps per call over one step per call."""
    rows, ks = payload["rows"], sorted({r["steps_per_dispatch"] for r in payload["rows"]})
    groups = list(dict.fromkeys((r["model"], r["batch"]) for r in rows))
    by = {(r["model"], r["batch"], r["steps_per_dispatch"]): r for r in rows}
    headers = ["model", "batch", "ms / step at 1 step per call", *[f"{k} steps per call" for k in ks if k != 1]]
    body = [[m, b, round(by[m, b, 1]["ms_per_step"], 1),
             *[_ratio(by[m, b, k]["speedup_vs_1"]) if (m, b, k) in by else "" for k in ks if k != 1]]
            for m, b in groups]
    s = payload["settings"]
    return (markdown_table(headers, body) +
            f"\nA {s['prompt']}-token prompt, {s['new']} greedy tokens, median of {s['repeats']}; tokens/s relative to "
            f"one step per call in the same run. {payload['machine'].get('cpu_model', '')}, "
            f"{payload['machine']['cpu_count']} cores. {load_line(payload)}\n")


def policies(payload: dict) -> str:
    """`kvjax bench policies`, float32 pages: decode and prefill of every policy, against full and SnapKV."""

    results = payload["results"]
    headers = ["context", "policy", "decode tok/s", "speedup vs full", "KV MB read/step", "KV read GB/s",
               "pages in use / full", "prefill s", "prefill compile s", "decode vs snapkv", "prefill vs snapkv"]
    rows = [[r["context"], r["policy"], r["decode_tokens_per_s"], _ratio(r["speedup_vs_full"]),
             r["kv_bytes_read_per_step"] / 1e6, r["kv_read_gbps"], f"{r['pages_in_use']} / {r['pages_full_cache']}",
             r["prefill_s"], r["prefill_compile_s"], *vs_snapkv(r, results)]
            for r in results if r["kv_dtype"] == "float32"]
    m = payload["machine"]
    return (markdown_table(headers, rows) +
            f"\nFloat32 pages. Budget {payload['budget']} slots per kv head (Quest: slots read per head; "
            f"dense_layers=0 here). {m.get('cpu_model', '')}, {m['cpu_count']} cores; median of "
            f"{payload['timed_steps']} decode steps after a warm-up, timed round-robin over the policies; prefill "
            f"seconds exclude compiling (JAX's compile events), reported apart. {load_line(payload)}\n")


def byte_bound(payload: dict) -> str:
    """`kvjax bench policies --model NAME`: each policy's speed-up over full attention against the bound its
    bytes give (the weights plus its KV reads per step, over the weights plus the full cache's)."""
    results = [r for r in payload["results"] if r["kv_dtype"] == "float32"]
    pct = lambda x: "" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    rows = [[r["context"], r["policy"], r["decode_tokens_per_s"], _ratio(r["speedup_vs_full"]),
             r["kv_bytes_read_per_step"] / 1e6, _ratio(r.get("byte_bound_speedup")), pct(r.get("share_of_byte_bound"))]
            for r in results]
    m, c = payload["machine"], payload["config"]
    return (markdown_table(["context", "policy", "decode tok/s", "vs full", "KV MB read/step", "bound from bytes",
                            "share of the bound's gain"], rows) +
            f"\n{payload['model']} ({c['layers']} layers, {c['kv_heads']} kv heads of {c['head_dim']}), float32 pages, "
            f"budget {payload['budget']}, no dense layer; weights read per step {payload['weights_bytes'] / 1e6:.0f} MB. "
            f"{m.get('cpu_model', '')}, {m['cpu_count']} cores; median of {payload['timed_steps']} decode steps, timed "
            f"round-robin over the policies. {load_line(payload)}\n")


def selection_speed(payload: dict) -> str:
    """`kvjax bench policies --score-times`: each selector's decode speed against full attention's and Quest's,
    and one layer's page scores by the step's scorer and by the reference (issue 47)."""
    results = [r for r in payload["results"] if r["kv_dtype"] == "float32"]
    quest = {r["context"]: r for r in results if r["policy"] == "quest"}
    ms = lambda r, key: "" if key not in r else f"{r[key]:.2f}"  # noqa: E731
    headers = ["context", "policy", "decode tok/s", "vs full", "vs quest", "page scores ms/layer",
               "reference scorer ms/layer"]
    rows = [[r["context"], r["policy"], r["decode_tokens_per_s"], _ratio(r["speedup_vs_full"]),
             _ratio(r["decode_tokens_per_s"] / quest[r["context"]]["decode_tokens_per_s"]) if r["context"] in quest else "",
             ms(r, "score_ms"), ms(r, "score_reference_ms")] for r in results]
    m = payload["machine"]
    return (markdown_table(headers, rows) +
            f"\nFloat32 pages, budget {payload['budget']}, every layer selecting. {m.get('cpu_model', '')}, "
            f"{m['cpu_count']} cores; decode: median of {payload['timed_steps']} steps, "
            "timed round-robin over the policies; page scores: the last layer of the prefilled state, a random query, "
            f"median of {payload['timed_steps']}, round-robin. {load_line(payload)}\n")


def policies_by_page_dtype(payload: dict) -> str:
    """`kvjax bench policies --kv-dtypes float32 bfloat16 int8`: each policy on each page dtype."""
    results = payload["results"]
    dtypes = ["float32", "bfloat16", "int8"]
    at = {(r["policy"], r["kv_dtype"]): r for r in results}
    names = list(dict.fromkeys(r["policy"] for r in results))
    headers = ["policy", *[f"{d} tok/s" for d in dtypes], *[f"{d} vs float32" for d in dtypes[1:]],
               "KV MB read/step, " + " / ".join(dtypes)]
    fmt = lambda x: f"{x:.3g}"  # noqa: E731
    rows = [[n, *[at[n, d]["decode_tokens_per_s"] for d in dtypes],
             *[_ratio(at[n, d]["speedup_vs_float32_pages"]) for d in dtypes[1:]],
             " / ".join(fmt(at[n, d]["kv_bytes_read_per_step"] / 1e6) for d in dtypes)]
            for n in names if all((n, d) in at for d in dtypes)]
    return markdown_table(headers, rows) + f"\nThe same run as the float32 table. {load_line(payload)}\n"


def serving_load(payloads: list) -> str:
    """`kvjax bench load` runs, one row each: `kvjax serve` under concurrent clients against `generate` one
    request at a time in the same run."""
    headers = ["model", "policy", "clients", "requests", "lost", "pages leaked", "tok/s served",
               "tok/s `generate` one by one", "ratio", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
               "KV waste: kvjax / Jenga / uniform paging"]
    rows, loads = [], []
    for p in payloads:
        s, waste = p["server"], p["server"]["memory"]["waste"]
        options = ", ".join(f"{k} {v}" for k, v in sorted(p.get("policy_options", {}).items()))
        policy = p["policy"] + (f", {options}".replace("token_budget", "budget") if options else "")
        rows.append([p["model"], policy, p["concurrency"], s["requests"], s["lost"], s["pages_leaked"],
                     f"{s['tokens_per_s']:.3g}", f"{p['generate_one_at_a_time']['tokens_per_s']:.3g}",
                     f"{p['throughput_ratio']:.2f}x",
                     f"{1e3 * s['ttft_s']['p50']:.0f} / {1e3 * s['ttft_s']['p99']:.0f}",
                     f"{1e3 * s['itl_s']['p50']:.0f} / {1e3 * s['itl_s']['p99']:.0f}",
                     " / ".join(f"{100 * waste[k]:.1f}%" for k in ("kvjax pages", "jenga, a group per layer", "uniform"))])
        loads.append(load_line(p))
    loads = [loads[0]] if len(set(loads)) == 1 else [f"{p['model']} {p['policy']}: {x}" for p, x in zip(payloads, loads)]
    return markdown_table(headers, rows) + "\n" + " ".join(loads) + "\n"


def jenga_waste(payload: dict) -> str:
    """`python -m eval.bench_serving`: one line, Jenga's and uniform paging's waste per trace config."""
    runs = {(r["config"], r["variant"]): r for r in payload["runs"]}
    configs = list(dict.fromkeys(r["config"] for r in payload["runs"]))
    parts = [f"{c}: {100 * runs[c, 'jenga']['waste_fraction']:.2f}% against {100 * runs[c, 'uniform']['waste_fraction']:.1f}%"
             for c in configs if (c, "jenga") in runs and (c, "uniform") in runs]
    return ("Held bytes wasted, Jenga against uniform paging (time-averaged over the trace): " + "; ".join(parts)
            + f". {load_line(payload)}\n")


def locret_memory(payload: dict) -> str:
    """`kvjax bench memory`: peak RSS and KV pool of Locret against the full cache, one process per point."""
    at = {(r["policy"], r["context"]): r for r in payload["results"]}
    contexts = sorted({r["context"] for r in payload["results"]})
    mib = lambda r, k: "" if r is None or r.get(k) is None else f"{r[k]:.0f} MiB"  # noqa: E731
    rows = [[f"{c // 1024}K", mib(at.get(("locret", c)), "peak_rss_mib"), mib(at.get(("full", c)), "peak_rss_mib"),
             mib(at.get(("locret", c)), "pool_mib"), mib(at.get(("full", c)), "pool_mib")] for c in contexts]
    s, slopes = payload["settings"], payload.get("slopes_mib_per_1k_tokens", {})
    return (markdown_table(["context", "Locret peak RSS", "full cache peak RSS", "Locret KV pool", "full KV pool"], rows) +
            f"\n{payload['model']}, Locret at token_budget={s['budget']}, chunks of {s['chunk']}, local tail "
            f"{s['local_tail']}; one process per point, peak RSS after loading. Peak RSS grows "
            + ", ".join(f"{v:.1f} MiB per 1K tokens under {k}" for k, v in slopes.items())
            + f". {load_line(payload)}\n")


def compile_times(payload: dict) -> str:
    """`kvjax bench compile`: what a first `generate` compiles, at 4 and 30 layers of one width."""
    headers = ["layers", "policy", "programs", "prefill compile s", "compression compile s", "decode compile s",
               "first generate: compiles s", "first generate s", "second generate s"]
    rows = [[r["layers"], r["policy"], r["programs"], r["prefill_s"], r["compress_s"], r["decode_s"],
             r["first_generate_compile_s"], r["first_generate_s"], r["second_generate_s"]] for r in payload["results"]]
    c, m, cache = payload["config"], payload["machine"], payload.get("persistent_cache")
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in payload.get("deep_over_shallow", {}).items())
    after = payload["results"][-1].get("load_after") if payload["results"] else None
    note = (f"\n{c['shape']}, random weights, {c['prompt']}-token prompt, {c['new_tokens']} new tokens, {c['dtype']}, "
            f"batch {c['batch']}; {m.get('cpu_model', '')}, {m['cpu_count']} cores. First-generate compile time, "
            f"{max(c['layers'])} layers over {min(c['layers'])}: {ratios}.")
    if cache:
        note += (f" A first full-cache `generate` at {cache['layers']} layers in a fresh process: "
                 f"{cache['cold_first_generate_s']:.1f} s with an empty persistent compilation cache, "
                 f"{cache['warm_first_generate_s']:.1f} s reading it.")
    return markdown_table(headers, rows) + note + " " + load_line({"load_before": payload.get("load_before"),
                                                                   "load_after": after}) + "\n"


def locret_real_summary(payload: dict) -> str:
    """`python -m eval.locret_real`: Locret at 1/16 and 1/8 of the context against the evictors at 1/8, for the
    contexts and tasks where Locret ran beyond 2K (accuracy; a cell's samples are marked where not 50)."""
    cells = payload["cells"]
    titles = {"real_passkey": "passkey", "niah_single": "RULER needle"}
    columns = [("full", None, "full"), ("locret", 16, "Locret @1/16"), ("locret", 8, "Locret @1/8"),
               ("snapkv", 8, "SnapKV @1/8"), ("ada_snapkv", 8, "Ada-SnapKV @1/8"), ("h2o", 8, "H2O @1/8"),
               ("streaming", 8, "StreamingLLM @1/8")]

    def cell(length, task, policy, fraction):
        found = [c for c in cells if (c["length"], c["task"]) == (length, task) and c["policy"].split(":")[0] == policy]
        if fraction is not None:  # the budget nearest the fraction (8000 tokens: 512 for 1/16)
            found = [c for c in found if c["budget"] and abs(c["budget"] - length / fraction) < length / fraction / 4]
            found.sort(key=lambda c: abs(c["budget"] - length / fraction))
        if not found:
            return ""
        c = found[0]
        return f"{100 * c['accuracy']:.0f}%" + ("" if c["samples"] == 50 else f" (n={c['samples']})")

    points = sorted({(c["length"], c["task"]) for c in cells if c["policy"].startswith("locret") and c["length"] > 2048},
                    key=lambda p: (p[0], ("real_passkey", "niah_single").index(p[1]) if p[1] in titles else 2, p[1]))
    rows = [[f"{length // 1000 if length % 1024 else length // 1024}K {titles.get(task, task)}",
             *[cell(length, task, p, f) for p, f, _ in columns]] for length, task in points]
    return markdown_table(["context, task", *[t for _, _, t in columns]], rows) + \
        f"\nFrom the sweeps {', '.join(payload['sweeps'])}.\n"


def attention(payload: dict) -> str:
    """`kvjax bench attention --components --row-groups 1 2 4`: dense paged decode against Quest at budgets
    512 and 2048, per query head and (a row of its own) per kv head."""
    budgets = (512, 2048)
    headers = ["model", "context", "large read GB/s", "dense, one loop ms (of large read)",
               "dense ms (GB/s, of large read)", *[f"Quest {b}" for b in budgets]]
    rows = []
    for r in payload["rows"]:
        one, dense = r["dense_row_groups"]["1"], r["dense"]
        for selection, label in (("query_head", r["model"]), ("kv_head", f"{r['model']} (per kv head)")):
            quest = {q["budget"]: q for q in r["quest"] if q["selection"] == selection}
            if not quest:
                continue
            cells = [f"{1e3 * quest[b]['median_s']:.2f} ms, {quest[b]['speedup_vs_dense']:.1f}x "
                     f"({quest[b]['byte_ratio_vs_dense']:.1f}x)" if b in quest else "" for b in budgets]
            rows.append([label, f"{r['context'] // 1024}K", f"{r['large_read']['median_gbps']:.1f}",
                         f"{1e3 * one['median_s']:.1f} ({100 * one['of_large_read']:.0f}%)",
                         f"{1e3 * dense['median_s']:.1f} ({dense['gbps']:.1f}, {100 * dense['of_large_read']:.0f}%)",
                         *cells])
    load = {"load_before": payload.get("load_start"), "load_after": payload.get("load_end")}
    return markdown_table(headers, rows) + f"\nThe run took {payload['wall_s']:.0f} s. {load_line(load)}\n"


def cacheclip(payload: dict, times: bool = True) -> str:
    """`python -m eval.bench_cacheclip`: accuracy per request set, recompute ratio and prefill time per method
    (the program's own table, from its JSON); without the prefill times with `times=False`."""
    setup, m = payload["setup"], payload["machine"]
    sets = setup.get("sets", ["straddling", "within-chunk"])  # runs from before `sets` was recorded ran these two
    rows = [[name, f"{e['recompute_ratio']:.0%}" if e["ratio"] is not None or name == "full" else "0%",
             *(f"{e[f'accuracy_{s}']:.2f}" for s in sets),
             "" if e["straddler_recall"] is None else f"{e['straddler_recall']:.2f}",
             *((f"{e['prefill_ms_median']:.1f}", f"{e['speedup_vs_full']:.2f}x") if times else ())]
            for name, e in payload["results"].items()]
    header = ["method", "recomputed", *(f"acc {s}" for s in sets), "straddler recall",
              *(("prefill ms", "speedup vs full") if times else ())]
    shape = (f"\n{setup['samples_per_set']} prompts per set, {setup['chunks']} chunks x {setup['chunk_len']} tokens; "
             f"auxiliary model = the first {setup['aux_layers']} of {payload['model_config']['layers']} layers")
    if not times:
        return markdown_table(header, rows) + shape + ".\n"
    return (markdown_table(header, rows) + shape +
            f" (scoring alone: {payload['aux_scoring_ms_median']:.1f} ms median). Prefill: median of {setup['repeats']} x "
            f"{setup['timing_prompts']} warm runs, interleaved; {m.get('cpu_model', '')}, {m['cpu_count']} cores. "
            f"{load_line(payload)}\n")


def cacheclip_accuracy(payload: dict) -> str:
    """`cacheclip`'s table without its prefill times: for runs timed with other work on the cores."""
    return cacheclip(payload, times=False)


def locret_quality(payload: dict) -> str:
    """`python -m eval.locret_quality`: exact match per policy and budget (full cache: every budget)."""
    results = payload["results"]
    budgets = sorted({r["token_budget"] for r in results if r["token_budget"]})
    names = {"full": "full cache", "locret": "Locret", "snapkv": "SnapKV", "h2o": "H2O"}
    at = {(r["policy"], r["token_budget"]): r["accuracy"] for r in results}
    rows = [[names.get(p, p), *[f"{at.get((p, None if p == 'full' else b), float('nan')):.2f}" for b in budgets]]
            for p in dict.fromkeys(r["policy"] for r in results)]
    s = payload["settings"]
    training = payload.get("heads_training")
    trained = (f" Heads trained by the run: {training['steps_done']} steps on {training['examples']} rows, final loss "
               f"{training['final_loss']:.4f}." if training else "")
    return (markdown_table(["policy", *[f"budget {b}" for b in budgets]], rows) +
            f"\n{s['samples']} samples, {s['length']}-token prompts, {s['records']} records, dense_layers="
            f"{s['dense_layers']}; Locret: {payload['locret_options']}.{trained} {load_line(payload)}\n")


def locret_kvzip_training(payload: dict) -> str:
    """`kvjax train locret --label kvzip`'s summary.json: data, wall times, and the held-out pooled top-b
    recall of the label (untrained, chosen checkpoint)."""
    a = payload["args"]
    shares = a["recall_shares"]
    best, untrained = payload["best_heldout"], payload["untrained_heldout"]
    rows = [["untrained heads", "-", *[f"{untrained[f'recall@{s:g}']:.3f}" for s in shares]],
            [f"chosen checkpoint", str(best["step"]), *[f"{best[f'recall@{s:g}']:.3f}" for s in shares]]]
    load = payload["load"]
    return (markdown_table(["heads", "step", *[f"recall of the label's top {s:g}" for s in shares]], rows) +
            f"\n{payload['trained_on']} sequences trained on, {payload['heldout']} held out ({a['data']}, "
            f"{a['data_lengths']}-token documents, hidden {a['hidden']}, {a['steps']} steps, label normalised per "
            f"{a['label_norm']}, listwise weight {a['rank_weight']} at temperature {a['temperature']}). Wall time: "
            f"{payload['extract_seconds'] / 60:.0f} min extracting inputs and labels, {payload['train_seconds'] / 60:.1f} "
            f"min training, single-threaded on {load['cpu_count']} cores shared with other sessions. "
            f"Load average before/after: {[round(x, 1) for x in load['before']]} / "
            f"{[round(x, 1) for x in load['after']]}.\n")


def recorded_load(payload: dict) -> str:
    """The load line where the run recorded its load; nothing where it did not."""
    line = load_line(payload)
    return "" if line.startswith("Load: not recorded") else f"\n{line}\n"


def attention_stages(payload: dict, model: str = "Llama-2-7B", context: int = 32768, budget: int = 2048) -> str:
    """`kvjax bench attention --components`: Quest's stages (page scores, top-k, sparse decode), each timed
    alone, at one model, context and budget (per query head), against the whole pipeline as one program."""
    row = next(r for r in payload["rows"] if (r["model"], r["context"]) == (model, context))
    q = next(q for q in row["quest"] if (q["budget"], q["selection"], q["formulation"]) == (budget, "query_head", None))
    c = q["components"]
    mib = lambda stage: f"{c[f'{stage}_gbps'] * c[f'{stage}_s'] * 1e9 / 2 ** 20:.0f} MiB"  # noqa: E731
    rows = [["page scores", f"kmin + kmax of every used page ({mib('scores')})", f"{1e3 * c['scores_s']:.2f}",
             f"{c['scores_gbps']:.1f}"],
            ["top-k", "the scores (`lax.top_k`)", f"{1e3 * c['top_k_s']:.2f}", "-"],
            ["sparse decode", f"K+V of the chosen pages ({mib('sparse_decode')})", f"{1e3 * c['sparse_decode_s']:.2f}",
             f"{c['sparse_decode_gbps']:.1f}"],
            [f"sum (the whole pipeline as one program: {1e3 * q['median_s']:.2f})", "",
             f"{1e3 * (c['scores_s'] + c['top_k_s'] + c['sparse_decode_s']):.2f}", ""]]
    load = {"load_before": payload.get("load_start"), "load_after": payload.get("load_end")}
    return (markdown_table(["stage", "reads", "ms", "GB/s"], rows) +
            f"\n{model}, {context // 1024}K, budget {budget}. {load_line(load)}\n")


def retired_engine(payload: dict) -> str:
    """The retired Jenga engine's half of `bench_serving` (commit 859d3ca and earlier): Jenga against uniform
    paging serving one trace, each figure also as a multiple of uniform's (steps and pages, no seconds)."""
    runs = payload["engine"]["runs"]
    base = next(r for r in runs if r["paging"] == "uniform")

    def of_base(r, value, fmt):
        return f"{value(r):{fmt}} ({value(r) / value(base):.2f}x)"

    per_step = lambda r: r["generated_tokens"] / r["steps"]  # noqa: E731
    rows = [[r["paging"], f"{r['pool_bytes'] / 2 ** 10:g} KiB", f"{r['large_page_bytes'] / 2 ** 10:g} KiB",
             f"{100 * r['waste_fraction']:.2f}", f"{100 * r['waste_fraction_of_in_use']:.2f}",
             of_base(r, lambda x: x["peak_running"], "d"), f"{r['mean_running']:.1f}", r["steps"],
             of_base(r, per_step, ".2f"), f"{r['computed_tokens_per_step']:.1f}",
             f"{100 * r['prefix_hit_rate']:.1f}", r["preemptions"]] for r in runs]
    headers = ["paging", "pool", "large page", "waste % held", "waste % in use", "max running (x uniform)",
               "mean running", "steps", "generated tokens per step (x uniform)", "computed tokens per step",
               "prefix hit %", "preemptions"]
    return (markdown_table(headers, rows) + f"\nSame tokens from both layouts: {payload['engine']['identical_outputs']}. "
            "Counts per scheduler step only: the run's tokens per second were taken on shared cores and are left "
            "out.\n")


_CACHECLIP_LABELS = {"cacheblend": "CacheBlend", "cacheclip": "CacheClip, untuned, reused context",
                     "cacheclip-untuned-full": "CacheClip, untuned, full context",
                     "cacheclip-tuned": "CacheClip, tuned (full context)",
                     "cacheclip-nogroup": "CacheClip, untuned, no window grouping",
                     "cacheclip-tuned-nogroup": "CacheClip, tuned, no window grouping"}


def _cacheclip_methods(payload: dict) -> dict:
    """{method name before "@": {ratio: result}} of a `bench_cacheclip` JSON, for the selecting methods."""
    out = {}
    for key, e in payload["results"].items():
        name, _, ratio = key.partition("@")
        if ratio and name in _CACHECLIP_LABELS:
            out.setdefault(name, {})[float(ratio)] = e
    return out


def _cacheclip_note(payload: dict) -> str:
    full = payload["results"]["full"]
    return (f"\nStraddling set, full attention {full['accuracy_straddling']:.2f}; "
            f"{payload['setup']['samples_per_set']} prompts a set.\n")


def cacheclip_by_ratio(payload: dict) -> str:
    """`python -m eval.bench_cacheclip --tuned-aux ...`: accuracy on the straddling set of each selecting method
    at each share recomputed, and its straddler recall at 20%."""
    methods = _cacheclip_methods(payload)
    ratios = sorted({r for by in methods.values() for r in by})
    cell = lambda by, r, k: "" if r not in by or by[r][k] is None else f"{by[r][k]:.2f}"  # noqa: E731
    rows = [[_CACHECLIP_LABELS[n], *[cell(by, r, "accuracy_straddling") for r in ratios],
             cell(by, 0.2, "straddler_recall")] for n, by in methods.items()]
    return (markdown_table(["method", *[f"{r:.0%}" for r in ratios], "straddler recall at 20%"], rows)
            + _cacheclip_note(payload))


def cacheclip_at_20(payload: dict) -> str:
    """`python -m eval.bench_cacheclip --tuned-aux ...`: each selecting method at 20% recomputed, both sets."""
    rows = [[_CACHECLIP_LABELS[n], *[f"{by[0.2][k]:.2f}" for k in ("accuracy_straddling", "accuracy_within-chunk",
                                                                   "straddler_recall")]]
            for n, by in _cacheclip_methods(payload).items() if 0.2 in by]
    return (markdown_table(["method at 20% recomputed", "acc straddling", "acc within-chunk", "straddler recall"], rows)
            + _cacheclip_note(payload))


def aux_recall(payload: dict) -> str:
    """`kvjax train cacheclip-aux`'s summary: the auxiliary model's recall on held-out requests before and after
    tuning, at the training's share recomputed."""
    rows = [[label, f"{payload[key]['selection_recall']:.2f}", f"{payload[key]['straddler_recall']:.2f}"]
            for label, key in (("before tuning", "recall_before"), ("after tuning", "recall_after"))]
    return markdown_table(["", "selection recall", "straddler recall"], rows) + "\n" + recorded_load(payload)


def suite_times(payload: dict) -> str:
    """`kvjax bench suite`'s `run.json`: each member's status and wall time in that run, with its preset."""
    rows = [[f"`{name}`", m["status"], "" if m.get("wall_s") is None else f"{m['wall_s']:.1f}"]
            for name, m in payload["members"].items()]
    load = {"load_before": payload["load"]["start"], "load_after": payload["load"]["end"]}
    return (markdown_table(["member", "status", "wall s"], rows) +
            f"\n{payload['label']}: the `{payload['settings']['preset']}` preset, {payload['wall_s']:.0f} s in all on "
            f"{payload['device'].get('cpu_model', '')}, {payload['device']['cpu_count']} cores. {load_line(load)}\n")

