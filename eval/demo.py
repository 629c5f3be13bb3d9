"""`kvjax demo`: the shipped model on passkey and multi-key retrieval at 2K tokens under several policies.

Loads the shipped tiny model (no downloads), runs both tasks with Quest's protocol (question fed by
decode after the context is compressed) under full attention, Quest, the query-agnostic Quest control,
SnapKV, Ada-SnapKV, H2O and StreamingLLM at one small budget, and prints the accuracy table with each
policy's decode speed. About two minutes on 2 CPU cores (less when JAX's compilation cache is warm).
"""

from __future__ import annotations

import argparse
import json
import time

DEMO_POLICIES = ("full", "quest", "quest_static", "snapkv", "ada_snapkv", "h2o", "streaming")


def run_demo(model_name: str = "tiny", length: int = 2048, budget: int = 128, samples: int = 16,
             records: int = 4, policies=DEMO_POLICIES, seed: int = 0, as_json: bool = False) -> dict:
    import kvjax
    from kvjax.compilation_cache import enable_compilation_cache

    from . import sweep

    enable_compilation_cache()
    started = time.perf_counter()
    model = kvjax.load_model(model_name)
    result = sweep.run_sweep(model, policies, [budget], [length], ("passkey", "multikey"), samples, records, seed,
                             progress=not as_json, clear_compiled=False)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["model"] = model_name
    return result


def demo_table(result: dict) -> str:
    from ._report import markdown_table

    budget, length = result["budgets"][0], result["lengths"][0]
    acc = {(r["task"], r["policy"]): r for r in result["accuracy"]}
    speed = {r["policy"]: r for r in result["latency"]}
    rows = []
    for name in result["policies"]:
        p, m = acc[("passkey", name)], acc[("multikey", name)]
        s = speed.get(name)
        rows.append([name, "" if name == "full" else budget, f"{100 * p['accuracy']:.0f}%", f"{100 * m['accuracy']:.0f}%",
                     f"{s['decode_ms_per_step']:.1f}" if s else "", f"{s['decode_tokens_per_s']:.0f}" if s else ""])
    head = (f"kvjax demo: shipped tiny model, {length}-token prompts, {result['num_samples']} samples per task, "
            f"multi-key with {result['num_records']} records; question fed by decode after compression; "
            f"layers >= {result['dense_layers']} compressed\n\n")
    batch = result["latency"][0]["batch"] if result["latency"] else 0
    table = markdown_table(["policy", "budget", "passkey", "multi-key", f"decode ms/step (batch {batch})",
                            "decode tok/s"], rows)
    note = ("\nquest_static is the query-agnostic control: Quest's page score, but pages chosen once from the last "
            f"context query, before the question. Total {result['seconds']:.0f} s on "
            f"{result['machine'].get('cpu_model', result['machine']['processor'])}.\n")
    return head + table + note


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (shipped; default), a fetched name, or a local path")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--samples", type=int, default=16, help="samples per task and policy")
    parser.add_argument("--records", type=int, default=4, help="records in the multi-key task")
    parser.add_argument("--policies", nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = run_demo(args.model, args.length, args.budget, args.samples, args.records, tuple(args.policies or DEMO_POLICIES),
                      args.seed, args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(demo_table(result))
    return 0

