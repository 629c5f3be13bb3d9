"""The benchmark suite: the standard benchmarks on whatever backend JAX has, as one device-tagged run.

    kvjax bench suite --out runs/cpu [--quick] [--dtype bfloat16] [--threads 1] [--members attention prefill]
"""

# Members run in this process, one after the other, each by its own `main(argv)` writing under DIR/<member>/:
#   attention  eval.bench_attention: the kernels' bandwidth table (dense paged decode vs Quest per layer)
#   policies   eval.bench_policies: decode tokens/s per policy against the full cache
#   decode     eval.bench_decode: kvjax decode and prefill against transformers (needs torch; the torch side
#              always runs on the CPU)
#   prefill    this file: kvjax chunked prefill tokens/s on the policies' attention-heavy shape, at --dtype
#   real       eval.bench_decode --model smollm2-135m: SmolLM2-135M against transformers (needs torch and
#              `kvjax fetch smollm2-135m`)
#   dispatch   eval.bench_dispatch: decode tokens/s against decode steps per device call (1 = a host round
#              trip per token), tiny model and SmolLM2-135M when fetched, batch 1 and 8
# Then DIR/run.json holds the device tag, the large read measured once at the start, the members' status
# and a flat list of figures; DIR/run.md shows them. `kvjax bench compare` reads run.json files.
#
# Time of the default preset on 2 shared CPU cores (AMD EPYC), estimated from the committed results under
# results/: attention ~260 s (bench_attention.json wall_s), policies ~400 s (prefill + decode of ten
# policies at 8K: ~350 s, plus compiles), decode ~250 s (~155 s timed, plus building the 4-layer 1B-shape
# model twice), real ~180 s at one dtype (2K/4K/8K on a 135M model), prefill ~40 s, large read ~10 s:
# about 19 minutes, inside the 30-minute target with room for a loaded machine. --quick takes well under
# two minutes (all members) and is for smoke tests.
#
# --threads N limits the run to N cores: before JAX starts its CPU client the process pins itself to N
# cores (sched_setaffinity, which sizes XLA's thread pool; N=1 also turns Eigen's multi-threading off
# through XLA_FLAGS) and sets OMP_NUM_THREADS and torch.set_num_threads(N). When the JAX backend has
# already started in this process (a notebook, pytest), the suite reruns itself in a fresh process
# (`python -m kvjax.eval.suite ...`) and returns that run. On GPU and TPU it limits the host side only.

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable

from .lib.report import (RUN_KIND, cpu_load, others_cpu, default_out, device_tag, markdown_table, measure_large_read, share_of_large_read,
                      usable_cpus, write_outputs)
from .lib.setups import attention_heavy_config

RUN_VERSION = 1
REAL_MODEL = "smollm2-135m"
DTYPES = ("float32", "bfloat16")
BANDWIDTH_UNIT = "GB/s"


@dataclasses.dataclass(frozen=True)
class Settings:
    out: str
    quick: bool
    dtype: str
    threads: int
    read_gib: float  # the suite's large read; members that time their own read use the same size


@dataclasses.dataclass(frozen=True)
class Member:
    """One benchmark of the suite: the program it runs, what it needs, its argv per preset, its figures."""

    name: str
    module: str | None  # a program under kvjax.eval; None for the suite's own prefill measurement
    needs: tuple[str, ...]  # importable modules it cannot run without
    argv: Callable[[Settings, str], list[str]]  # (settings, member out dir) -> argv
    figures: Callable[[dict, dict], list[dict]]  # (member JSON, large read) -> figures
    json_name: str
    dtype_option: bool = False  # whether --dtype reaches the member


def figure(benchmark: str, name: str, value, unit: str, large_read: dict, note: str | None = None, **config) -> dict:
    """One figure of a run; bandwidth figures (GB/s) also as a share of the run's large read."""
    out = {"benchmark": benchmark, "name": name, "value": float(value), "unit": unit, "config": config}
    if unit == BANDWIDTH_UNIT:
        out["share_of_large_read"] = share_of_large_read(float(value), large_read)
    if note:
        out["note"] = note
    return out


# --- figures pulled from each member's JSON ---

