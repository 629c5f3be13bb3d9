"""Benchmark one decode-attention layer: dense paged decode vs Quest (scores + top-k + sparse decode).

Shapes: Llama-2-7B (32 heads, MHA, head_dim 128) and Llama-3-8B (32 query / 8 kv heads); page size 16;
float32 on CPU. Each call reads one of several layers' pages from one shared pool, rotating, so the
working set is several times the last-level cache. Achieved bandwidth (bytes actually read / time) is
compared with a large read (jnp.sum over ~2 GiB) measured in the same run.

    python eval/bench_attention.py            # full run, ~3-5 min on 2 CPU cores
    python eval/bench_attention.py --quick    # smoke run
    python eval/bench_attention.py --formulations   # also compare the XLA path's block formulations
    python eval/bench_attention.py --components     # also time Quest's stages alone
    python eval/bench_attention.py --row-groups 1   # also time dense decode in one loop (the default: per core)

Writes bench_attention.{json,md,png} under --out (default ./kvjax-results/attention; committed: results/attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pallas_kernels as pk

from .lib.report import cpu_load, default_out, others_cpu
from .lib.setups import chunked_page_tables

LLC_BYTES = 480 * 2**20  # last-level cache of the machines this project targets


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 128


MODELS = {
    "llama2-7b": ModelShape("Llama-2-7B", 32, 32),
    "llama3-8b": ModelShape("Llama-3-8B", 32, 8),
}


@dataclasses.dataclass
class LayerPool:
    """Several layers' pages of one sequence in one shared pool (float32)."""

    k_pages: jax.Array  # [N, ps, D]
    v_pages: jax.Array
    kmin: jax.Array  # [N, D]
    kmax: jax.Array
    page_tables: list  # per layer: int32[1, KVH, P]
    lengths: jax.Array  # int32[1, KVH]

    @property
    def num_layers(self) -> int:
        return len(self.page_tables)


def build_pool(shape: ModelShape, context: int, num_layers: int, page_size: int, layout: str, seed: int):
    max_pages = context // page_size
    num_pages = num_layers * shape.num_kv_heads * max_pages
    if layout == "chunked":
        tables = chunked_page_tables(num_layers, shape.num_kv_heads, max_pages, max(1, 1024 // page_size))
    else:  # every page anywhere
        perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
        tables = perm.reshape(num_layers, 1, shape.num_kv_heads, max_pages)
    key_k, key_v = jax.random.split(jax.random.PRNGKey(seed))
    page_shape = (num_pages, page_size, shape.head_dim)
    k_pages = jax.jit(lambda key: jax.random.normal(key, page_shape, jnp.float32))(key_k)
    v_pages = jax.jit(lambda key: jax.random.normal(key, page_shape, jnp.float32))(key_v)
    kmin = jax.jit(lambda k: jnp.min(k, axis=1))(k_pages)
    kmax = jax.jit(lambda k: jnp.max(k, axis=1))(k_pages)
    lengths = jnp.full((1, shape.num_kv_heads), context, jnp.int32)
    return LayerPool(k_pages, v_pages, kmin, kmax, [jnp.asarray(t) for t in tables], lengths)


def layers_for_working_set(bytes_per_layer: int, target_bytes: int, max_layers: int = 64) -> int:
    return int(min(max_layers, max(2, math.ceil(target_bytes / bytes_per_layer))))


def time_rotating(fn, args_per_layer, repeats: int, warmup: int = 2):
    """Median/min seconds of `fn(*args)` over `repeats` calls, each on the next layer's arguments."""
    medians, mins = time_interleaved({"fn": fn}, args_per_layer, repeats, warmup)
    return medians["fn"], mins["fn"]


def time_interleaved(fns: dict, args_per_layer, repeats: int, warmup: int = 2):
    """Median and min seconds per function, timed round-robin: repeat r calls every function once, so a
    change of load on the shared machine hits all of them alike. Every call takes the next layer's
    arguments, so no call finds the pages of the call before it in the cache (a layer of Llama-2 at 4K holds
    128 MiB of K and V: when each repeat handed one layer to every function, the second function to read it found
    part of it in the last-level cache)."""
    for fn in fns.values():
        for i in range(warmup):
            jax.block_until_ready(fn(*args_per_layer[i % len(args_per_layer)]))
    times = {name: [] for name in fns}
    call = warmup
    for _ in range(repeats):
        for name, fn in fns.items():
            args = args_per_layer[call % len(args_per_layer)]
            call += 1
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: min(t) for name, t in times.items()})


