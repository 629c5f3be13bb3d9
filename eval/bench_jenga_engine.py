"""The batch engine on Jenga's pool against uniform pages, at a fixed KV memory: concurrent requests held, KV
memory waste and prefix hits, on Gemma-3-shaped models (five sliding-window layers to one global).

    python -m eval.bench_jenga_engine --out results/jenga_engine                # tiny random model, served
    python -m eval.bench_jenga_engine --model gemma3-270m --out results/jenga_engine  # counted, 2K-16K

Each run submits `--requests` requests at once (`--max-rows` rows, more than memory allows) on a pool of
`--uniform-rows` rows' worth of uniform pages (every layer holding the whole context, as paging did before
Jenga: `BatchEngine(uniform_pages=True)`), once with Jenga's groups and once with uniform pages, on unique
prompts and on prompts sharing three quarters of their tokens (whole chunks). Recorded: the most and the mean
rows live at a dispatch, pool pages held per live row, KV waste (pool slots held for live rows that hold no
token, after every dispatch, summed), the rows that found their prefix in the pool, pages leaked.
`--mode served` runs `BatchEngine` on the model (greedy tokens must be equal under both pools); `--mode
counted` runs the same admission and placement (`RowPool`: prefix hit, `room_to_finish`, `reserve` ahead of
each dispatch, `free`) with each request's slots counted from its length instead of computed: no model
runs, so Gemma-3 270M's own config (from its fetched GGUF) is measured at 2K-16K. `tests/test_jenga_engine.py`
checks that both modes count the same rows on one trace. Writes bench_jenga_engine[_MODEL].{json,md,png}.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import numpy as np

from .lib.report import cpu_load, default_out, machine_info, markdown_table, write_outputs

WINDOW, PAGE, CHUNK = 64, 16, 128
MODEL = dict(model_type="gemma3_text", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
             sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
             query_pre_attn_scalar=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
TINY = "tiny-gemma3"  # MODEL with random weights


def model_config(name: str):
    """The ModelConfig of `TINY` or of a fetched GGUF model (its metadata only: no weights read)."""
    from kvjax.models.config import ModelConfig

    if name == TINY:
        return ModelConfig.from_hf_dict(MODEL)
    from kvjax.models.gguf import hf_config, metadata, open_gguf
    from kvjax.models.hub import resolve_model

    reader = open_gguf(resolve_model(name))
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return ModelConfig.from_hf_dict(hf_config(metadata(reader), shapes))


def traffic(kind: str, context: int, requests: int, vocab: int, chunk: int = CHUNK, seed: int = 0) -> list[list[int]]:
    """`requests` prompts of `context` tokens: random ("unique"), or sharing their first whole chunks up to
    three quarters of the context ("shared")."""
    rng = np.random.default_rng(seed)
    shared = (3 * context // 4) // chunk * chunk if kind == "shared" else 0
    prefix = rng.integers(0, vocab, size=shared).tolist()
    return [prefix + rng.integers(0, vocab, size=context - shared).tolist() for _ in range(requests)]


class _Tally:
    """What a run records after every dispatch: rows live at it, pages per live row, slots held and used."""

    def __init__(self):
        self.live, self.per_row, self.held, self.used = [], [], 0, 0

    def dispatched(self, live_at_dispatch: int, pool, lengths: dict[str, np.ndarray]) -> None:
        """`lengths`: request id -> slots `int[L, H]` of the rows still live after the dispatch."""
        self.live.append(live_at_dispatch)
        if lengths:
            self.per_row.append(pool.live_pages() / len(lengths))
            self.held += pool.live_pages() * pool.page_size
            self.used += pool.used_slots(lengths)

    def result(self, pool, dispatches: int, hits: int, leaked: int) -> dict:
        return {"max_live_rows": max(self.live), "mean_live_rows": float(np.mean(self.live)),
                "dispatches": dispatches, "pool_pages": pool.num_pages, "pages_per_live_row": float(np.mean(self.per_row)),
                "kv_waste": 1 - self.used / self.held if self.held else 0.0, "prefix_hit_rows": hits,
                "leaked_pages": leaked}


def serve(model, prompts, new_tokens: int, pool_pages: int, max_rows: int, uniform: bool, chunk: int = CHUNK,
          steps: int = 8, page_size: int = PAGE, prefix_cache_bytes: int = 0) -> dict:
    """Serve `prompts` at once on `BatchEngine` (greedy, no EOS); the tally and each request's tokens. The
    engine's prefix-state cache (which skips a cached prefix's prefill) is off unless `prefix_cache_bytes`."""
    from kvjax.serving.batch_engine import BatchEngine

    engine = BatchEngine(model, max_rows=max_rows, capacity=len(prompts[0]) + new_tokens, page_size=page_size,
                         chunk_size=chunk, steps_per_dispatch=steps, pool_pages=pool_pages, prefix_cache_bytes=prefix_cache_bytes,
                         uniform_pages=uniform)
    ids = [engine.submit(p, new_tokens, eos_token_id=-1) for p in prompts]
    tally, pool, done = _Tally(), None, 0
    started = time.perf_counter()
    while engine.has_work:
        before = engine.dispatches
        engine.step()
        if engine.dispatches > before:  # rows live at this dispatch: those left and those it finished
            batch = next(iter(engine.batches.values()), None)  # dropped once it has no row left
            after = {}
            if batch is not None:
                pool, lengths = batch.pool, np.asarray(batch.state.lengths)  # [L, R, H]
                after = {r.request_id: lengths[:, slot] for slot, r in enumerate(batch.rows) if r is not None}
            now = sum(engine.requests[i].finished for i in ids)
            tally.dispatched(len(after) + now - done, pool, after)
            done = now
    wall = time.perf_counter() - started
    return {**tally.result(pool, engine.dispatches, engine.shared_rows, engine.leaked_pages),
            "tokens": [engine.requests[i].tokens for i in ids], "wall_s": wall,
            "tokens_per_s": len(prompts) * new_tokens / wall}


def serve_counted(cfg, prompts, new_tokens: int, pool_pages: int, max_rows: int, uniform: bool, chunk: int = CHUNK,
                  steps: int = 8, page_size: int = PAGE) -> dict:
    """`serve`'s schedule with no model: `BatchEngine.step`'s order (insert the waiting prefilled request when
    a row and `room_to_finish` allow, prefill the next, dispatch `steps` tokens a row), each row's slots
    counted from its length (a window layer keeps its last W - 1 prompt tokens after prefill, as
    `append_and_attend_window`, then at most W), its pages placed as the engine places them."""
    from kvjax.cache.state import pages_for
    from kvjax.jenga.row_pool import RowPool
    from kvjax.policies import FullPolicy
    from kvjax.serving.batch_engine import row_pages

    capacity = len(prompts[0]) + new_tokens
    P = pages_for(capacity, page_size)
    pool = RowPool(cfg, FullPolicy(), cfg.num_kv_heads, page_size, "float32", pool_pages,
                   max_rows * row_pages(cfg, capacity, page_size), caching=True, uniform=uniform)
    window = np.asarray(cfg.windows or (0,) * cfg.num_layers)[:, None]  # [L, 1]
    rows: list[list | None] = [None] * max_rows  # per slot: [request id, slots int[L, H], tokens so far]
    waiting, ready = deque(enumerate(prompts)), None
    tally, hits, dispatches = _Tally(), 0, 0

    def ahead(slots: np.ndarray, tokens: int) -> np.ndarray:  # pages `int[L, H]` after `tokens` more
        return pool.pages_ahead(slots[:, None], np.array([tokens]), None, P)[:, 0]

    def place(index: int, prompt: list[int]) -> bool:
        nonlocal hits
        slot = next((i for i, r in enumerate(rows) if r is None), None)
        if slot is None:
            return False
        rid, T = f"req-{index}", len(prompt)
        slots = np.broadcast_to(np.where(window > 0, np.minimum(T, window - 1), T), (cfg.num_layers, cfg.num_kv_heads))
        held = np.minimum(pages_for(slots, page_size), P)
        prefix = prompt[: T // chunk * chunk]
        hit = pool.hit(prefix, chunk)
        final = {r[0]: ahead(r[1], new_tokens - r[2]) for r in rows if r is not None}
        if not pool.room_to_finish(final, np.maximum(ahead(slots, new_tokens - 1), held), pool.hit_blocks(hit)):
            return False
        if pool.allocator.reserve(rid, pool.blocks(held), hit) is None:
            pool.allocator.free(rid)
            return False
        rows[slot] = [rid, slots.copy(), 1]  # the first token is sampled at prefill
        hits += hit is not None
        if len(prefix):
            pool.allocator.register_prefix(rid, prefix)
        return True

    while waiting or ready is not None or any(rows):
        if ready is not None and place(*ready):
            ready = None
        while waiting and ready is None:  # prefill the next waiting request, insert it if it fits
            ready = waiting.popleft()
            if place(*ready):
                ready = None
        live = [r for r in rows if r is not None]
        if not live:
            raise RuntimeError(f"a request of {len(prompts[0])} tokens does not fit a pool of {pool.num_pages} pages")
        for r in live:  # the pages this dispatch's tokens may write, placed ahead
            if pool.allocator.reserve(r[0], pool.blocks(ahead(r[1], min(steps, new_tokens - r[2])))) is None:
                raise RuntimeError(f"the pool of {pool.num_pages} pages ran out for {r[0]} mid-decode")
        for slot, r in enumerate(rows):
            if r is not None:
                n = min(steps, new_tokens - r[2])
                r[1], r[2] = np.where(window > 0, np.minimum(r[1] + n, window), r[1] + n), r[2] + n
                if r[2] >= new_tokens:
                    pool.allocator.free(r[0])
                    rows[slot] = None
        dispatches += 1
        tally.dispatched(len(live), pool, {r[0]: r[1] for r in rows if r is not None})
    return tally.result(pool, dispatches, hits, pool.live_pages())


def fixed_pool_pages(cfg, context: int, new_tokens: int, uniform_rows: int, page_size: int = PAGE) -> int:
    """Device pages of `uniform_rows` uniform rows at `context + new_tokens` tokens, besides the large page per
    group the engine keeps for rounding, rounded up to a multiple of both pools' large pages (the same memory)."""
    from kvjax.jenga.row_pool import RowPool
    from kvjax.policies import FullPolicy

    large = [RowPool(cfg, FullPolicy(), cfg.num_kv_heads, page_size, "float32", 1, 0, False, uniform).large_pages
             for uniform in (False, True)]
    step = int(np.lcm(*large))
    uniform_row = cfg.num_layers * cfg.num_kv_heads * -(-(context + new_tokens) // page_size)
    return -(-(uniform_rows * uniform_row + step) // step) * step


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["runs"]
    labels = sorted({(r["context"], r["traffic"]) for r in rows})
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(labels)), 3.5))
    for offset, pool in ((-0.2, "jenga"), (0.2, "uniform")):
        values = [next(r["max_live_rows"] for r in rows if (r["context"], r["traffic"]) == label and r["pool"] == pool)
                  for label in labels]
        ax.bar(x + offset, values, 0.4, label=f"{pool} pages")
    ax.set_xticks(x, [f"{c // 1024 if c % 1024 == 0 else c / 1024:g}K tokens\n{t}" for c, t in labels])
    ax.set_ylabel("most requests live at once")
    ax.set_title(f"Fixed KV memory, {payload['model_name']} ({payload['mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(payload: dict) -> str:
    """The Markdown table of a run's JSON, with its settings (docs/jenga.md renders it). No speed: counts."""
    best = {(r["context"], r["traffic"]): r["max_live_rows"] for r in payload["runs"] if r["pool"] == "uniform"}
    headers = ["context", "traffic", "pool", "pool pages", "most live rows", "x uniform", "mean live rows",
               "pages / live row", "KV waste", "prefix-hit rows", "leaked pages"]
    table = markdown_table(headers, [
        [r["context"], r["traffic"], r["pool"], r["pool_pages"], r["max_live_rows"],
         f"{r['max_live_rows'] / best[(r['context'], r['traffic'])]:.2f}x", f"{r['mean_live_rows']:.1f}",
         f"{r['pages_per_live_row']:.0f}", f"{100 * r['kv_waste']:.1f}%", r["prefix_hit_rows"], r["leaked_pages"]]
        for r in payload["runs"]])
    args = payload["args"]
    how = ("served by `BatchEngine` (greedy tokens equal under both pools)" if payload["mode"] == "served" else
           "counted: the engine's admission and placement on the pool, each request's slots from its length, "
           "no model run")
    before = ", ".join(f"{b['pool_pages'] // b['row_pages']} at {b['context']}" for b in payload["before_issue_51"])
    return table + (
        f"\n{payload['model_name']}: {args['requests']} requests at once, {args['new_tokens']} new tokens each, "
        f"pages of {payload['page_size']} tokens, a pool with room for {args['uniform_rows']} uniform rows; {how}. "
        f"The engine before issue 51 (window layers holding their window, no prefix sharing on a model with "
        f"windows) had room for at most pool pages // `row_pages` rows: {before} tokens.\n")


def render_speed(payload: dict) -> str:
    """A `--timed` served run: each pool's tokens/s on the same requests (prefill and decode, programs compiled
    by a first serve), beside the rows it held."""
    speed = {(r["context"], r["traffic"], r["pool"]): r["tokens_per_s"] for r in payload["runs"]}
    table = markdown_table(["context", "traffic", "pool", "most live rows", "seconds", "new tokens/s", "x uniform"], [
        [r["context"], r["traffic"], r["pool"], r["max_live_rows"], f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.1f}",
         f"{r['tokens_per_s'] / speed[(r['context'], r['traffic'], 'uniform')]:.2f}x"] for r in payload["runs"]])
    args = payload["args"]
    return table + (
        f"\n{payload['model_name']}: {args['requests']} requests at once, {args['new_tokens']} new tokens each "
        f"(greedy, equal under both pools), at most {args['max_rows']} rows, a pool with room for "
        f"{args['uniform_rows']} uniform rows; prefix-state cache "
        f"{str(args.get('prefix_cache_mib', 0)) + ' MiB' if args.get('prefix_cache_mib') else 'off'}; seconds from "
        "submitting to the last token, each pool's second serve. "
        f"{payload['machine'].get('cpu_model', '')}, {payload['machine']['cpu_count']} cores.\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINY, help=f"{TINY} (random weights) or a fetched GGUF model (gemma3-270m)")
    p.add_argument("--mode", choices=("served", "counted"), default=None,
                   help=f"default: served on {TINY}, counted on a real model's config")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help=f"default 512 1024 ({TINY}), else 2K-16K")
    p.add_argument("--requests", type=int, default=None, help=f"default 24 ({TINY}), else 48")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--uniform-rows", type=int, default=3, help="the pool holds this many uniform rows")
    p.add_argument("--max-rows", type=int, default=None, help="default 32 served, all requests counted")
    p.add_argument("--timed", action="store_true",
                   help="served: serve each pool twice and time the second (programs compiled), for tokens/s")
    p.add_argument("--prefix-cache-mib", type=int, default=0,
                   help="served: the engine's prefix-state cache (skips a cached prefix's prefill); 0, off")
    p.add_argument("--out", default=default_out("jenga_engine"))
    args = p.parse_args(argv)
    tiny = args.model == TINY
    usual = "served" if tiny else "counted"
    args.mode = args.mode or usual
    args.contexts = args.contexts or ([512, 1024] if tiny else [2048, 4096, 8192, 16384])
    args.requests = args.requests or (24 if tiny else 48)
    args.max_rows = args.max_rows or (32 if args.mode == "served" else args.requests)

    cfg = model_config(args.model)
    model = None
    if args.mode == "served":
        import kvjax
        from kvjax.models.loading import Model, init_params

        model = Model(cfg, init_params(cfg, seed=0, std=0.1)) if tiny else kvjax.load_model(args.model)
    from kvjax.serving.batch_engine import row_pages

    load_start = cpu_load()
    rows, before = [], []
    for context in args.contexts:
        pool_pages = fixed_pool_pages(cfg, context, args.new_tokens, args.uniform_rows)
        before.append({"context": context, "pool_pages": pool_pages,
                       "row_pages": int(row_pages(cfg, context + args.new_tokens, PAGE))})
        for kind in ("unique", "shared"):
            prompts = traffic(kind, context, args.requests, cfg.vocab_size)
            runs = {}
            for pool in ("jenga", "uniform"):
                if model is None:
                    runs[pool] = serve_counted(cfg, prompts, args.new_tokens, pool_pages, args.max_rows, pool == "uniform")
                else:  # with --timed a first serve compiles this pool's programs and the second is timed
                    for _ in range(2 if args.timed else 1):
                        runs[pool] = serve(model, prompts, args.new_tokens, pool_pages, args.max_rows,
                                           pool == "uniform", prefix_cache_bytes=args.prefix_cache_mib << 20)
            if model is not None:
                if runs["jenga"]["tokens"] != runs["uniform"]["tokens"]:
                    raise AssertionError(f"greedy tokens differ between the pools at {context} tokens, {kind} traffic")
                for run in runs.values():
                    run.pop("tokens")
            for pool, run in runs.items():
                rows.append({"context": context, "traffic": kind, "pool": pool, **run})
                print(rows[-1], flush=True)
    shape = {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "windows": list(cfg.windows or ())}
    payload = {"model_name": args.model, "model": MODEL if tiny else shape, "mode": args.mode, "page_size": PAGE,
               "chunk_size": CHUNK, "args": vars(args), "runs": rows, "before_issue_51": before, "machine": machine_info(),
               **({} if args.timed else {"machine_shared": True}), "load_start": load_start, "load_end": cpu_load()}
    table = render_speed(payload) if args.timed else render(payload)
    name = ("bench_jenga_engine" + ("" if tiny else "_" + args.model.replace("-", "_"))
            + ("" if args.mode == usual else "_" + args.mode) + ("_timed" if args.timed else "")
            + (f"_prefix{args.prefix_cache_mib}" if args.prefix_cache_mib else ""))
    paths = write_outputs(args.out, name, payload, table)
    plot(payload, f"{args.out}/{name}.png")
    print(table)
    return {"paths": paths, "runs": rows}


if __name__ == "__main__":
    main()