def attention_figures(payload: dict, large_read: dict) -> list[dict]:
    figs = [figure("attention", "member_large_read_gbps", payload["large_read"]["median_gbps"], BANDWIDTH_UNIT,
                   large_read)]
    for row in payload["rows"]:
        where = {"model": row["model"], "context": row["context"]}
        dense = row["dense"]
        figs += [figure("attention", "dense_ms", dense["median_s"] * 1e3, "ms", large_read, **where),
                 figure("attention", "dense_gbps", dense["gbps"], BANDWIDTH_UNIT, large_read, **where),
                 figure("attention", "dense_share_of_interleaved_read", dense["of_large_read"], "share", large_read,
                        **where)]
        for q in row["quest"]:
            if q["formulation"] is not None:
                continue
            at = dict(where, budget=q["budget"], selection=q["selection"])
            figs += [figure("attention", "quest_ms", q["median_s"] * 1e3, "ms", large_read, **at),
                     figure("attention", "quest_gbps", q["gbps"], BANDWIDTH_UNIT, large_read, **at),
                     figure("attention", "quest_speedup_vs_dense", q["speedup_vs_dense"], "x", large_read, **at)]
    return figs


def policies_figures(payload: dict, large_read: dict) -> list[dict]:
    figs = []
    for r in payload["results"]:
        at = {"context": r["context"], "policy": r["policy"], "budget": payload["budget"],
              "kv_dtype": r.get("kv_dtype", "float32")}
        figs.append(figure("policies", "decode_tokens_per_s", r["decode_tokens_per_s"], "tok/s", large_read, **at))
        if r["speedup_vs_full"] is not None:
            figs.append(figure("policies", "speedup_vs_full", r["speedup_vs_full"], "x", large_read, **at))
        figs.append(figure("policies", "kv_read_gbps", r["kv_read_gbps"], BANDWIDTH_UNIT, large_read, **at))
    return figs


def _against_transformers(benchmark: str, rows: list[dict], large_read: dict, platform: str, **fixed) -> list[dict]:
    """Figures of a kvjax-vs-transformers program (bench_decode, its --model run): decode, prefill, bandwidth."""
    note = None if platform == "cpu" else f"transformers ran on the CPU, kvjax on {platform}"
    figs = []
    for r in rows:
        at = dict(fixed, context=r["context"])
        ours, theirs = r["kvjax"], r["transformers"]
        for side, res in (("kvjax", ours), ("transformers", theirs)):
            figs += [figure(benchmark, f"{side}_decode_tokens_per_s", res["decode_tokens_per_s"], "tok/s", large_read, **at),
                     figure(benchmark, f"{side}_decode_gbps", res["achieved_gbps"], BANDWIDTH_UNIT, large_read, **at),
                     figure(benchmark, f"{side}_prefill_tokens_per_s", r.get("batch", 1) * r["context"] / res["prefill_s"], "tok/s",
                            large_read, **at)]
        figs += [figure(benchmark, "decode_speedup", ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], "x",
                        large_read, note, **at),
                 figure(benchmark, "prefill_speedup", theirs["prefill_s"] / ours["prefill_s"], "x", large_read, note, **at),
                 figure(benchmark, "kvjax_compile_s", ours["prefill_compile_s"] + ours["decode_compile_s"], "s",
                        large_read, **at)]
    return figs


def decode_figures(payload: dict, large_read: dict) -> list[dict]:
    figs = []
    for (width, batch) in dict.fromkeys((r["width"], r["batch"]) for r in payload["results"]):
        rows = [r for r in payload["results"] if r["width"] == width and r["batch"] == batch]
        figs += _against_transformers("decode", rows, large_read, payload["machine"]["jax_backend"], width=width,
                                      batch=batch)
    return figs


def real_figures(payload: dict, large_read: dict) -> list[dict]:
    return _against_transformers("real", payload["results"], large_read, payload["machine"]["jax_backend"],
                                 model=payload["model"])


