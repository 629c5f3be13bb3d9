"""The batch engine on Jenga's pool against uniform pages, at a fixed KV memory: concurrent requests held,
throughput and prefix hits on a tiny random Gemma-3-like model (five sliding-window layers to one global).

    python -m eval.bench_jenga_engine                          # contexts 512 and 1024
    python -m eval.bench_jenga_engine --contexts 512 --requests 8 --out eval/results/jenga_engine

Each run serves `--requests` requests submitted at once (`--max-rows` rows, more than memory allows) on a
pool of `--uniform-rows` rows' worth of uniform pages (every layer holding the whole context, as paging did
before Jenga: `BatchEngine(uniform_pages=True)`), once with Jenga's groups and once with uniform pages, on
unique prompts and on prompts sharing three quarters of their tokens. It records the most and the mean rows
live at a dispatch, the pool's pages held per live row, generated tokens per second (wall, compiles
excluded: each run is served twice and the second kept) and the rows that found their prefix in the pool. Greedy
tokens must be equal under both pools. Writes bench_jenga_engine.{json,md,png} under --out.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .lib.report import cpu_load, default_out, machine_info, markdown_table, write_outputs

WINDOW, PAGE, CHUNK = 64, 16, 128
MODEL = dict(model_type="gemma3_text", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
             sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
             query_pre_attn_scalar=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


def traffic(kind: str, context: int, requests: int, seed: int = 0) -> list[list[int]]:
    """`requests` prompts of `context` tokens: random ("unique"), or sharing their first whole chunks up to
    three quarters of the context ("shared")."""
    rng = np.random.default_rng(seed)
    shared = (3 * context // 4) // CHUNK * CHUNK if kind == "shared" else 0
    prefix = rng.integers(0, MODEL["vocab_size"], size=shared).tolist()
    return [prefix + rng.integers(0, MODEL["vocab_size"], size=context - shared).tolist() for _ in range(requests)]


def serve(model, prompts, new_tokens: int, pool_pages: int, max_rows: int, uniform: bool) -> dict:
    """Serve `prompts` at once; the rows live at each dispatch and what the pool held."""
    from kvjax.serving.batch_engine import BatchEngine

    engine = BatchEngine(model, max_rows=max_rows, capacity=len(prompts[0]) + new_tokens, page_size=PAGE,
                         chunk_size=CHUNK, steps_per_dispatch=8, pool_pages=pool_pages, prefix_cache_bytes=0,
                         uniform_pages=uniform)
    ids = [engine.submit(p, new_tokens, eos_token_id=-1) for p in prompts]
    live, held, pool = [], [], None
    start = time.perf_counter()
    finished = lambda: sum(r.finished for r in engine.requests.values())  # noqa: E731
    while engine.has_work:
        before, done = engine.dispatches, finished()
        engine.step()
        if engine.dispatches > before:  # rows live at this dispatch: those left and those it finished
            (batch,) = engine.batches.values() or (None,)
            rows = 0 if batch is None else sum(r is not None for r in batch.rows)
            if batch is not None and rows:
                pool = batch.pool
                held.append(pool.live_pages() / rows)
            live.append(rows + finished() - done)
    wall = time.perf_counter() - start
    tokens = [engine.requests[i].tokens for i in ids]
    return {"max_live_rows": max(live), "mean_live_rows": float(np.mean(live)), "dispatches": engine.dispatches,
            "pool_pages": pool.num_pages, "pages_per_live_row": float(np.mean(held)),
            "tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall, "prefix_hit_rows": engine.shared_rows,
            "shared_pages": engine.shared_pages, "leaked_pages": engine.leaked_pages, "tokens": tokens}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r["context"], r["traffic"]) for r in rows})
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for offset, pool in ((-0.2, "jenga"), (0.2, "uniform")):
        values = [next(r["max_live_rows"] for r in rows if (r["context"], r["traffic"]) == label and r["pool"] == pool)
                  for label in labels]
        ax.bar(x + offset, values, 0.4, label=f"{pool} pages")
    ax.set_xticks(x, [f"{c} tokens\n{t}" for c, t in labels])
    ax.set_ylabel("most requests live at once")
    ax.set_title("Fixed KV memory, tiny Gemma-3-like model (window 64)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(payload: dict) -> str:
    """The Markdown table of a run's JSON, with its settings and load (docs/jenga.md renders it)."""
    headers = ["context", "traffic", "pool", "pool pages", "most live rows", "mean live rows", "pages / live row",
               "prefix-hit rows", "tokens/s", "leaked pages"]
    table = markdown_table(headers, [[r["context"], r["traffic"], r["pool"], r["pool_pages"], r["max_live_rows"],
                                      r["mean_live_rows"], r["pages_per_live_row"], r["prefix_hit_rows"],
                                      r["tokens_per_s"], r["leaked_pages"]] for r in payload["runs"]])
    args = payload["args"]
    return table + (
        f"\n{args['requests']} requests at once, {args['new_tokens']} new tokens each, a pool with room for "
        f"{args['uniform_rows']} uniform rows. Tokens/s: wall time of a second run (compiled) "
        f"(load average {payload['load_start']} at the start, {payload['load_end']} at the "
        "end).\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--uniform-rows", type=int, default=3, help="the pool holds this many uniform rows")
    p.add_argument("--max-rows", type=int, default=32)
    p.add_argument("--out", default=default_out("jenga_engine"))
    args = p.parse_args(argv)

    from kvjax.models.config import ModelConfig
    from kvjax.models.loading import Model, init_params

    cfg = ModelConfig.from_hf_dict(MODEL)
    model = Model(cfg, init_params(cfg, seed=0, std=0.1))
    load_start = cpu_load()
    rows = []
    for context in args.contexts:
        uniform_row = cfg.num_layers * cfg.num_kv_heads * -(-(context + args.new_tokens) // PAGE)
        # a multiple of both pools' large pages (Jenga: 5 window layers' pages; uniform: all 6 layers'),
        # so both hold the same memory, with room for `uniform_rows` uniform rows besides the large page per
        # group the engine keeps for rounding
        step = 5 * cfg.num_layers * cfg.num_kv_heads
        pool_pages = -(-(args.uniform_rows * uniform_row + step) // step) * step
        for kind in ("unique", "shared"):
            prompts = traffic(kind, context, args.requests)
            # twice each, the second run kept: its programs are compiled
            runs = {pool: [serve(model, prompts, args.new_tokens, pool_pages, args.max_rows, pool == "uniform")
                           for _ in range(2)][-1] for pool in ("jenga", "uniform")}
            if runs["jenga"]["tokens"] != runs["uniform"]["tokens"]:
                raise AssertionError(f"greedy tokens differ between the pools at {context} tokens, {kind} traffic")
            for pool, run in runs.items():
                run.pop("tokens")
                rows.append({"context": context, "traffic": kind, "pool": pool, **run})
                print(rows[-1], flush=True)
    payload = {"model": MODEL, "page_size": PAGE, "chunk_size": CHUNK, "args": vars(args), "runs": rows,
               "machine": machine_info(), "machine_shared": True, "load_start": load_start, "load_end": cpu_load()}
    table = render(payload)
    paths = write_outputs(args.out, "bench_jenga_engine", payload, table)
    plot(rows, f"{args.out}/bench_jenga_engine.png")
    print(table)
    return {"paths": paths, "runs": rows}


if __name__ == "__main__":
    main()
