"""Compile time of a first `kvjax.generate`, by program, against depth: does it stay flat as layers grow?

A random-weight model of SmolLM2-135M's width (hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab
49152, tied embeddings), float32, at several depths (default 4 and 30 layers, SmolLM2 has 30), under several
policies. For each (depth, policy) one `generate` of a 512-token prompt and 4 new tokens runs in a fresh
jit cache for its programs; JAX's compile events (trace, lowering to MLIR, XLA compile, by jitted function)
say how long each program took to build: the prefill step (`append_chunk`), the
compression step, the decode loop (`decode_steps`, which holds the decode step), and everything else. A second,
identical `generate` then runs from the cache (its wall time is the run without compiles). Last, two fresh
processes time a first `generate` of the deepest model with JAX's persistent compilation cache
(`kvjax.util.compilation_cache`) in an empty folder: the first compiles (cold), the second reads the cache (warm).

    python -m kvjax.eval.bench_compile            # writes ./kvjax-results/compile/bench_compile.{json,md,png}
    python -m kvjax.eval.bench_compile --quick    # 2 and 6 layers, two policies, a short prompt
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from .lib.report import cpu_load, default_out, machine_info, markdown_table, write_outputs
from .lib.timing import timed

STAGES = ("trace", "lower", "compile")
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
DEFAULT_POLICIES = ("full", "quest", "snapkv", "pyramid", "h2o")


class ProgramLog:
    """Programs built while recording, in order: (jitted function, trace s, lower s, compile s). A top-level
    program's trace and lowering events come before its backend compile, which closes the record; nested
    jits' traces are inside the outer trace's time and are not counted again."""

    def __init__(self):
        self.records: list[dict] = []
        self.recording = False
        self._pending: dict[str, dict] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        stage = _EVENTS.get(event)
        if not self.recording or stage is None:
            return
        name = str(kwargs.get("fun_name", "?"))
        name = name[4:-1] if name.startswith("jit(") else name
        pending = self._pending.setdefault(name, {s: 0.0 for s in STAGES})
        pending[stage] = duration if stage != "compile" else pending[stage] + duration
        if stage == "compile":
            self.records.append({"program": name, **self._pending.pop(name)})

    def take(self) -> list[dict]:
        records, self.records, self._pending = self.records, [], {}
        return records


def smollm2_config(layers: int):
    from kvjax.models.config import ModelConfig

    return ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=layers,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )


def summarize(records: list[dict]) -> dict:
    """Seconds per role: prefill (`append_chunk`; `append_step` in runs before the decode step had its own
    program, the first one), compress, decode (the on-device decode loop `decode_steps`, `append_token`, or
    an older run's second `append_step`), other."""
    out = {"prefill_s": 0.0, "compress_s": 0.0, "decode_s": 0.0, "other_s": 0.0, "programs": len(records)}
    appends = 0
    for r in records:
        seconds = sum(r[s] for s in STAGES)
        if r["program"] == "append_step":
            out["decode_s" if appends else "prefill_s"] += seconds
            appends += 1
        elif r["program"] == "append_chunk":
            out["prefill_s"] += seconds
        elif r["program"] in ("decode_steps", "append_token"):
            out["decode_s"] += seconds
        elif r["program"] == "compress_step":
            out["compress_s"] += seconds
        else:
            out["other_s"] += seconds
    out["first_generate_compile_s"] = out["prefill_s"] + out["compress_s"] + out["decode_s"]
    return out


def bench(layers: int, policies, prompt_len: int, new_tokens: int, log: ProgramLog) -> list[dict]:
    import kvjax

    cfg = smollm2_config(layers)
    model = kvjax.Model(cfg, kvjax.init_params(cfg, seed=0))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len)).astype(np.int32)
    rows = []
    for name in policies:
        policy = kvjax.make_policy(name)
        log.take()
        log.recording = True
        first = timed(lambda: kvjax.generate(model, prompt, new_tokens, policy))[1]
        log.recording = False
        records = log.take()
        second = timed(lambda: kvjax.generate(model, prompt, new_tokens, policy))[1]
        rows.append({"layers": layers, "policy": name, **summarize(records), "first_generate_s": first,
                     "second_generate_s": second, "records": records, "load_after": cpu_load()})
        print(f"{layers:>3} layers {name:>8}: prefill {rows[-1]['prefill_s']:.2f} s, compress "
              f"{rows[-1]['compress_s']:.2f} s, decode {rows[-1]['decode_s']:.2f} s", flush=True)
    return rows


