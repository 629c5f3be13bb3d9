"""`kvjax demo`: retrieval at 2K tokens under several policies, on the shipped model or a real one.

By default it loads the shipped tiny model (no downloads) and runs its synthetic passkey and multi-key
tasks with Quest's protocol (question fed by decode after the context is compressed) under full
attention, Quest, the query-agnostic Quest control, SnapKV, Ada-SnapKV, H2O, StreamingLLM and KVzip at one
small budget, and prints the accuracy table with each policy's decode speed: a few minutes on 2 CPU cores
(less when JAX's compilation cache is warm). With `--model smollm2-135m` (after `kvjax fetch
smollm2-135m`) it runs real-text passkey and RULER's single needle instead, with full, Quest, SnapKV,
Ada-SnapKV, H2O, StreamingLLM and KVzip; `--model gemma3-270m` does the same on Gemma-3 270M, whose
sliding-window layers keep their window under every policy (the policies act on its global layers), KVzip
left out (its reconstruction pass does not run on sliding-window layers; the table says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .lib.policies import build_policy
from .lib.report import cpu_load, load_line, markdown_table

DEMO_POLICIES = ("full", "quest", "quest_static", "snapkv", "ada_snapkv", "h2o", "streaming", "kvzip")
REAL_POLICIES = ("full", "quest", "snapkv", "ada_snapkv", "h2o", "streaming", "kvzip")
# (tasks, policies, budget, samples, dense layers) per kind of model. The shipped model retrieves from
# layer 1 on (docs/default_model.md); on a real model every policy keeps Quest's paper default of 2 dense
# layers, and a 2K context at budget 256 (1/8) is where the methods part ways on SmolLM2-135M.
SETTINGS = {
    "tiny": (("passkey", "multikey"), DEMO_POLICIES, 128, 16, 1),
    "real": (("real_passkey", "niah_single"), REAL_POLICIES, 256, 8, 2),
}


def run_demo(model_name: str = "tiny", length: int = 2048, budget: int | None = None, samples: int | None = None,
             records: int = 4, policies=None, seed: int = 0, as_json: bool = False) -> dict:
    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache

    from .lib.sweep import run_sweep

    enable_compilation_cache()
    load_before = cpu_load()
    started = time.perf_counter()
    model = kvjax.load_model(model_name)
    tasks, default_policies, default_budget, default_samples, dense_layers = SETTINGS[
        "tiny" if model_name == "tiny" else "real"]
    skipped = {p: why for p in (policies or default_policies)
               if (why := cannot_run(model, build_policy(p, budget or default_budget, dense_layers)))}
    if policies and skipped:  # named: refused now, not after the other policies ran
        raise ValueError(f"{model_name}: {'; '.join(f'{p}: {why}' for p, why in skipped.items())}")
    policies = tuple(p for p in (policies or default_policies) if p not in skipped)
    result = run_sweep(model, policies, [budget or default_budget], [length], tasks,
                       samples or default_samples, records, seed, dense_layers=dense_layers,
                       progress=not as_json, clear_compiled=False)
    result["skipped_policies"] = skipped
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["model"] = model_name
    result["cpu_load_before"], result["cpu_load_after"] = load_before, cpu_load()
    result["command"] = " ".join(["kvjax", *sys.argv[1:]]) if sys.argv[0].endswith("kvjax") else None
    return result


def cannot_run(model, policy) -> str | None:
    """Why `policy` cannot run on `model`, or None: KVzip's reconstruction pass (a compressor's
    `scoring_pass`) does not run on sliding-window layers (Gemma-3's)."""
    compressor = policy.compressor
    if any(model.cfg.windows or ()) and compressor is not None and compressor.scoring_pass is not None:
        return "its reconstruction pass does not run on sliding-window layers"
    return None


TASK_TITLES = {"multikey": "multi-key", "real_passkey": "passkey (real text)", "niah_single": "RULER single needle"}


def demo_table(result: dict) -> str:
    budget, length = result["budgets"][0], result["lengths"][0]
    acc = {(r["task"], r["policy"]): r for r in result["accuracy"]}
    speed = {r["policy"]: r for r in result["latency"]}
    tasks = result["tasks"]
    rows = []
    for name in result["policies"]:
        s = speed.get(name)
        rows.append([name, "" if name == "full" else budget]
                    + [f"{100 * acc[(task, name)]['accuracy']:.0f}%" for task in tasks]
                    + [f"{s['decode_ms_per_step']:.1f}" if s else "", f"{s['decode_tokens_per_s']:.0f}" if s else ""])
    model = "shipped tiny model" if result["model"] == "tiny" else result["model"]
    records = f"multi-key with {result['num_records']} records; " if "multikey" in tasks else ""
    head = (f"kvjax demo: {model}, {length}-token prompts, {result['num_samples']} samples per task, {records}"
            f"question fed by decode after compression; layers >= {result['dense_layers']} compressed\n\n")
    batch = result["latency"][0]["batch"] if result["latency"] else 0
    table = markdown_table(["policy", "budget", *[TASK_TITLES.get(t, t) for t in tasks], f"decode ms/step (batch {batch})",
                            "decode tok/s"], rows)
    note = (f"\nTotal {result['seconds']:.0f} s on {result['machine'].get('cpu_model', result['machine']['processor'])}.\n")
    for name, why in result.get("skipped_policies", {}).items():
        note = f"\n{name} left out: {why}." + note
    if "quest_static" in result["policies"]:
        note = ("\nquest_static is the query-agnostic control: Quest's page score, but pages chosen once from the last "
                "context query, before the question." + note)
    return head + table + note


def render(result: dict) -> str:
    """`kvjax demo --json`'s result as the docs show it: the demo's own table, with the load it ran under."""
    return demo_table(result).strip() + f" {load_line(result)}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (shipped; default), a fetched name, or a local path")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=None, help="token budget (128 on the tiny model, 256 on a real one)")
    parser.add_argument("--samples", type=int, default=None, help="samples per task and policy (16 tiny, 8 real)")
    parser.add_argument("--records", type=int, default=4, help="records in the multi-key task")
    parser.add_argument("--policies", nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--corpus", default=None, metavar="DIR",
                        help="real-text tasks' text: a directory of .txt files or one file (default: $KVJAX_CORPUS, "
                             "else Debian's licence texts in /usr/share/common-licenses)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.corpus is not None:  # read by kvjax.tasks.real_text.load_corpus wherever a task is built
        os.environ["KVJAX_CORPUS"] = args.corpus
    result = run_demo(args.model, args.length, args.budget, args.samples, args.records, args.policies,
                      args.seed, args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(demo_table(result))
    return 0