class LargeRead:
    """jnp.sum over a float32 array of `num_bytes`, far past the cache: the bandwidth bound. It is timed
    inside every row's round-robin, next to the kernels (other work shares the cores)."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes
        self.data = jax.jit(lambda: jnp.ones((num_bytes // 4,), jnp.float32) * 0.5)()
        self.read = jax.jit(jnp.sum)

    def __call__(self, *unused_layer_args):
        return self.read(self.data)

    def summary(self, median: float, best: float):
        return {"bytes": self.num_bytes, "median_s": median, "min_s": best,
                "median_gbps": self.num_bytes / median / 1e9, "best_gbps": self.num_bytes / best / 1e9}

    def measure(self, repeats: int):
        median, best = time_rotating(self, [()], repeats)
        return self.summary(median, best)


def bench_model_context(shape, context, budgets, args, large_read: LargeRead, formulations):
    page_size = args.page_size
    page_bytes = page_size * shape.head_dim * 4
    max_pages = context // page_size
    kv_bytes_per_layer = 2 * shape.num_kv_heads * max_pages * page_bytes
    num_layers = layers_for_working_set(kv_bytes_per_layer, args.working_set_gib * 2**30)
    pool = build_pool(shape, context, num_layers, page_size, args.layout, seed=context + shape.num_kv_heads)
    q_key = jax.random.PRNGKey(7)
    qs = [jax.random.normal(jax.random.fold_in(q_key, i), (1, shape.num_q_heads, shape.head_dim))
          for i in range(num_layers)]
    # pool arrays are arguments, not closed-over constants (XLA would embed them in the program)
    layer_args = [(pool.k_pages, pool.v_pages, pool.kmin, pool.kmax, pool.lengths, qs[i], pool.page_tables[i])
                  for i in range(num_layers)]

    def decode_dense(k_pages, v_pages, kmin, kmax, lengths, q, page_table, inputs=None, formulation=None,
                     row_groups=None):
        return pk.paged_decode(q, k_pages, v_pages, page_table, lengths, formulation=formulation,
                               row_groups=row_groups)

    def scores(kmin, kmax, lengths, q, page_table, per_kv_head):
        return pk.quest_page_scores(q, kmin, kmax, page_table, lengths, page_size=page_size, per_kv_head=per_kv_head)

    def quest(k_pages, v_pages, kmin, kmax, lengths, q, page_table, inputs=None, *, formulation, per_kv_head, top_k):
        selected = pk.select_top_pages(scores(kmin, kmax, lengths, q, page_table, per_kv_head), top_k)
        return pk.sparse_paged_decode(q, k_pages, v_pages, page_table, selected, lengths, formulation=formulation)

    # Quest's stages, each timed alone in the same round-robin (--components): the page scores, the top-k of
    # scores computed beforehand, and the sparse decode of a selection made beforehand (both arguments, like
    # the pool)
    def stage_scores(k_pages, v_pages, kmin, kmax, lengths, q, page_table, inputs=None, *, per_kv_head):
        return scores(kmin, kmax, lengths, q, page_table, per_kv_head)

    def stage_top_k(k_pages, v_pages, kmin, kmax, lengths, q, page_table, inputs, *, mode, top_k):
        return pk.select_top_pages(inputs[mode], top_k)

    def stage_sparse(k_pages, v_pages, kmin, kmax, lengths, q, page_table, inputs, *, key):
        return pk.sparse_paged_decode(q, k_pages, v_pages, page_table, inputs[key], lengths)

    variants = formulations or [None]
    selection_modes = ["query_head"] if shape.num_q_heads == shape.num_kv_heads else ["query_head", "kv_head"]
    fns = {"large_read": large_read}
    quest_configs = {}
    for formulation in variants:
        fns[("dense", formulation)] = jax.jit(functools.partial(decode_dense, formulation=formulation))
        for budget in budgets:
            if budget >= context:
                continue
            for mode in selection_modes:
                config = dict(formulation=formulation, per_kv_head=mode == "kv_head", top_k=budget // page_size - 1)
                name = ("quest", budget, mode, formulation)
                fns[name] = jax.jit(functools.partial(quest, **config))
                quest_configs[name] = config
    for groups in args.row_groups or []:  # the default dense decode against fixed numbers of loops
        fns[("dense_row_groups", groups)] = jax.jit(functools.partial(decode_dense, row_groups=groups))
    stages = {}  # Quest config -> its stages' names in `fns`
    if args.components:
        inputs = [{} for _ in layer_args]  # per layer: scores per selection mode, selections per config
        for name, config in quest_configs.items():
            _, budget, mode, formulation = name
            if formulation is not None:
                continue
            key = f"{budget}-{mode}"
            if ("scores", mode) not in fns:  # the scores do not depend on the budget
                fns[("scores", mode)] = jax.jit(functools.partial(stage_scores, per_kv_head=config["per_kv_head"]))
                for layer, layer_arg in enumerate(layer_args):
                    inputs[layer][mode] = fns[("scores", mode)](*layer_arg)
            top_k = jax.jit(functools.partial(stage_top_k, mode=mode, top_k=config["top_k"]))
            for layer, layer_arg in enumerate(layer_args):
                inputs[layer][key] = top_k(*layer_arg, {mode: inputs[layer][mode]})
            fns[("top_k", budget, mode)] = top_k
            fns[("sparse", budget, mode)] = jax.jit(functools.partial(stage_sparse, key=key))
            stages[name] = (("scores", mode), ("top_k", budget, mode), ("sparse", budget, mode))
        layer_args = [layer_arg + (layer_inputs,) for layer_arg, layer_inputs in zip(layer_args, inputs)]
    medians, mins = time_interleaved(fns, layer_args, args.repeats)

    working_set = num_layers * kv_bytes_per_layer
    row_large_read = large_read.summary(medians["large_read"], mins["large_read"])
    row = {
        "model": shape.name, "context": context, "num_layers_rotated": num_layers,
        "working_set_bytes": working_set, "working_set_over_llc": working_set / LLC_BYTES,
        "large_read": row_large_read, "load": cpu_load(), "dense": {}, "quest": [],
    }
    dense_bytes = kv_bytes_per_layer

    def dense_entry(name):
        median = medians[name]
        return {"median_s": median, "min_s": mins[name], "bytes": dense_bytes, "gbps": dense_bytes / median / 1e9,
                "of_large_read": dense_bytes / median / 1e9 / row_large_read["median_gbps"]}

    for formulation in variants:
        entry = dense_entry(("dense", formulation))
        if formulation is None:
            row["dense"] = entry
        else:
            row.setdefault("dense_formulations", {})[formulation] = entry
        print(f"  {shape.name} {context:6d} dense{'' if formulation is None else ' ' + formulation:16s}"
              f" {entry['median_s'] * 1e3:8.2f} ms {entry['gbps']:6.2f} GB/s ({entry['of_large_read']:.0%} of the"
              f" large read, {row_large_read['median_gbps']:.1f} GB/s)", flush=True)
    for groups in args.row_groups or []:
        entry = dense_entry(("dense_row_groups", groups))
        row.setdefault("dense_row_groups", {})[str(groups)] = entry
        print(f"  {shape.name} {context:6d} dense, {groups} loop(s)    {entry['median_s'] * 1e3:8.2f} ms"
              f" {entry['gbps']:6.2f} GB/s"
              f" ({entry['of_large_read']:.0%} of the large read)", flush=True)
    metadata_bytes = shape.num_kv_heads * max_pages * 2 * shape.head_dim * 4  # Quest's kmin + kmax, float32
    if not row["dense"]:
        timed = row["dense_formulations"]  # the default's row, or the first timed when it was not asked for
        row["dense"] = timed.get(pk_default_formulation(), next(iter(timed.values())))
    for name, config in quest_configs.items():
        _, budget, mode, formulation = name
        sel_rows = shape.num_kv_heads if config["per_kv_head"] else shape.num_q_heads
        quest_bytes = sel_rows * (config["top_k"] + 1) * 2 * page_bytes + metadata_bytes  # K+V of selected +
        # current pages, and kmin + kmax
        median = medians[name]
        dense_median = medians[("dense", formulation)]
        entry = {"budget": budget, "selection": mode, "formulation": formulation,
                 "median_s": median, "min_s": mins[name], "bytes": quest_bytes,
                 "gbps": quest_bytes / median / 1e9, "speedup_vs_dense": dense_median / median,
                 "byte_ratio_vs_dense": dense_bytes / quest_bytes}
        if name in stages:
            scores_name, top_k_name, sparse_name = stages[name]
            entry["components"] = {
                "scores_s": medians[scores_name],
                "top_k_s": medians[top_k_name],
                "sparse_decode_s": medians[sparse_name],
                "scores_gbps": metadata_bytes / medians[scores_name] / 1e9,
                "sparse_decode_gbps": (quest_bytes - metadata_bytes) / medians[sparse_name] / 1e9,
            }
        row["quest"].append(entry)
        print(f"  {shape.name} {context:6d} quest b={budget:5d} {mode:10s}"
              f"{'' if formulation is None else ' ' + formulation:16s} {median * 1e3:8.2f} ms"
              f" {entry['gbps']:6.2f} GB/s speedup {entry['speedup_vs_dense']:5.2f}x"
              f" (bytes {entry['byte_ratio_vs_dense']:.1f}x)", flush=True)
        if "components" in entry:
            parts = entry["components"]
            print(f"  {'':26s} scores {parts['scores_s'] * 1e3:.2f} ms ({parts['scores_gbps']:.1f} GB/s), top-k"
                  f" {parts['top_k_s'] * 1e3:.2f} ms, sparse decode {parts['sparse_decode_s'] * 1e3:.2f} ms"
                  f" ({parts['sparse_decode_gbps']:.1f} GB/s)", flush=True)
    del pool, layer_args, fns
    return row


def huge_pages() -> dict:
    """How this process's memory gets huge pages: the kernel's transparent-huge-page mode and glibc's malloc
    tunable (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` asks for them where the mode is `madvise`)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        mode = None
    return {"transparent_hugepage": mode, "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}


def huge_pages_text(huge) -> str:
    if not huge:
        return "not recorded"
    mode, tunables = huge.get("transparent_hugepage"), huge.get("glibc_tunables")
    unset = "unset (in `madvise` mode XLA's buffers then get none)" if mode and "[madvise]" in mode else "unset"
    return f"transparent huge pages `{mode}`; GLIBC_TUNABLES " + (f"`{tunables}`" if tunables else unset)


def pk_default_formulation():
    from kvjax.pallas_kernels.decode_xla import DEFAULT_FORMULATION

    return DEFAULT_FORMULATION


def write_markdown(result, path: Path):
    lines = [
        "# Decode attention on CPU: dense paged decode vs Quest",
        "",
        f"Backend `{result['backend']}`, float32, page size {result['page_size']}, page layout "
        f"`{result['layout']}`, median of {result['repeats']} calls after warm-up, each call on the next of "
        "several layers (working set: layers rotated, and their K+V over the 480 MiB LLC). The large read "
        f"(jnp.sum over {result['large_read']['bytes'] / 2**30:.1f} GiB; {result['large_read']['median_gbps']:.1f}"
        " GB/s at the start) is timed in each row's round-robin with the kernels: every repeat calls the large "
        "read, dense decode and each Quest configuration once, so load swings on the shared machine hit them "
        "alike; dense GB/s is compared with the row's large read. Bytes: K+V of the pages read, plus "
        "kmin/kmax of every used page for Quest; speedup = dense ms / Quest ms; byte ratio = dense bytes / "
        "Quest bytes. CPU load average (1/5/15 min) at start/end"
        f": {result['load_start']} / {result['load_end']}: other work shared these 2 cores.",
        "",
        f"Huge pages: {huge_pages_text(result.get('huge_pages'))}.",
        "",
        "| model | context | layers (x LLC) | large read GB/s | dense ms | dense GB/s (of large read) | budget |"
        " selection | Quest ms | Quest GB/s | speedup | byte ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        dense = row["dense"]
        prefix = (f"| {row['model']} | {row['context'] // 1024}K | {row['num_layers_rotated']} "
                  f"({row['working_set_over_llc']:.1f}x) | {row['large_read']['median_gbps']:.1f} | "
                  f"{dense['median_s'] * 1e3:.1f} | "
                  f"{dense['gbps']:.1f} ({dense['of_large_read']:.0%}) |")
        quests = [q for q in row["quest"] if q["formulation"] is None]
        if not quests:
            lines.append(prefix + " - | - | - | - | - | - |")
        for q in quests:
            lines.append(prefix + f" {q['budget']} | {q['selection']} | {q['median_s'] * 1e3:.2f} | "
                         f"{q['gbps']:.1f} | {q['speedup_vs_dense']:.1f}x | {q['byte_ratio_vs_dense']:.1f}x |")
    if any("dense_formulations" in row for row in result["rows"]):
        lines += ["", "## XLA block formulations (same run)", "",
                  "| model | context | formulation | dense ms | dense GB/s | Quest b=2048 ms | speedup |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        for row in result["rows"]:
            for name, dense in row.get("dense_formulations", {}).items():
                quest = [q for q in row["quest"] if q["formulation"] == name and q["budget"] == 2048
                         and q["selection"] == "query_head"]
                quest_ms = f"{quest[0]['median_s'] * 1e3:.2f}" if quest else "-"
                speedup = f"{quest[0]['speedup_vs_dense']:.1f}x" if quest else "-"
                lines.append(f"| {row['model']} | {row['context'] // 1024}K | {name} | {dense['median_s'] * 1e3:.1f} |"
                             f" {dense['gbps']:.1f} | {quest_ms} | {speedup} |")
    if any("dense_row_groups" in row for row in result["rows"]):
        lines += ["", "## Dense decode by number of row loops (same run)", "",
                  "The default (`decode_xla.default_row_groups`: one loop per core, at most 4, for calls that "
                  "read 8 MiB of K or more) against fixed numbers of loops, each over its share of the rows.", "",
                  "| model | context | loops | ms | GB/s (of large read) |", "| --- | ---: | --- | ---: | ---: |"]
        for row in result["rows"]:
            for groups, dense in [("default", row["dense"]), *row.get("dense_row_groups", {}).items()]:
                lines.append(f"| {row['model']} | {row['context'] // 1024}K | {groups} | {dense['median_s'] * 1e3:.1f} |"
                             f" {dense['gbps']:.1f} ({dense['of_large_read']:.0%}) |")
    if any("components" in q for row in result["rows"] for q in row["quest"]):
        lines += ["", "## Quest's stages, each timed alone (same run)", "",
                  "Page scores (kmin + kmax of every used page), the top-k of those scores, and the sparse "
                  "decode of that selection, each stage's inputs computed beforehand. Their sum can differ from "
                  "the Quest column, where XLA compiles the three together.", "",
                  "| model | context | budget | selection | scores ms (GB/s) | top-k ms | sparse decode ms (GB/s) |"
                  " sum ms | Quest ms |",
                  "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for row in result["rows"]:
            for q in row["quest"]:
                if "components" not in q:
                    continue
                parts = q["components"]
                total = parts["scores_s"] + parts["top_k_s"] + parts["sparse_decode_s"]
                lines.append(f"| {row['model']} | {row['context'] // 1024}K | {q['budget']} | {q['selection']} | "
                             f"{parts['scores_s'] * 1e3:.2f} ({parts['scores_gbps']:.1f}) | "
                             f"{parts['top_k_s'] * 1e3:.2f} | {parts['sparse_decode_s'] * 1e3:.2f} "
                             f"({parts['sparse_decode_gbps']:.1f}) | {total * 1e3:.2f} | {q['median_s'] * 1e3:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(result, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    models = sorted({row["model"] for row in result["rows"]})
    with_stages = any("components" in q for row in result["rows"] for q in row["quest"])
    fig, axes = plt.subplots(1 + with_stages, len(models), figsize=(6 * len(models), 4.5 * (1 + with_stages)),
                             squeeze=False)
    if with_stages:
        for ax, model in zip(axes[1], models):
            plot_stages(ax, [r for r in result["rows"] if r["model"] == model], model)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model]
        contexts = [r["context"] for r in rows]
        ax.plot(contexts, [r["dense"]["median_s"] * 1e3 for r in rows], "k-o", label="dense paged decode")
        keys = sorted({(q["budget"], q["selection"]) for r in rows for q in r["quest"] if q["formulation"] is None})
        for budget, selection in keys:
            points = [(r["context"], q["median_s"] * 1e3) for r in rows for q in r["quest"]
                      if q["formulation"] is None and q["budget"] == budget and q["selection"] == selection]
            style = "--" if selection == "kv_head" else "-"
            ax.plot(*zip(*points), style, marker=".", label=f"Quest {budget} ({selection})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per layer (median)")
        ax.set_title(f"{model}, {result['backend']} on CPU, f32")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_stages(ax, rows, model):
    """Stacked bars of Quest's stages (scores, top-k, sparse decode) per context at each context's largest
    budget, query-head selection, with the whole pipeline's time as a marker."""
    labels, parts, totals = [], [], []
    for row in rows:
        timed = [q for q in row["quest"] if "components" in q and q["selection"] == "query_head"]
        if not timed:
            continue
        q = max(timed, key=lambda q: q["budget"])
        stage = q["components"]
        labels.append(f"{row['context'] // 1024}K\nb={q['budget']}")
        parts.append([stage["scores_s"] * 1e3, stage["top_k_s"] * 1e3, stage["sparse_decode_s"] * 1e3])
        totals.append(q["median_s"] * 1e3)
    bottom = np.zeros(len(labels))
    for i, name in enumerate(["page scores", "top-k", "sparse decode"]):
        heights = np.array([p[i] for p in parts])
        ax.bar(labels, heights, bottom=bottom, label=name)
        bottom += heights
    ax.plot(labels, totals, "kD", label="whole Quest (one program)")
    ax.set_ylabel("ms per layer (median)")
    ax.set_title(f"{model}: Quest's stages, each timed alone")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    parser.add_argument("--budgets", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--working-set-gib", type=float, default=2.0,
                        help="K+V bytes of the rotated layers (several times the 480 MiB LLC)")
    parser.add_argument("--large-read-gib", type=float, default=2.0)
    parser.add_argument("--layout", choices=["chunked", "random"], default="chunked",
                        help="page placement: as kvjax's allocator after a chunked prefill, or random")
    parser.add_argument("--formulations", nargs="*", default=None,
                        help="also time these XLA block formulations (no names: all)")
    parser.add_argument("--row-groups", nargs="*", type=int, default=None,
                        help="also time dense decode with these fixed numbers of row loops (XLA path)")
    parser.add_argument("--components", action="store_true",
                        help="also time Quest's stages alone: page scores, top-k, sparse decode")
    parser.add_argument("--out", "--out-dir", dest="out_dir", type=Path, default=Path(default_out("attention")))
    parser.add_argument("--name", default="bench_attention")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.budgets, args.repeats = [1024, 2048], [256, 512], 3
        args.working_set_gib, args.large_read_gib = 0.05, 0.25
    formulations = None
    if args.formulations is not None:
        from kvjax.pallas_kernels.decode_xla import FORMULATIONS

        formulations = args.formulations or list(FORMULATIONS)

    result = {
        "backend": pk.resolve_backend(None), "jax": jax.__version__, "platform": jax.default_backend(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "page_size": args.page_size,
        "layout": args.layout, "repeats": args.repeats, "quick": args.quick, "load_start": cpu_load(),
        "huge_pages": huge_pages(),
    }
    start = time.time()
    large_read = LargeRead(int(args.large_read_gib * 2**30))
    result["large_read"] = large_read.measure(args.repeats)
    print(f"large read: {result['large_read']['median_gbps']:.1f} GB/s", flush=True)
    rows = []
    for model in args.models:
        for context in args.contexts:
            rows.append(bench_model_context(MODELS[model], context, args.budgets, args, large_read, formulations))
    result["rows"] = rows
    result["load_end"] = cpu_load()
    result["others_cpu"] = others_cpu()  # what other processes took of the cores meanwhile (quiet: about 0)
    result["wall_s"] = time.time() - start
    result["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out_dir / f"{args.name}.md")
    write_plot(result, args.out_dir / f"{args.name}.png")
    print(f"wrote {args.out_dir}/{args.name}.{{json,md,png}} in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
