"""Jenga allocator benchmark: replays synthetic serving traces through the allocator alone (no model) and
compares it with uniform paging (every layer of every group paged like a full-attention layer of the
widest per-token size, vLLM v0's layout).

Measured per (config, allocator): memory waste (allocated bytes holding nothing any layer needs, time
averaged), the most requests of a fixed shape resident at once, requests completed per simulated step,
and the prefix hit rate.

Writes bench_serving[_quick].{json,md,png} under --out (default ./kvjax-results/serving; the committed
run is in results/serving). Served memory on a real model (the batch engine's pages against Jenga and
uniform paging of the same live requests) is measured by `eval/bench_load.py`.

    python -m eval.bench_serving --quick        # a minute or two
    python -m eval.bench_serving                # the full run (committed with --out results/serving)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import sys
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from kvjax.jenga import (
    AuxiliaryModelSpec,
    BudgetedSpec,
    FullAttentionSpec,
    JengaAllocator,
    QuestMetadataSpec,
    RequestTooLargeError,
    SlidingWindowSpec,
    UniformPagingSpec,
    choose_large_page_bytes,
)

from .lib.report import default_out

GIB = 2**30


# =====================================================================================================
# Model configs
# =====================================================================================================
def gemma2_9b() -> list:
    """Gemma-2-9B shape: 42 layers alternating local (sliding window 4096) and global attention, 8 kv
    heads, head_dim 256, bf16: 21 layers in each group."""
    shape = dict(num_layers=21, num_kv_heads=8, head_dim=256, dtype="bfloat16", tokens_per_page=16)
    return [SlidingWindowSpec(name="local_sw4096", window=4096, **shape), FullAttentionSpec(name="global", **shape)]


LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", tokens_per_page=16)


def llama3_quest_aux() -> list:
    """Llama-3-8B KV, its Quest metadata (kmin/kmax per 16-token page, per layer and kv head), and the KV
    of a TinyLlama-1.1B-shaped auxiliary model (22 layers, 4 kv heads, head_dim 64) over the same tokens."""
    return [
        FullAttentionSpec(name="llama_kv", **LLAMA3_8B),
        QuestMetadataSpec(name="quest_meta", quest_page_size=16, **LLAMA3_8B),
        AuxiliaryModelSpec(name="aux_kv", model="TinyLlama-1.1B", num_layers=22, num_kv_heads=4, head_dim=64, tokens_per_page=16),
    ]


def llama3_budgeted(budget: int, snapshot_every: int) -> list:
    """Llama-3-8B with its first 2 layers dense and 30 layers under a token-budget policy (Locret-style
    chunked eviction to `budget` slots per head), snapshots of the budgeted state every `snapshot_every`
    tokens for prefix reuse."""
    dense = dict(LLAMA3_8B, num_layers=2)
    budgeted = dict(LLAMA3_8B, num_layers=30)
    return [
        FullAttentionSpec(name="dense_2", **dense),
        BudgetedSpec(name=f"budget_{budget}", budget=budget, policy=f"locret(b={budget})", snapshot_every=snapshot_every, **budgeted),
    ]


# =====================================================================================================
# Synthetic trace
# =====================================================================================================
@dataclasses.dataclass
class TraceRequest:
    request_id: str
    arrival_step: int
    prompt: list[int]
    output_len: int
    shared_prefix_len: int


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def make_trace(args, seed: int) -> list[TraceRequest]:
    """Requests reusing a few shared prefixes (system prompts and documents, Zipf-like popularity),
    Poisson arrivals, log-uniform suffix and output lengths. Token ids are random, so only the shared
    prefixes can hit."""
    rng = random.Random(seed)
    vocab = 128_000
    prefixes = [
        [rng.randrange(vocab) for _ in range(log_uniform(rng, args.prefix_min, args.prefix_max))]
        for _ in range(args.num_prefixes)
    ]
    weights = [1.0 / (rank + 1) for rank in range(args.num_prefixes)]
    trace, step = [], 0
    for index in range(args.num_requests):
        step += int(rng.expovariate(args.arrival_rate))  # Poisson arrivals: exponential gaps in steps
        shared = rng.choices(prefixes, weights)[0] if rng.random() < args.shared_fraction else []
        suffix = [rng.randrange(vocab) for _ in range(log_uniform(rng, args.suffix_min, args.suffix_max))]
        trace.append(
            TraceRequest(f"req{index}", step, shared + suffix, log_uniform(rng, args.output_min, args.output_max), len(shared))
        )
    return trace


# =====================================================================================================
# A minimal continuous-batching loop (benchmark only; the engine proper is not part of this module)
# =====================================================================================================
@dataclasses.dataclass(eq=False)  # identity: `in` and remove() must not compare token lists
class Running:
    request: TraceRequest
    tokens: list[int]  # prompt (plus tokens generated before a preemption), then generated tokens
    prefill_len: int  # tokens to compute before decoding starts
    computed: int
    generated: int
    admitted_step: int


class Simulator:
    """Step loop: decode one token for every decoding request, then prefill chunks (ending on multiples
    of `chunk`, so budgeted snapshots line up) within a token budget, then admit waiting requests
    first-come-first-served while the allocator can place their first chunk. A decode that does not fit
    preempts the most recently admitted request (its work is recomputed later, vLLM's recompute mode)."""

    def __init__(self, allocator: JengaAllocator, trace: list[TraceRequest], args, label: str):
        self.alloc = allocator
        self.trace = trace
        self.args = args
        self.label = label
        self.rng = random.Random(1234)
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.step_index = 0
        self.completed = 0
        self.rejected = 0
        self.preemptions = 0
        self.hit_tokens = 0
        self.prefill_tokens_asked = 0
        self.computed_tokens = 0
        self.snapshot_copy_pages = 0
        self.samples: list[dict] = []
        self.batch_sizes: list[int] = []

    def run(self) -> dict:
        pending = deque(self.trace)
        total = len(self.trace)
        progress = tqdm(total=total, desc=self.label, leave=False, unit="req")
        while self.completed + self.rejected < total:
            while pending and pending[0].arrival_step <= self.step_index:
                request = pending.popleft()
                self.waiting.append(Running(request, list(request.prompt), len(request.prompt), 0, 0, -1))
            done_before = self.completed + self.rejected
            self.step()
            progress.update(self.completed + self.rejected - done_before)
            if self.step_index % self.args.sample_every == 0:
                self.sample()
            self.step_index += 1
            if self.step_index > self.args.max_steps:
                raise RuntimeError(f"{self.label}: trace did not finish in {self.args.max_steps} steps")
        progress.close()
        return self.summary()

    # --- one step --------------------------------------------------------------------------------------
    def step(self) -> None:
        budget = self.args.step_tokens
        scheduled: list[tuple[Running, int]] = []
        for running in list(self.running):  # decodes first
            if running.computed < running.prefill_len or running not in self.running:
                continue
            token = self.rng.randrange(128_000)
            while running in self.running and self.alloc.allocate(running.request.request_id, [token]) is None:
                victim = self.preempt_latest()
                scheduled = [(r, c) for r, c in scheduled if r is not victim]
            if running in self.running:
                running.tokens.append(token)
                scheduled.append((running, 1))
                budget -= 1
        for running in self.running:  # prefill chunks of admitted requests
            if running.computed < running.prefill_len and budget > 0:
                count = self.chunk_size(running, budget)
                if self.alloc.allocate(running.request.request_id, running.tokens[running.computed : running.computed + count]) is None:
                    continue  # no room this step; decodes will free or preempt
                scheduled.append((running, count))
                budget -= count
        while self.waiting and budget > 0:  # admissions
            candidate = self.waiting[0]
            hit = self.alloc.get_computed_prefix(candidate.tokens)
            candidate.computed = hit.num_tokens
            count = self.chunk_size(candidate, budget)
            try:
                fits = self.alloc.can_allocate(candidate.request.request_id, count, hit)
            except RequestTooLargeError:
                self.waiting.popleft()
                self.rejected += 1
                continue
            if not fits:
                break
            allocation = self.alloc.allocate(candidate.request.request_id, candidate.tokens[hit.num_tokens : hit.num_tokens + count], hit)
            assert allocation is not None, "can_allocate said yes"
            self.snapshot_copy_pages += len(allocation.copies)
            self.waiting.popleft()
            self.hit_tokens += hit.num_tokens
            self.prefill_tokens_asked += candidate.prefill_len
            candidate.admitted_step = self.step_index
            self.running.append(candidate)
            scheduled.append((candidate, count))
            budget -= count
        for running, count in scheduled:
            result = self.alloc.commit(running.request.request_id)
            self.snapshot_copy_pages += len(result.copies)
            running.computed += count
            self.computed_tokens += count
            if running.computed > running.prefill_len:
                running.generated += 1
            elif running.computed == running.prefill_len:
                running.generated += 1  # the last prefill step samples the first output token
            if running.generated >= running.request.output_len and running.computed >= running.prefill_len:
                self.alloc.free(running.request.request_id)
                self.running.remove(running)
                self.completed += 1
        self.batch_sizes.append(len(self.running))

    def chunk_size(self, running: Running, budget: int) -> int:
        remaining = running.prefill_len - running.computed
        to_boundary = self.args.chunk - running.computed % self.args.chunk
        return max(1, min(remaining, budget, to_boundary))

    def preempt_latest(self) -> Running:
        victim = max(self.running, key=lambda r: r.admitted_step)
        self.alloc.free(victim.request.request_id)
        self.running.remove(victim)
        # Recompute later: everything it had becomes the prompt of a fresh admission.
        victim.prefill_len = len(victim.tokens)
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    # --- measurement ---------------------------------------------------------------------------------
    def sample(self) -> None:
        stats = self.alloc.stats()
        self.samples.append(
            {
                "step": self.step_index,
                "held_bytes": stats.held_bytes,
                "needed_bytes": stats.needed_bytes,
                "cached_bytes": stats.reusable_bytes,
                "internal_bytes": stats.internal_bytes,
                "external_bytes": stats.external_bytes,
                "waste_bytes": stats.waste_bytes,
                "running": len(self.running),
            }
        )

    def summary(self) -> dict:
        held = sum(s["held_bytes"] for s in self.samples)
        busy = [s for s in self.samples if s["held_bytes"] >= 0.5 * self.alloc.layout.pool_bytes]
        return {
            "steps": self.step_index,
            "completed": self.completed,
            "rejected": self.rejected,
            "preemptions": self.preemptions,
            "requests_per_step": self.completed / self.step_index,
            "tokens_per_step": self.computed_tokens / self.step_index,
            "mean_running": sum(self.batch_sizes) / len(self.batch_sizes),
            "peak_running": max(self.batch_sizes),
            "prefix_hit_rate": self.hit_tokens / max(1, self.prefill_tokens_asked),
            "waste_fraction": sum(s["waste_bytes"] for s in self.samples) / held if held else 0.0,
            "waste_fraction_of_in_use": (
                sum(s["waste_bytes"] for s in self.samples) / (held - sum(s["cached_bytes"] for s in self.samples))
                if held
                else 0.0
            ),
            "internal_fraction": sum(s["internal_bytes"] for s in self.samples) / held if held else 0.0,
            "external_fraction": sum(s["external_bytes"] for s in self.samples) / held if held else 0.0,
            "cached_fraction": sum(s["cached_bytes"] for s in self.samples) / held if held else 0.0,
            "waste_fraction_when_busy": (
                sum(s["waste_bytes"] for s in busy) / sum(s["held_bytes"] for s in busy) if busy else None
            ),
            "snapshot_copy_pages": self.snapshot_copy_pages,
            "samples": self.samples,
        }


def max_resident_requests(allocator: JengaAllocator, prompt_tokens: int, chunk: int, seed: int) -> dict:
    """Admits requests of `prompt_tokens` unique tokens (prefilled in `chunk`-token steps) until the pool
    is full: how many are resident at once, and the waste in that packed state."""
    rng = random.Random(seed)
    count = 0
    while True:
        request_id = f"static{count}"
        tokens = [rng.randrange(128_000) for _ in range(prompt_tokens)]
        done = 0
        while done < prompt_tokens:
            step = min(chunk, prompt_tokens - done)
            if allocator.allocate(request_id, tokens[done : done + step]) is None:
                allocator.free(request_id)
                stats = allocator.stats()
                return {"requests": count, "waste_fraction": stats.waste_fraction, "prompt_tokens": prompt_tokens}
            allocator.commit(request_id)
            done += step
        count += 1


# =====================================================================================================
# Runs
# =====================================================================================================
def build_allocator(kind: str, specs: list, pool_gib: float, large_page_ratio: int | None = None, **options) -> JengaAllocator:
    """`kind` "uniform" pages every member layer as a full-attention layer (the baseline); "jenga" uses
    the groups as given. `large_page_ratio` 0 forces the LCM rule; `options` go to JengaAllocator."""
    pool_bytes = int(pool_gib * GIB)
    if kind == "uniform":
        return JengaAllocator([UniformPagingSpec(members=tuple(specs))], pool_bytes)
    large = None
    if large_page_ratio is not None:
        sizes = [s.page_bytes for s in specs]
        large = math.lcm(*sizes) if large_page_ratio == 0 else choose_large_page_bytes(sizes, large_page_ratio)
    return JengaAllocator(specs, pool_bytes, large_page_bytes=large, **options)


def run_variant(config: str, variant: str, specs: list, trace: list[TraceRequest], args, pool_gib: float, **build) -> dict:
    started = time.perf_counter()
    kind = "uniform" if variant == "uniform" else "jenga"
    allocator = build_allocator(kind, specs, pool_gib, **build)
    result = Simulator(allocator, trace, args, f"{config}/{variant}").run()
    static = max_resident_requests(build_allocator(kind, specs, pool_gib, **build), args.static_prompt, args.chunk, seed=7)
    layout = allocator.layout
    return {
        "config": config,
        "variant": variant,
        "pool_gib": pool_gib,
        "large_page_bytes": layout.large_page_bytes,
        "num_large_pages": layout.num_large_pages,
        "groups": [
            {
                "name": s.name,
                "kind": type(s).__name__,
                "page_bytes": s.page_bytes,
                "pages_per_large": layout.pages_per_large(s.name),
                "tail_slack_bytes": layout.tail_slack_bytes(s.name),
            }
            for s in layout.specs
        ],
        "max_resident": static,
        "wall_s": time.perf_counter() - started,
        **result,
    }


def run_allocator_part(args) -> dict:
    budget_config = f"llama3_8b_budget{args.budget}"
    configs = {
        "gemma2_9b": (gemma2_9b(), args.pool_gib),
        "llama3_8b_quest_aux": (llama3_quest_aux(), args.pool_gib),
        # Budgeted layers make requests ~10x smaller; a smaller pool keeps memory the limit.
        budget_config: (llama3_budgeted(args.budget, args.chunk), args.pool_gib * args.budget_pool_fraction),
    }
    runs = []
    plan = []
    for config, (specs, pool_gib) in configs.items():
        plan += [(config, "jenga", specs, pool_gib, {}), (config, "uniform", specs, pool_gib, {})]
    gemma, gemma_pool = configs["gemma2_9b"]
    quest_aux, quest_pool = configs["llama3_8b_quest_aux"]
    plan += [
        # Eviction order of sliding-window blocks released early: by the time they left the window.
        ("gemma2_9b", "jenga, no kept window", gemma, gemma_pool, {"keep_shared_prefix_window": False}),
        ("gemma2_9b", "jenga, no kept window, early-release LRU", gemma, gemma_pool,
         {"keep_shared_prefix_window": False, "align_early_released": False}),
        # The large-page rule and placement, where page sizes differ (the LCM is 11x the KV page).
        ("llama3_8b_quest_aux", "jenga L=LCM (22 MiB)", quest_aux, quest_pool, {"large_page_ratio": 0}),
        ("llama3_8b_quest_aux", "jenga L=1x KV page", quest_aux, quest_pool, {"large_page_ratio": 1}),
        ("llama3_8b_quest_aux", "jenga fresh-large-page-first", quest_aux, quest_pool, {"fresh_large_page_first": True}),
    ]
    traces = {}
    for config, variant, specs, pool_gib, build in tqdm(plan, desc="runs", unit="run"):
        if config not in traces:
            traces[config] = make_trace(args, seed=args.seed)
        runs.append(run_variant(config, variant, specs, traces[config], args, pool_gib, **build))
    return {
        "trace": {
            "num_requests": args.num_requests,
            "mean_prompt_tokens": sum(len(r.prompt) for r in traces["gemma2_9b"]) / args.num_requests,
            "mean_shared_prefix_tokens": sum(r.shared_prefix_len for r in traces["gemma2_9b"]) / args.num_requests,
            "mean_output_tokens": sum(r.output_len for r in traces["gemma2_9b"]) / args.num_requests,
        },
        "runs": runs,
    }


# =====================================================================================================
# Report
# =====================================================================================================
def ratio(value, base):
    return value / base if base else float("nan")


def run_all(args) -> dict:
    report = {
        "benchmark": "bench_serving",
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()},
    }
    report.update(run_allocator_part(args))
    return report