def prefill_figures(payload: dict, large_read: dict) -> list[dict]:
    figs = []
    for r in payload["results"]:
        at = {"context": r["context"], "shape": payload["shape"], "chunk_size": payload["chunk_size"]}
        figs += [figure("prefill", "prefill_tokens_per_s", r["prefill_tokens_per_s"], "tok/s", large_read, **at),
                 figure("prefill", "compile_s", r["compile_s"], "s", large_read, **at)]
    return figs


def dispatch_figures(payload: dict, large_read: dict) -> list[dict]:
    figs = []
    for r in payload["rows"]:
        at = {"model": r["model"], "batch": r["batch"], "steps_per_dispatch": r["steps_per_dispatch"]}
        figs.append(figure("dispatch", "decode_tokens_per_s", r["tokens_per_s"], "tok/s", large_read, **at))
        if r["speedup_vs_1"] is not None:
            figs.append(figure("dispatch", "speedup_vs_1_step", r["speedup_vs_1"], "x", large_read, **at))
    return figs


# --- the suite's own member: chunked prefill, no torch needed ---

PREFILL_SHAPE = "2 layers x 16 heads x 128, hidden 512"  # bench_policies' attention-heavy config


def run_prefill(argv: list[str]) -> dict:
    """kvjax.prefill (full cache) tokens/s per context on bench_policies' attention-heavy shape: the first
    call (compile included) and the median of `--repeats` calls after it."""
    parser = argparse.ArgumentParser(prog="suite prefill")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    import kvjax
    from kvjax.models.loading import resolve_dtype

    vocab = 4096
    cfg = kvjax.ModelConfig.from_hf_dict(attention_heavy_config(vocab))
    model = kvjax.Model(cfg, kvjax.init_params(cfg, seed=0, dtype=args.dtype), dtype=resolve_dtype(args.dtype))
    results = []
    for context in args.contexts:
        prompt = np.random.default_rng(context).integers(0, vocab, (1, context)).astype(np.int32)
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            _, logits = kvjax.prefill(model, prompt, chunk_size=args.chunk_size, max_new_tokens=1)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - start)
        median = statistics.median(times[1:])
        results.append({"context": context, "first_call_s": times[0], "prefill_s": median,
                        "compile_s": max(0.0, times[0] - median), "prefill_tokens_per_s": context / median})
    payload = {"benchmark": "suite_prefill", "shape": PREFILL_SHAPE, "dtype": args.dtype,
               "chunk_size": args.chunk_size, "repeats": args.repeats, "results": results}
    table = markdown_table(["context", "prefill tok/s", "prefill s (median)", "first call s", "compile s (first - median)"],
                           [[r["context"], r["prefill_tokens_per_s"], r["prefill_s"], r["first_call_s"], r["compile_s"]]
                            for r in results])
    write_outputs(args.out, "prefill", payload, table + f"\n{PREFILL_SHAPE}, {args.dtype}, chunk {args.chunk_size}.\n")
    return payload


# --- the members and their presets ---

def _attention_argv(s: Settings, out: str) -> list[str]:
    quick = ["--models", "llama3-8b", "--contexts", "1024", "--budgets", "256", "--repeats", "3",
             "--working-set-gib", "0.02"]
    return (quick if s.quick else []) + ["--large-read-gib", f"{s.read_gib:g}", "--out", out]


def _policies_argv(s: Settings, out: str) -> list[str]:
    quick = ["--contexts", "512", "--budget", "128", "--steps", "2", "--policies", "full", "quest", "snapkv", "streaming"]
    return (quick if s.quick else []) + ["--out", out]


def _decode_argv(s: Settings, out: str) -> list[str]:
    # bench_decode's --quick sets its own read size (0.25 GiB, the suite's quick default)
    return (["--quick"] if s.quick else ["--read-gib", f"{s.read_gib:g}"]) + ["--out", out]


def _prefill_argv(s: Settings, out: str) -> list[str]:
    quick = ["--contexts", "256", "--repeats", "2"]
    return (quick if s.quick else []) + ["--dtype", s.dtype, "--out", out]


def _real_argv(s: Settings, out: str) -> list[str]:
    # not bench_decode --model's --quick: that one forces float32
    quick = ["--contexts", "256", "512", "--steps", "3"]
    return ["--model", REAL_MODEL, *(quick if s.quick else []), "--dtypes", s.dtype, "--threads", str(s.threads),
            "--read-gib", f"{s.read_gib:g}", "--out", out]


