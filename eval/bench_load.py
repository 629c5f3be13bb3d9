"""`kvjax serve` under load: a bounded number of concurrent `openai` clients replay a seeded trace against the
server on 127.0.0.1, and the same requests run through `generate` one at a time in the same run.

The trace: `--requests` completions whose prompts (token ids) mix lengths between `--prompt-min` and
`--prompt-max`, half of them starting with one of a few shared prefixes, and ask for between
`--output-min` and `--output-max` tokens; `--concurrency` clients send them (streaming, greedy, the
server's policy or `--policy`). Measured: completion tokens per second over the whole run, time to first
token and inter-token latency (per request: (last chunk - first chunk) / (tokens - 1)) at p50 and p99,
requests lost (an error, or no finish reason: must be 0), pages leaked by the engine (must be 0), KV
memory waste after every dispatch for the engine's pages against Jenga's and uniform paging of the same
rows (`paging_waste`); and
`generate` on each request alone, back to back, for the tokens-per-second ratio. Both sides replay the
trace once untimed first, so every program is compiled before the clock starts; the server's prefix cache
is emptied after that pass, so the timed pass reuses only the whole `--chunk-size` chunks its own requests
share (its hit rate, in prompt tokens, is reported).

    python -m eval.bench_load --model tiny                     # ./kvjax-results/load/bench_load_tiny.*
    python -m eval.bench_load --model smollm2-135m --requests 16
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .lib.report import default_out, load_line, machine_info, markdown_table, write_outputs


def make_trace(args, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, seeded."""
    rng = np.random.default_rng(args.seed)
    low = 3  # above the special tokens of the shipped tokenizers
    prefixes = [rng.integers(low, vocab, size=int(rng.integers(args.prompt_min, args.prompt_max + 1)) // 2).tolist()
                for _ in range(3)]
    trace = []
    for i in range(args.requests):
        n = int(rng.integers(args.prompt_min, args.prompt_max + 1))
        head = prefixes[i % 3][: n // 2] if i % 2 == 0 else []
        prompt = head + rng.integers(low, vocab, size=n - len(head)).tolist()
        trace.append((prompt, int(rng.integers(args.output_min, args.output_max + 1))))
    return trace


def start_server(model, args):
    import kvjax
    from kvjax.serving.http import ServerConfig, serve_in_background

    policy = kvjax.make_policy(args.policy, **dict(args.policy_options))
    config = ServerConfig(args.model, policy, max_context=args.capacity, steps_per_dispatch=args.steps_per_dispatch,
                          max_rows=args.max_rows, chunk_size=args.chunk_size, prefix_cache_mb=args.prefix_cache_mb,
                          prefill_chunks_per_step=args.prefill_chunks_per_step)
    return serve_in_background(model, config)


def ask(client, model_name: str, prompt: list[int], max_tokens: int, policy: str | None = None,
        disconnect_after: int | None = None) -> dict:
    """One streamed completion (greedy; `policy`: the request's `kv_policy`); times of the request, its first
    and last content chunks, its usage and text. `disconnect_after`: the client closes the stream after that
    many content chunks, mid-stream (`disconnected` then)."""
    start = time.perf_counter()
    first = last = None
    tokens, finish, error, text, chunks, closed = 0, None, None, "", 0, False
    try:
        stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={} if policy is None else {"kv_policy": policy})
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if chunk.choices[0].text:
                    first = first or now
                    last = now
                    text += chunk.choices[0].text
                    chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if disconnect_after is not None and chunks >= disconnect_after and finish is None:
                stream.close()
                closed = True
                break
    except Exception as exc:  # counted as lost
        error = f"{type(exc).__name__}: {exc}"
    return {"start": start, "first": first, "last": last, "tokens": tokens, "finish": finish, "error": error,
            "text": text, "disconnected": closed}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def run_load(model, trace, args) -> dict:
    import openai

    server = start_server(model, args)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=args.timeout)
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:  # the same trace once, untimed: compiles every shape
            list(pool.map(lambda r: ask(client, args.model, *r), trace))
        engine = server.app.state.worker.engine
        dispatches_before = engine.dispatches
        engine.memory_samples.clear()
        engine.memory_every = 1  # what the pages hold after every timed dispatch (a small host read each)
        if engine.prefix is not None:  # the timed pass reuses only prefixes its own requests share
            engine.prefix.clear()
            engine.prefix.stats = type(engine.prefix.stats)()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda r: ask(client, args.model, *r), trace))
        wall = time.perf_counter() - start
        engine = server.app.state.worker.engine
        leaked = engine.leaked_pages + sum(b.pool.live_pages() for b in engine.batches.values())
    finally:
        server.stop()
    done = [r for r in results if r["error"] is None and r["finish"] is not None]
    ttft = [r["first"] - r["start"] for r in done if r["first"] is not None]
    itl = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in done if r["first"] is not None and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in done)
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "requests": len(trace), "lost": len(trace) - len(done), "errors": [r["error"] for r in results if r["error"]],
            "pages_leaked": int(leaked), "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "dispatches": engine.dispatches - dispatches_before,
            "prefix_hit_rate": engine.prefix.stats.hit_rate if engine.prefix is not None else 0.0,
            "prefix_stats": None if engine.prefix is None else {**vars(engine.prefix.stats), "bytes": engine.prefix.bytes,
                                                                "entries": len(engine.prefix)},
            "memory": paging_waste(engine.memory_samples, engine.page_size)}


