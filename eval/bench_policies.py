"""Decode speed per policy against the full cache, on an attention-heavy config where reading the KV
cache dominates a step: 2 layers of 16 heads of 128 (MHA), hidden 512, MLP 1024, vocab 4096, float32.

For each context (default 8K) and policy at one budget (default 1024): prefill (not timed against
anything; one per policy, since eviction happens inside prefill), then decode tokens/s as the median of
timed steps after a warm-up step (the steps of every policy timed round-robin), the KV bytes a step
reads, and pages in use against the full cache.
`--kv-dtypes float32 int8` measures each policy with float32 and int8 pages (one scale per slot) in one run,
and gives int8's speed against float32 pages of the same policy. `--score-times` also times each page
selector's page scores alone, one layer of the prefilled state (a sketch selector's also by the reference scorer).

`--model NAME` runs a real model (random prompt tokens) instead, and bounds each policy's speed-up by the bytes
a step reads: the weights plus the policy's KV bytes, against the weights plus the full cache's.

    python -m eval.bench_policies              # writes ./kvjax-results/policies/bench_policies.{json,md,png}
    python -m eval.bench_policies --quick
    python -m eval.bench_policies --model smollm2-135m --budget 256 --policies full quest key_int4
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from .lib.report import LOAD_AT_START, cpu_load, default_out, machine_info, markdown_table, write_outputs
from .lib.setups import attention_heavy_config, param_bytes, step_bytes
from .lib.tables import byte_bound, same_cell, selection_speed, vs_snapkv
from .lib.timing import DecodeRun, round_robin, timed

POLICIES = {
    "full": {},
    "quest": {"dense_layers": 0},
    "quest_kv": {"dense_layers": 0, "per_kv_head": True},
    "streaming": {},
    "h2o": {},
    "tova": {},
    "snapkv": {},
    "ada_snapkv": {},
    "pyramid": {},
    "ada_pyramid": {},
    # query-aware selectors beyond Quest's bound (issue 36): not in the default run, name them with --policies
    "oracle_page": {"dense_layers": 0},
    "oracle_token": {"dense_layers": 0},
    "loki": {"dense_layers": 0},
    "key_int4": {"dense_layers": 0},
}
DEFAULT_POLICIES = [name for name in POLICIES if name not in ("oracle_page", "oracle_token", "loki", "key_int4")]


def make_policy(name: str, budget: int):
    import kvjax

    if name == "full":
        return kvjax.make_policy("full")
    options = dict(POLICIES[name])
    base = "quest" if name.startswith("quest") else name
    return kvjax.make_policy(base, token_budget=budget, **options)


def policy_run(model, prompt, policy) -> DecodeRun:
    """One (model, prompt, policy): prefilled (its compile apart), with the prefilled cache's pages."""
    from kvjax.cache.compaction import memory_report

    def describe(state):
        report = memory_report(state)
        return {"pages_in_use": report["pages_in_use"], "pages_full_cache": report["pages_full_cache"],
                "kv_bytes_in_use": report["bytes_in_use"], "meta_itemsize": state.kmin.dtype.itemsize}

    return DecodeRun.prefilled(model, prompt, policy, max_new_tokens=_MAX_STEPS, describe=describe)


_MAX_STEPS = 64  # room each prefill leaves for decoding (steps + warm-up)