def _dispatch_argv(s: Settings, out: str) -> list[str]:
    return (["--quick"] if s.quick else []) + ["--out", out]


MEMBERS = {m.name: m for m in (
    Member("attention", "kvjax.eval.bench_attention", (), _attention_argv, attention_figures, "bench_attention"),
    Member("policies", "kvjax.eval.bench_policies", (), _policies_argv, policies_figures, "bench_policies"),
    Member("decode", "kvjax.eval.bench_decode", ("torch", "transformers"), _decode_argv, decode_figures,
           "bench_decode"),
    Member("prefill", None, (), _prefill_argv, prefill_figures, "prefill", dtype_option=True),
    Member("real", "kvjax.eval.bench_decode", ("torch", "transformers"), _real_argv, real_figures, "bench_real",
           dtype_option=True),
    Member("dispatch", "kvjax.eval.bench_dispatch", (), _dispatch_argv, dispatch_figures, "bench_dispatch"),
)}


def unavailable(member: Member) -> str | None:
    """Why `member` cannot run here, or None."""
    for module in member.needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    if member.module is not None and importlib.util.find_spec(member.module) is None:
        return f"{member.module} does not exist in this checkout"
    if member.name == "real":
        from kvjax.models import hub

        if hub.cached_path(REAL_MODEL) is None:
            return f"{REAL_MODEL} is not fetched (kvjax fetch {REAL_MODEL})"
    return None


def run_member(member: Member, settings: Settings, large_read: dict) -> tuple[dict, list[dict]]:
    """Run one member; returns its status entry and its figures (none when it was skipped or failed)."""
    out = os.path.join(settings.out, member.name)
    argv = member.argv(settings, out)
    entry = {"status": "skipped", "argv": argv, "out": out,
             "dtype": settings.dtype if member.dtype_option else "float32 (the member has no dtype option)"}
    reason = unavailable(member)
    if reason is not None:
        return dict(entry, reason=reason), []
    if "torch" in member.needs:
        import torch

        torch.set_num_threads(settings.threads)
    start = time.perf_counter()
    try:
        result = run_prefill(argv) if member.module is None else importlib.import_module(member.module).main(argv)
        path = os.path.join(out, member.json_name + ".json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        figures = member.figures(result, large_read)
    except (Exception, SystemExit) as error:  # a member's failure is recorded; the suite goes on
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "error.txt"), "w") as f:
            f.write(traceback.format_exc())
        reason = f"{type(error).__name__}: {error}"
        return dict(entry, status="failed", reason=reason, wall_s=time.perf_counter() - start), []
    return dict(entry, status="ok", wall_s=time.perf_counter() - start, figures=len(figures)), figures


# --- threads ---

def _backend_started() -> bool:
    """Whether JAX has started a backend in this process (then thread settings come too late)."""
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without this internal: assume started, run afresh
        return True