def paging_waste(samples, page_size: int) -> dict:
    """Share of held KV slots holding nothing attention reads, over every timed dispatch (slots summed over
    the samples: a time average weighted by what is held), for the engine's single-head pages as they are
    (shared prefix pages once) and the same rows under page tables shared by a layer's kv heads (Jenga's
    groups at their finest, a group per layer) and under vLLM v0's uniform paging (every token seen, every
    layer), both with `page_size`-token pages and no prefix sharing (`kvjax.serving.memory`)."""
    from kvjax.serving.memory import grouped_slots, uniform_slots, waste

    kept = sum(s.kept_slots for s in samples)
    row_kept = sum(s.row_kept_slots for s in samples)
    held = {"kvjax pages": sum(s.held_slots for s in samples),
            "kvjax pages, unshared": sum(s.row_held_slots for s in samples),
            "jenga, a group per layer": sum(grouped_slots(s, page_size) for s in samples),
            "uniform": sum(uniform_slots(s, page_size) for s in samples)}
    return {"samples": len(samples), "kept_slots": kept, "held_slots": held,
            "waste": {name: waste(h, kept if name == "kvjax pages" else row_kept) for name, h in held.items()}}


SOAK_POLICIES = ("full", "quest:token_budget=64", "snapkv:token_budget=64", "h2o:token_budget=64")


def wait_idle(worker, timeout: float) -> None:
    """Until the server's worker has no job queued or running and its engine no work (TimeoutError after
    `timeout` seconds)."""
    deadline = time.time() + timeout
    while worker.running or not worker.jobs.empty() or worker.engine.has_work:
        if time.time() > deadline:
            raise TimeoutError(f"the server still had work {timeout:g} s after the last client finished")
        time.sleep(0.05)