_CACHE_RUN = """
import json, sys, time
from kvjax.util.compilation_cache import enable_compilation_cache
enable_compilation_cache()
import numpy as np
import kvjax
from kvjax.eval.bench_compile import smollm2_config
layers, prompt_len, new_tokens = (int(x) for x in sys.argv[1:4])
cfg = smollm2_config(layers)
model = kvjax.Model(cfg, kvjax.init_params(cfg, seed=0))
prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len)).astype(np.int32)
start = time.perf_counter()
kvjax.generate(model, prompt, new_tokens)
print(json.dumps({"first_generate_s": time.perf_counter() - start}))
"""


def persistent_cache_runs(layers: int, prompt_len: int, new_tokens: int) -> dict:
    """A first full-cache `generate` in two fresh processes sharing an empty persistent cache folder: the
    first compiles every program (cold), the second reads them from the cache (warm)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KVJAX_COMPILATION_CACHE": cache}
        argv = [sys.executable, "-c", _CACHE_RUN, str(layers), str(prompt_len), str(new_tokens)]
        runs = [json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.strip()
                           .splitlines()[-1]) for _ in range(2)]
    return {"layers": layers, "cold_first_generate_s": runs[0]["first_generate_s"],
            "warm_first_generate_s": runs[1]["first_generate_s"]}


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    depths = sorted({r["layers"] for r in rows})
    width = 0.8 / len(depths)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(policies))
    for i, depth in enumerate(depths):
        by = {r["policy"]: r for r in rows if r["layers"] == depth}
        bottom = np.zeros(len(policies))
        for role, hatch in (("prefill_s", ""), ("compress_s", ".."), ("decode_s", "//")):
            values = np.array([by[p][role] for p in policies])
            ax.bar(x + (i - (len(depths) - 1) / 2) * width, values, width, bottom=bottom, hatch=hatch,
                   color=f"C{i}", edgecolor="white", label=f"{depth} layers: {role[:-2]}")
            bottom += values
    ax.set_xticks(x, policies)
    ax.set_ylabel("compile seconds (trace + lower + XLA)")
    ax.set_title(f"first generate's programs, SmolLM2-135M width, prompt {payload['config']['prompt']}")
    ax.legend(fontsize=7, ncol=len(depths))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 30])
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (one prefill chunk at 512)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--out", default=default_out("compile"))
    parser.add_argument("--quick", action="store_true", help="2 and 6 layers, full and snapkv, a 64-token prompt")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.policies, args.prompt = [2, 6], ["full", "snapkv"], 64

    log = ProgramLog()
    load_before = cpu_load()
    results = []
    for layers in args.layers:
        results += bench(layers, args.policies, args.prompt, args.new_tokens, log)

    shallow, deep = min(args.layers), max(args.layers)
    cache_runs = persistent_cache_runs(deep, args.prompt, args.new_tokens)
    ratios = {}
    for name in args.policies:
        a = next(r for r in results if r["layers"] == shallow and r["policy"] == name)
        b = next(r for r in results if r["layers"] == deep and r["policy"] == name)
        ratios[name] = b["first_generate_compile_s"] / max(a["first_generate_compile_s"], 1e-9)
    payload = {
        "benchmark": "bench_compile",
        "machine": machine_info(),
        "load_before": load_before,
        "config": {"shape": "SmolLM2-135M width", "layers": args.layers, "policies": args.policies,
                   "prompt": args.prompt, "new_tokens": args.new_tokens, "dtype": "float32", "batch": 1},
        "results": results,
        "deep_over_shallow": ratios,
        "persistent_cache": cache_runs,
    }
    headers = ["layers", "policy", "prefill s", "compress s", "decode s", "prefill+compress+decode s", "other s",
               "first generate s", "second generate s"]
    rows = [[r["layers"], r["policy"], r["prefill_s"], r["compress_s"], r["decode_s"], r["first_generate_compile_s"],
             r["other_s"], r["first_generate_s"], r["second_generate_s"]] for r in results]
    table = markdown_table(headers, rows)
    ratio_line = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    note = (f"\nCompile seconds (trace + lowering + XLA compile) of the programs one first `generate` builds: "
            f"{args.prompt}-token prompt, {args.new_tokens} new tokens, random weights of SmolLM2-135M's width, "
            f"float32, {payload['machine'].get('cpu_model', '')}, {payload['machine']['cpu_count']} cores, load "
            f"{load_before} before the run. {deep} over {shallow} layers: {ratio_line}. A first full-cache generate of "
            f"{deep} layers in a fresh process: {cache_runs['cold_first_generate_s']:.1f} s with an empty persistent "
            f"cache, {cache_runs['warm_first_generate_s']:.1f} s reading it (model building excluded).\n")
    paths = write_outputs(args.out, "bench_compile", payload, table + note)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(table + note)
    return payload


if __name__ == "__main__":
    main()