def pin_threads(threads: int) -> None:
    """Limit this process to `threads` cores before JAX's CPU client starts (see the notes at the top)."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"--threads {threads}: this OS cannot pin a process to cores; run under taskset or its like")
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cpus):
        raise ValueError(f"--threads {threads}: this process may use 1 to {len(cpus)} cores")
    os.sched_setaffinity(0, cpus[:threads])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if threads == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()


def rerun_in_fresh_process(argv: list[str], out: str) -> dict:
    """Run the suite again in a new interpreter (so --threads can act before JAX starts); its run.json."""
    done = subprocess.run([sys.executable, "-m", "kvjax.eval.suite", *argv])
    if done.returncode != 0:
        raise RuntimeError(f"the suite in a fresh process (for --threads) exited with {done.returncode}")
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)


# --- the run ---

def write_run_markdown(run: dict, path: str) -> None:
    tag, read = run["device"], run["large_read"]
    lines = [f"# Suite run: {run['label']}", ""]
    if run.get("note"):
        lines += [f"Note: {run['note']}", ""]
    lines += [f"{tag['device_kind']} x{tag['device_count']} ({tag['platform']}), jax {tag['jax']} / jaxlib "
              f"{tag['jaxlib']}, CPU {tag['cpu_model']}, {tag['threads']} threads, dtype {tag['dtype']}; preset "
              f"{run['settings']['preset']}; large read {read['median_gbps']:.1f} GB/s (jnp.sum over "
              f"{read['bytes'] / 2**30:.2f} GiB); load average {run['load']['start']} -> {run['load']['end']}; "
              f"{run['wall_s']:.0f} s.", "",
              markdown_table(["member", "status", "wall s", "figures", "reason"],
                             [[name, m["status"], round(m.get("wall_s", 0.0), 1), m.get("figures", 0),
                               m.get("reason", "")] for name, m in run["members"].items()]),
              markdown_table(["benchmark", "figure", "config", "value", "unit", "share of large read"],
                             [[f["benchmark"], f["name"], ", ".join(f"{k}={v}" for k, v in f["config"].items()),
                               f["value"], f["unit"],
                               "" if f.get("share_of_large_read") is None else f"{f['share_of_large_read']:.1%}"]
                              for f in run["figures"]])]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvjax bench suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out("suite"), help="the run's folder: run.{json,md}, one folder per member")
    parser.add_argument("--members", nargs="+", default=list(MEMBERS), choices=list(MEMBERS))
    parser.add_argument("--quick", action="store_true", help="small shapes: seconds per member, for smoke tests")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="KV pages and weights of the members that take one (prefill, real)")
    parser.add_argument("--threads", type=int, default=None, help="cores for the run (default: all this process may use)")
    parser.add_argument("--read-gib", type=float, default=None,
                        help="size of the large read (default 2 GiB, 0.25 with --quick)")
    parser.add_argument("--label", default=None, help="the run's name in comparisons")
    parser.add_argument("--note", default=None, help="free text kept with the run (e.g. 'taken under load')")
    args = parser.parse_args(argv)

    if args.threads is not None and args.threads != usable_cpus():
        if _backend_started():
            return rerun_in_fresh_process(argv, args.out)
        pin_threads(args.threads)
    threads = usable_cpus()

    from tqdm import tqdm

    read_gib = args.read_gib if args.read_gib is not None else (0.25 if args.quick else 2.0)
    settings = Settings(out=args.out, quick=args.quick, dtype=args.dtype, threads=threads, read_gib=read_gib)
    started, load_start = time.perf_counter(), cpu_load()
    tag = device_tag(args.dtype, threads)
    large_read = measure_large_read(int(read_gib * 2**30))
    if tag["llc_bytes"]:
        large_read["over_llc"] = large_read["bytes"] / tag["llc_bytes"]
    print(f"large read: {large_read['median_gbps']:.1f} GB/s over {read_gib:g} GiB on {tag['device_kind']}", flush=True)

    members, figures = {}, []
    progress = tqdm(args.members, desc="suite")
    for name in progress:
        progress.set_postfix_str(name)
        entry, member_figures = run_member(MEMBERS[name], settings, large_read)
        members[name] = entry
        figures += member_figures
        if entry["status"] != "ok":
            tqdm.write(f"suite: {name} {entry['status']}: {entry['reason']}")

    run = {
        "kind": RUN_KIND, "version": RUN_VERSION,
        "label": args.label or f"{tag['device_kind']} x{tag['device_count']} {args.dtype} {threads}t",
        "note": args.note, "device": tag,
        "settings": {"preset": "quick" if args.quick else "default", "dtype": args.dtype, "threads": threads,
                     "members": args.members, "read_gib": read_gib, "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "large_read": large_read, "load": {"start": load_start, "end": cpu_load()}, "others_cpu": others_cpu(),
        "wall_s": time.perf_counter() - started, "members": members, "figures": figures,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(run, f, indent=1)
    write_run_markdown(run, os.path.join(args.out, "run.md"))
    print(f"wrote {args.out}/run.{{json,md}}: {len(figures)} figures, "
          + ", ".join(f"{n} {m['status']}" for n, m in members.items()))
    return run


if __name__ == "__main__":
    main()