def run_soak(model, trace, args) -> dict:
    """`--soak`: the trace's requests streamed by `--concurrency` clients, their policies taking turns over
    `--soak-policies`, every `--disconnect-every`-th client closing its stream after its first text; the
    first request of each policy (a probe) asked alone before and after, and again every `--probe-every`-th
    request under load. Counted: requests lost, pages the engine still holds once idle, engine restarts
    (a failed step), probe answers that differ."""
    import openai

    policies = args.soak_policies
    probes = [(*trace[i], policies[i % len(policies)]) for i in range(len(policies))]
    every = args.disconnect_every
    requests = [(prompt, max_tokens, policies[i % len(policies)], 1 if i % every == every - 1 else None)
                for i, (prompt, max_tokens) in enumerate(trace)]
    for i in range(0, len(requests), args.probe_every):
        requests[i] = (*probes[(i // args.probe_every) % len(probes)], None)
    server = start_server(model, args)
    worker = server.app.state.worker
    engine = worker.engine
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=args.timeout)
    try:
        alone = [ask(client, args.model, *probe)["text"] for probe in probes]
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda r: ask(client, args.model, *r), requests))
        wait_idle(worker, args.timeout)
        wall = time.perf_counter() - start
        after = [ask(client, args.model, *probe)["text"] for probe in probes]
        wait_idle(worker, args.timeout)
        leaked = engine.leaked_pages + sum(b.pool.live_pages() for b in engine.batches.values())
        restarts = int(worker.engine is not engine)
    finally:
        server.stop()
    disconnected = sum(r["disconnected"] for r in results)
    done = [r for r in results if not r["disconnected"] and r["error"] is None and r["finish"] is not None]
    under_load = [r["text"] == alone[probes.index(q[:3])] for q, r in zip(requests, results) if q[:3] in probes]
    return {"requests": len(requests), "policies": list(policies), "disconnected": disconnected,
            "server_cancelled": worker.cancelled, "completed": len(done),
            "lost": len(requests) - disconnected - len(done),
            "errors": [r["error"] for r in results if r["error"]][:5], "pages_leaked": int(leaked),
            "engine_restarts": restarts, "dispatches": engine.dispatches, "wall_s": wall,
            "prefix_hit_rate": engine.prefix.stats.hit_rate if engine.prefix is not None else 0.0,
            "prefix_stats": None if engine.prefix is None else {**vars(engine.prefix.stats), "bytes": engine.prefix.bytes,
                                                                "entries": len(engine.prefix)},
            "probes_same_under_load": [int(sum(under_load)), len(under_load)],
            "probes_same_after": [int(sum(a == b for a, b in zip(alone, after))), len(probes)]}


def soak_failures(s: dict) -> list[str]:
    """What a soak's counts (`run_soak`'s dict) show went wrong; empty when it held."""
    checks = [(s["lost"], "requests lost"), (s["pages_leaked"], "pages leaked"),
              (s["engine_restarts"], "engine restarts"),
              (s["probes_same_under_load"][1] - s["probes_same_under_load"][0], "probes answered otherwise under load"),
              (s["probes_same_after"][1] - s["probes_same_after"][0], "probes answered otherwise after")]
    return [f"{n} {what}" for n, what in checks if n]


def soak_table(payload: dict) -> str:
    """`--soak`'s table (no speed: counts), a row per payload (one run's payload, or several: a model each)."""
    payloads = payload if isinstance(payload, list) else [payload]
    rows = []
    for p in payloads:
        s, trace = p["soak"], p["trace"]
        hits = s.get("prefix_hit_rate")  # not counted by the first soaks
        rows.append([p["model"], s["requests"], len(s["policies"]), p["concurrency"],
                     "{}-{} / {}-{}".format(*trace["prompt_tokens"], *trace["output_tokens"]),
                     f"{s['disconnected']} (server cancelled {s['server_cancelled']})", s["completed"], s["lost"],
                     s["pages_leaked"], s["engine_restarts"], "{}/{}".format(*s["probes_same_under_load"]),
                     "{}/{}".format(*s["probes_same_after"]),
                     "not counted" if hits is None else f"{100 * hits:.0f}%"])
    setups = sorted({(", ".join(p["soak"]["policies"]), p["disconnect_every"], p["max_rows"]) for p in payloads})
    common = " ".join(f"Policies {pol} in turn; every {every}th client closes its stream after its first text; "
                      f"max_rows {rows} per policy's batch." for pol, every, rows in setups)
    runs = "; ".join(f"{p['model']}, prompts {p['trace']['prompt_tokens'][0]}-{p['trace']['prompt_tokens'][1]}: "
                     f"prefill chunk {p['chunk_size']}"
                     + (f", {p['steps_per_dispatch']} steps per dispatch" if "steps_per_dispatch" in p else "")
                     + f", {p['soak']['wall_s'] / 60:.0f} min" for p in payloads)
    return markdown_table(
        ["model", "requests", "policies", "clients", "prompt / output tokens", "disconnected mid-stream", "completed",
         "lost", "pages leaked", "engine restarts", "probes as alone, under load", "probes as before, after",
         "prefix hits (prompt tokens)"], rows,
    ) + f"\nStreamed, greedy. {common} {runs} (on shared cores: not a speed figure).\n"