def markdown_table(report: dict) -> str:
    return allocator_table(report)


def allocator_table(report: dict) -> str:
    runs = report["runs"]
    args = report["args"]
    baseline = {r["config"]: r for r in runs if r["variant"] == "uniform"}
    lines = [
        f"{report['trace']['num_requests']} requests (mean prompt {report['trace']['mean_prompt_tokens']:.0f} tokens of which "
        f"{report['trace']['mean_shared_prefix_tokens']:.0f} in a shared prefix, mean output "
        f"{report['trace']['mean_output_tokens']:.0f}), {args['arrival_rate']} arrivals per step, {args['step_tokens']} tokens "
        "per step. Waste: held bytes that no layer needs, averaged over the run, as a share of all held bytes and of "
        "in-use bytes (held minus evictable prefix cache). Max resident: requests of "
        f"{args['static_prompt']} unique prompt tokens held at once.",
        "",
        "| config | allocator | pool | large page | waste % held | waste % in use | internal / external % held "
        "| max resident (x uniform) | requests per step (x uniform) | mean batch | prefix hit % | preemptions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        base = baseline[r["config"]]
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['pool_gib']:g} GiB | {r['large_page_bytes'] / 2**20:.3g} MiB | "
            f"{100 * r['waste_fraction']:.2f} | {100 * r['waste_fraction_of_in_use']:.2f} | "
            f"{100 * r['internal_fraction']:.2f} / {100 * r['external_fraction']:.2f} | "
            f"{r['max_resident']['requests']} ({ratio(r['max_resident']['requests'], base['max_resident']['requests']):.2f}x) | "
            f"{r['requests_per_step']:.4f} ({ratio(r['requests_per_step'], base['requests_per_step']):.2f}x) | "
            f"{r['mean_running']:.1f} | {100 * r['prefix_hit_rate']:.1f} | {r['preemptions']} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in report["runs"] if r["variant"] in ("jenga", "uniform")]
    configs_with_pool = {r["config"]: f"{r['config']}\n({r['pool_gib']:g} GiB)" for r in main}
    configs = list(dict.fromkeys(r["config"] for r in main))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    width = 0.38
    for offset, variant, color in ((-width / 2, "jenga", "tab:blue"), (width / 2, "uniform", "tab:gray")):
        rows = [next(r for r in main if r["config"] == c and r["variant"] == variant) for c in configs]
        xs = [i + offset for i in range(len(configs))]
        axes[0, 0].bar(xs, [100 * r["waste_fraction"] for r in rows], width, label=variant, color=color)
        axes[0, 1].bar(xs, [r["max_resident"]["requests"] for r in rows], width, label=variant, color=color)
        axes[1, 0].bar(xs, [r["requests_per_step"] for r in rows], width, label=variant, color=color)
    for ax, title in zip(
        (axes[0, 0], axes[0, 1], axes[1, 0]),
        ("memory waste (% of held bytes)", f"max resident {report['args']['static_prompt']}-token requests", "requests completed per step"),
    ):
        ax.set_xticks(range(len(configs)), [configs_with_pool[c] for c in configs], fontsize=8)
        ax.set_title(title)
        ax.legend()
    for r, style in zip(main, ("-", "--") * len(configs)):
        steps = [s["step"] for s in r["samples"]]
        waste = [100 * s["waste_bytes"] / s["held_bytes"] if s["held_bytes"] else 0 for s in r["samples"]]
        axes[1, 1].plot(steps, waste, style, label=f"{r['config']} {r['variant']}", linewidth=1)
    axes[1, 1].set_xlabel("simulated step")
    axes[1, 1].set_title("waste over the trace (%)")
    axes[1, 1].legend(fontsize=7)
    fig.suptitle("Jenga vs uniform paging (allocator replay of a synthetic trace, no model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=1))
    (out_dir / f"{stem}.md").write_text(markdown_table(report))
    saved = json.loads(json_path.read_text())  # figures come from the JSON
    plot(saved, out_dir / f"{stem}.png")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small trace and pool (seconds)")
    parser.add_argument("--pool-gib", type=float, default=48.0)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--num-prefixes", type=int, default=6, help="shared system prompts / documents")
    parser.add_argument("--shared-fraction", type=float, default=0.8, help="requests that start with a shared prefix")
    parser.add_argument("--prefix-min", type=int, default=1024)
    parser.add_argument("--prefix-max", type=int, default=16384)
    parser.add_argument("--suffix-min", type=int, default=64)
    parser.add_argument("--suffix-max", type=int, default=4096)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=1024)
    parser.add_argument("--arrival-rate", type=float, default=1.0, help="requests per simulated step (Poisson); high enough that memory, not arrivals, limits the batch")
    parser.add_argument("--step-tokens", type=int, default=4096, help="tokens computed per step (prefill + decode)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk boundary; also the budgeted snapshot interval")
    parser.add_argument("--budget", type=int, default=2048, help="slots kept by the budgeted layers")
    parser.add_argument("--budget-pool-fraction", type=float, default=0.25, help="pool of the budgeted config, as a fraction of --pool-gib")
    parser.add_argument("--static-prompt", type=int, default=8192)
    parser.add_argument("--sample-every", type=int, default=32, help="steps between pool-usage samples (stats() walks every live page)")
    parser.add_argument("--max-steps", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", "--out-dir", dest="out_dir", type=Path, default=Path(default_out("serving")))
    parser.add_argument("--json", action="store_true", help="print the result JSON to stdout (tables go to stderr)")
    args = parser.parse_args(argv)
    if args.quick:
        args.pool_gib, args.num_requests, args.sample_every = 8.0, 40, 16
        args.prefix_max, args.suffix_max, args.output_max = 8192, 2048, 512
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run_all(args)
    stem = "bench_serving_quick" if args.quick else "bench_serving"
    write_outputs(report, args.out_dir, stem)
    table_stream = sys.stderr if args.json else sys.stdout
    print(markdown_table(report), file=table_stream)
    print(f"wrote {args.out_dir / stem}.{{json,md,png}}", file=table_stream)
    if args.json:
        print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