def kv_bytes_read(name: str, cfg, context: int, budget: int, page_size: int, kv_dtype: str = "float32",
                  meta_itemsize: int = 4) -> int:
    """K and V bytes one decode step reads over all layers (plus Quest's min/max metadata, `meta_itemsize`
    bytes a value: the state's `kmin` dtype, float32 but for bfloat16 pages off CPU; int8 pages: plus one
    float32 scale per slot for K and for V)."""
    per_slot = {"float32": 2 * cfg.head_dim * 4, "bfloat16": 2 * cfg.head_dim * 2, "int8": 2 * (cfg.head_dim + 4)}[kv_dtype]
    heads = cfg.num_kv_heads
    if name in ("oracle_page", "oracle_token", "loki", "key_int4"):
        return cfg.num_layers * heads * step_bytes(
            name, context, budget, head_dim=cfg.head_dim, page_size=page_size,
            group=cfg.num_heads // cfg.num_kv_heads, kv_itemsize=per_slot // (2 * cfg.head_dim))["total"]
    if name == "full":
        return cfg.num_layers * heads * context * per_slot
    if name.startswith("quest"):
        pages = -(-context // page_size)
        return cfg.num_layers * heads * (budget * per_slot + pages * 2 * cfg.head_dim * meta_itemsize)
    return cfg.num_layers * heads * budget * per_slot  # an average budget per head


def weights_read_per_step(model) -> int:
    """Bytes of parameters one decode step reads: every weight, but of an untied input embedding only the
    token's row (tied, the logits read the whole table)."""
    total = param_bytes(model.params)
    if not model.cfg.tie_word_embeddings:
        table = model.params["embed_tokens"]["embedding"]  # [vocab, hidden]
        total -= (table.shape[0] - 1) * table.shape[1] * table.dtype.itemsize
    return int(total)


def bound_from_bytes(weights: int, kv: int, kv_full: int | None, speedup: float | None) -> dict:
    """A policy's speed-up over full attention if a step cost only its bytes (the weights plus its KV
    reads, against the weights plus the full cache's), and how much of that gain the measured speed-up takes
    ((speed-up - 1) / (bound - 1); None for full attention itself)."""
    if kv_full is None:
        return {}
    bound = (weights + kv_full) / (weights + kv)
    share = (speedup - 1) / (bound - 1) if speedup is not None and bound > 1 else None
    return {"byte_bound_speedup": bound, "share_of_byte_bound": share}


def model_config_summary(cfg) -> dict:
    return {"layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size}


def score_calls(run: DecodeRun) -> dict:
    """One layer's page scores on `run`'s prefilled state with a random query, as jitted calls to time:
    "score_ms" by `policy.page_bounds` (the step's scorer); for a key-sketch selector also
    "score_reference_ms" by the reference scorer, which decodes every slot's code row at once."""
    import jax
    import jax.numpy as jnp

    from kvjax.engine.decode import page_view

    policy, cfg = run.policy, run.model.cfg
    q = jax.random.normal(jax.random.PRNGKey(0), (run.batch, cfg.num_heads, cfg.head_dim), jnp.float32)
    view = page_view(run.state, jnp.int32(cfg.num_layers - 1), cfg.num_layers, q)
    arrays = {name: x for name, x in view._asdict().items() if x is not None and not isinstance(x, int)}

    def scorer(**backend):  # the view's arrays are arguments (not constants folded into the program)
        scores = jax.jit(lambda arrays: policy.page_bounds(view._replace(**arrays), **backend))
        return functools.partial(scores, arrays)

    calls = {"score_ms": scorer()}
    if policy.keeps_key_sketch:
        calls["score_reference_ms"] = scorer(backend="reference")
    return calls


def time_round_robin(calls: dict, repeats: int) -> dict:
    """Median milliseconds of each call (its result blocked on), one warm-up each, timed round-robin."""
    import statistics

    for call in calls.values():
        timed(call)
    seconds = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            seconds[key].append(timed(call)[1])
    return {key: 1e3 * statistics.median(values) for key, values in seconds.items()}


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys((r["context"], r["kv_dtype"]) for r in payload["results"]))
    names = list(dict.fromkeys(r["policy"] for r in payload["results"]))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(series)
    for i, (context, kv_dtype) in enumerate(series):
        rows = {r["policy"]: r for r in payload["results"] if (r["context"], r["kv_dtype"]) == (context, kv_dtype)}
        ax.bar(np.arange(len(names)) + i * width, [rows[n]["decode_tokens_per_s"] if n in rows else 0 for n in names],
               width, label=f"{context // 1024}K context, {kv_dtype} pages")
    ax.set_xticks(np.arange(len(names)) + width * (len(series) - 1) / 2)
    ax.set_xticklabels(names, rotation=30)
    ax.set_ylabel("decode tokens/s")
    shape = payload.get("model") or "2 layers x 16 heads x 128"
    ax.set_title(f"decode speed by policy, budget {payload['budget']} ({shape}, f32 compute)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(payload: dict, out: str) -> str:
    """The Markdown table, JSON and plot of a run's `payload` under `out`; returns the table."""
    budget, steps = payload["budget"], payload["timed_steps"]
    results = payload["results"]
    headers = ["context", "policy", "KV pages", "decode tok/s", "speedup vs full", "vs float32 pages", "KV MB read/step",
               "KV read GB/s", "pages in use / full", "prefill s", "prefill compile s", "decode vs snapkv",
               "prefill vs snapkv"]
    ratio = lambda x: "" if x is None else f"{x:.2f}x"  # noqa: E731
    rows = [[r["context"], r["policy"], r["kv_dtype"], r["decode_tokens_per_s"], ratio(r["speedup_vs_full"]),
             ratio(r["speedup_vs_float32_pages"]),
             r["kv_bytes_read_per_step"] / 1e6, r["kv_read_gbps"], f"{r['pages_in_use']} / {r['pages_full_cache']}",
             r["prefill_s"], r["prefill_compile_s"], *vs_snapkv(r, results)] for r in results]
    note = (f"\nBudget {budget} slots per kv head (Quest: slots read per head; dense_layers=0 here). "
            f"{payload['machine'].get('cpu_model', '')}, {payload['machine']['cpu_count']} cores; median of "
            f"{steps} decode steps after a warm-up, timed round-robin over the policies; prefill seconds exclude compiling (JAX's compile events), "
            "reported apart.\n")
    table = markdown_table(headers, rows) + note
    if any("score_ms" in r for r in results):
        table += "\n" + selection_speed(payload)
    if "weights_bytes" in payload:
        table += "\n" + byte_bound(payload)
    paths = write_outputs(out, "bench_policies", payload, table)
    plot(payload, paths["json"].replace(".json", ".png"))
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192], help="16384 too fits in about 25 minutes")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, choices=list(POLICIES))
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "int8"],
                        help="KV page dtypes to measure each policy with")
    parser.add_argument("--score-times", action="store_true",
                        help="also time each page selector's page scores alone (one layer, reference scorer too)")
    parser.add_argument("--out", default=default_out("policies"))
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--model", default=None,
                        help="a real model (a name `kvjax fetch` knows, a directory or a .gguf) instead of the "
                             "attention-heavy config; adds each policy's speed-up bound from the bytes a step reads")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.budget, args.steps = [1024], 256, 3
    if not 1 <= args.steps < _MAX_STEPS:
        parser.error(f"--steps must be between 1 and {_MAX_STEPS - 1}, got {args.steps}")

    from tqdm import tqdm

    import kvjax
    from kvjax.policies import layer_roles

    if args.model:
        model = kvjax.load_model(args.model)
        cfg = model.cfg
    else:
        cfg = kvjax.ModelConfig.from_hf_dict(attention_heavy_config(args.vocab))
        model = kvjax.Model(cfg, kvjax.init_params(cfg, seed=0))
    results = []
    for context in args.contexts:  # one context's runs held at once (their caches together)
        prompt = np.random.default_rng(context).integers(0, cfg.vocab_size, (1, context)).astype(np.int32)
        jobs = [(p, d) for p in args.policies for d in args.kv_dtypes]
        runs = [policy_run(model.with_kv_dtype(kv_dtype), prompt, make_policy(name, args.budget))
                for name, kv_dtype in tqdm(jobs, desc=f"{context} prefill: policy x kv dtype")]
        rows = round_robin(runs, args.steps)
        if args.score_times:  # one layer's page scores of every selector, timed round-robin too
            calls = {(i, key): call for i, run in enumerate(runs) if layer_roles(run.policy, cfg.num_layers - 1).select
                     for key, call in score_calls(run).items()}
            for (i, key), ms in time_round_robin(calls, args.steps).items():
                rows[i][key] = ms
        for (name, kv_dtype), row in zip(jobs, rows):
            row.update(policy=name, context=context, kv_dtype=kv_dtype,
                       kv_bytes_read_per_step=kv_bytes_read(name, cfg, context, args.budget, 16, kv_dtype,
                                                            row["meta_itemsize"]))
            results.append(row)
        del runs
    for row in results:
        full = same_cell(results, row, "full")
        row["speedup_vs_full"] = row["decode_tokens_per_s"] / full["decode_tokens_per_s"] if full else None
        row["kv_read_gbps"] = row["kv_bytes_read_per_step"] / row["decode_step_s"] / 1e9
        f32 = same_cell(results, row, row["policy"], "float32")
        row["speedup_vs_float32_pages"] = row["decode_tokens_per_s"] / f32["decode_tokens_per_s"] if f32 else None
    payload = {"benchmark": "bench_policies", "machine": machine_info(), "budget": args.budget,
               "config": attention_heavy_config(args.vocab), "timed_steps": args.steps, "results": results,
               "cpu_load_before": LOAD_AT_START, "cpu_load_after": cpu_load()}
    if args.model:
        payload.update(model=args.model, config=model_config_summary(cfg), weights_bytes=weights_read_per_step(model))
        for row in results:
            full = same_cell(results, row, "full")
            row.update(bound_from_bytes(payload["weights_bytes"], row["kv_bytes_read_per_step"],
                                  full["kv_bytes_read_per_step"] if full else None, row["speedup_vs_full"]))
    table = render(payload, args.out)
    print(table)
    return payload


if __name__ == "__main__":
    main()