def run_sequential(model, trace, args) -> dict:
    """`generate` on each request alone, one after another (same policy, greedy, the model's EOS)."""
    import kvjax

    policy = kvjax.make_policy(args.policy, **dict(args.policy_options))
    for prompt, max_tokens in trace:  # untimed pass: compiles every shape, as the server's
        kvjax.generate(model, [prompt], max_tokens, policy, steps_per_dispatch=args.steps_per_dispatch,
                       chunk_size=args.chunk_size)
    start = time.perf_counter()
    tokens = 0
    for prompt, max_tokens in trace:
        out = kvjax.generate(model, [prompt], max_tokens, policy, steps_per_dispatch=args.steps_per_dispatch,
                             chunk_size=args.chunk_size)
        tokens += int((out[0] >= 0).sum())
    wall = time.perf_counter() - start
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall}


def interleave_table(payloads: list) -> str:
    """Runs that differ only in `--prefill-chunks-per-step`, a row each: what spreading a prefill over
    dispatches trades (throughput and first-token time against steadier inter-token latency)."""
    rows = []
    for p in payloads:
        s = p["server"]
        rows.append([p["prefill_chunks_per_step"] or "whole prompts first", p["chunk_size"],
                     f"{s['tokens_per_s']:.3g}",
                     f"{s['ttft_s']['p50']:.1f} / {s['ttft_s']['p99']:.1f}",
                     f"{1e3 * s['itl_s']['p50']:.0f} / {1e3 * s['itl_s']['p99']:.0f}"])
    loads = sorted({load_line(p) for p in payloads})
    return (markdown_table(["prefill chunks per dispatch", "chunk", "tok/s served", "TTFT p50 / p99 s",
                            "ITL p50 / p99 ms"], rows) + "\n" + " ".join(loads) + "\n")


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load, seq = payload["server"], payload["generate_one_at_a_time"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(["server, batched", "generate, one at a time"], [load["tokens_per_s"], seq["tokens_per_s"]])
    a.set_ylabel("completion tokens/s")
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
        b.bar([f"{name} p50", f"{name} p99"], [load[key]["p50"] or 0, load[key]["p99"] or 0])
    b.set_ylabel("seconds")
    b.set_yscale("log")
    fig.suptitle(f"kvjax serve, {payload['model']}, {payload['concurrency']} clients, policy {payload['policy']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (`policy_options` parsed to (key, value) pairs)."""
    from kvjax.policies.options import parse_policy_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--steps-per-dispatch", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--output-min", type=int, default=8)
    parser.add_argument("--output-max", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (and prefix reuse granularity)")
    parser.add_argument("--prefix-cache-mb", type=int, default=256, help="the server's prefix cache (0: off)")
    parser.add_argument("--prefill-chunks-per-step", type=int, default=0,
                        help="the server's prefill chunks between two dispatches (0: whole prompts first)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=default_out("load"))
    parser.add_argument("--soak", action="store_true", help="a soak instead (run_soak): mixed policies, disconnects")
    parser.add_argument("--soak-policies", nargs="+", default=list(SOAK_POLICIES), metavar="SPEC")
    parser.add_argument("--disconnect-every", type=int, default=5)
    parser.add_argument("--probe-every", type=int, default=10)
    args = parser.parse_args(argv)
    args.policy_options = tuple(parse_policy_options(args.policy, args.policy_option).items())
    return args


def main(argv=None) -> dict:
    import kvjax

    args = parse_args(argv)
    model = kvjax.load_model(args.model)
    trace = make_trace(args, model.cfg.vocab_size)
    if args.soak:
        return soak(model, trace, args)
    load = run_load(model, trace, args)
    sequential = run_sequential(model, trace, args)
    payload = {"benchmark": "bench_load", "machine": machine_info(), "model": args.model, "policy": args.policy,
               "policy_options": dict(args.policy_options), "concurrency": args.concurrency, "max_rows": args.max_rows,
               "chunk_size": args.chunk_size, "prefill_chunks_per_step": args.prefill_chunks_per_step,
               "trace": {"requests": args.requests, "prompt_tokens": [args.prompt_min, args.prompt_max],
                         "output_tokens": [args.output_min, args.output_max], "seed": args.seed},
               "server": load, "generate_one_at_a_time": sequential,
               "throughput_ratio": load["tokens_per_s"] / sequential["tokens_per_s"]}
    ms = lambda x: "" if x is None else f"{1000 * x:.0f}"  # noqa: E731
    table = markdown_table(
        ["model", "policy", "clients", "requests", "lost", "pages leaked", "tok/s served", "tok/s generate 1-by-1",
         "ratio", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "prefix hits",
         "KV waste: kvjax / Jenga / uniform"],
        [[args.model, args.policy, args.concurrency, args.requests, load["lost"], load["pages_leaked"],
          load["tokens_per_s"], sequential["tokens_per_s"], f"{payload['throughput_ratio']:.2f}x",
          f"{ms(load['ttft_s']['p50'])} / {ms(load['ttft_s']['p99'])}",
          f"{ms(load['itl_s']['p50'])} / {ms(load['itl_s']['p99'])}",
          f"{100 * load['prefix_hit_rate']:.0f}% of prompt tokens",
          " / ".join(f"{100 * load['memory']['waste'][k]:.1f}%"
                     for k in ("kvjax pages", "jenga, a group per layer", "uniform"))]],
    ) + (f"\n{payload['machine'].get('cpu_model', '')}, {payload['machine']['cpu_count']} cores; prompts "
         f"{args.prompt_min}-{args.prompt_max} tokens, outputs up to {args.output_min}-{args.output_max}, greedy; "
         f"max_rows {args.max_rows}, {args.steps_per_dispatch} steps per dispatch, prefill chunk {args.chunk_size}, "
         f"prefix cache {args.prefix_cache_mb} MB, prefill chunks per step {args.prefill_chunks_per_step or 'unlimited'}.\n")
    name = f"bench_load_{args.model.replace('-', '_')}"
    paths = write_outputs(args.out, name, payload, table)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(table)
    if load["lost"] or load["pages_leaked"]:
        raise SystemExit(f"{load['lost']} requests lost, {load['pages_leaked']} pages leaked: {load['errors'][:3]}")
    return payload


def soak(model, trace, args) -> dict:
    payload = {"benchmark": "bench_load --soak", "machine": machine_info(), "model": args.model,
               "concurrency": args.concurrency, "max_rows": args.max_rows, "chunk_size": args.chunk_size,
               "steps_per_dispatch": args.steps_per_dispatch, "disconnect_every": args.disconnect_every,
               "probe_every": args.probe_every,
               "trace": {"requests": args.requests, "prompt_tokens": [args.prompt_min, args.prompt_max],
                         "output_tokens": [args.output_min, args.output_max], "seed": args.seed},
               "soak": run_soak(model, trace, args)}
    table = soak_table(payload)
    write_outputs(args.out, f"bench_load_soak_{args.model.replace('-', '_')}", payload, table)
    print(table)
    if soak_failures(payload["soak"]):
        raise SystemExit(f"soak failed ({'; '.join(soak_failures(payload['soak']))}): {payload['soak']}")
    return payload


if __name__ == "__main__":
    main()
