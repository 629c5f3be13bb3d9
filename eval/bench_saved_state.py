"""A long document compressed once and asked a question later: answering from a saved state (`kvjax.load_state`
plus the question's decode) against prefilling the document again (`generate(..., decode_last=N)`).

For each policy the document (Quest's passkey in real text, `--tokens` long with its question) is prefilled,
compressed and saved once; then a fresh process answers the question both ways, each twice: the first call
compiles (cold; its programs written to an empty compilation cache, as `kvjax generate --state` does on its
first run), the second is what a warm process pays; then another fresh process answers once more, reading
that cache (cold, cached: a user's later runs). Saved: `load_state(once=True)` + `generate_from_state`, as
`kvjax generate --state` runs them (decode takes the loaded pool over). Model loading is timed apart. The
answers must be equal token for token. Sizes: the saved state's bytes on disk against the bytes of the
uncompressed float32 cache of the same tokens (2 * layers * kv heads * tokens * head_dim * 4).

    python -m eval.bench_saved_state --model smollm2-135m   # results/saved_state/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from .lib.report import LOAD_AT_START, cpu_load, default_out, machine_info, markdown_table, write_outputs
from .lib.report import load_line

POLICIES = {  # name -> (policy, options (BUDGET: a quarter of the document), page dtype)
    "quest": ("quest", {"token_budget": 1024}, None),
    "snapkv-int8": ("snapkv", {"token_budget": "BUDGET"}, "int8"),
}


def answer(args) -> dict:
    """The worker (a fresh process): time the question's answer from the saved state and from a prefill."""
    import kvjax
    from kvjax.util.compilation_cache import enable_compilation_cache

    enable_compilation_cache()  # $KVJAX_COMPILATION_CACHE: this run's own folder
    with open(os.path.join(args.work, "sample.json")) as f:
        sample = json.load(f)
    started = time.perf_counter()
    model = kvjax.load_model(args.model, kv_dtype=args.kv_dtype)
    model_s = time.perf_counter() - started
    out = {"model_load_s": model_s}
    question, new = sample["question_ids"], sample["max_new_tokens"]
    if args.worker == "saved":
        def run():
            saved = kvjax.load_state(args.state, model, once=True)
            out["load_s"].append(time.perf_counter() - start)
            return saved, kvjax.generate_from_state(model, saved, question, new)[0]
    else:
        from kvjax.engine.saved_state import policy_from_spec

        policy = policy_from_spec(kvjax.read_header(args.state)["policy"])  # the policy the state was saved under

        def run():
            return None, kvjax.generate(model, [sample["context_ids"] + question], new, policy,
                                        decode_last=len(question))[0]
    from kvjax.util.compile_count import count_compiles

    out["load_s"] = []  # the saved state's loads (of the calls' times)
    for name in ("cold", "warm")[: args.calls]:
        start = time.perf_counter()
        with count_compiles() as built:
            _, tokens = run()
        out[f"{name}_s"] = time.perf_counter() - start
        out[f"{name}_programs"] = dict(built.by_name)  # the programs this call built, by jitted function name
    out["tokens"] = [int(t) for t in tokens]
    print(json.dumps(out))
    return out


def in_fresh_process(args, worker: str, state: str, kv_dtype: str | None) -> dict:
    """The worker's cold and warm calls in a fresh process whose compilation cache starts empty, then one call
    in another reading that cache (`cold_cached_s`, `cached_tokens`)."""
    cache = os.path.join(args.work, f"cache-{os.path.basename(state)}-{worker}")
    shutil.rmtree(cache, ignore_errors=True)  # cold means compiling
    runs = []
    for calls in (2, 1):
        command = [sys.executable, "-m", "kvjax.eval.bench_saved_state", "--worker", worker, "--state", state, "--work",
                   args.work, "--model", args.model, "--calls", str(calls)] + (["--kv-dtype", kv_dtype] if kv_dtype else [])
        result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, KVJAX_COMPILATION_CACHE=cache))
        if result.returncode:
            raise SystemExit(f"worker {worker} failed: {result.stderr[-2000:]}")
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    first, cached = runs
    return {**first, "cold_cached_s": cached["cold_s"], "cold_cached_load_s": cached["load_s"],
            "cached_tokens": cached["tokens"]}


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def render(payload: dict) -> str:
    # runs before the cached column (and `load_state(once=True)`) render as they did
    cached = all("cold_cached_s" in run["saved"] for run in payload["runs"].values())
    rows = []
    for name, run in payload["runs"].items():
        saved, again = run["saved"], run["prefill"]
        rows.append([name, run["policy"]["name"], run["page_dtype"], f"{run['disk_bytes'] / 2**20:.1f}",
                     f"{run['disk_bytes'] / payload['full_float32_bytes']:.3f}",
                     f"{again['cold_s']:.1f} / {saved['cold_s']:.1f}", f"{again['cold_s'] / saved['cold_s']:.1f}x",
                     *([f"{again['cold_cached_s']:.1f} / {saved['cold_cached_s']:.2f}",
                        f"{again['cold_cached_s'] / saved['cold_cached_s']:.1f}x"] if cached else []),
                     f"{again['warm_s']:.2f} / {saved['warm_s']:.2f}", f"{again['warm_s'] / saved['warm_s']:.1f}x",
                     "yes" if run["answers_equal"] else "NO"])
    columns = ["state", "policy", "page dtype", "on disk MiB", "of full f32", "cold s: prefill / saved", "cold speed-up",
               *(["cold, cached s: prefill / saved", "cold, cached speed-up"] if cached else []),
               "warm s: prefill / saved", "warm speed-up", "answers equal"]
    how = ("`load_state(once=True)` + `generate_from_state` (as `kvjax generate --state` runs them); prefill: "
           "`generate(decode_last=...)`; cold = first call of a fresh process (compiles, filling an empty compilation "
           "cache), cold, cached = first call of another fresh process reading that cache (a user's later runs), "
           "warm = second call of the first" if cached else
           "`load_state` + `generate_from_state`; prefill: `generate(decode_last=...)`; cold = first call of a fresh "
           "process (compiles, no compilation cache), warm = second call")
    built = [f"{name}: {', '.join(f'{p} {n}' for p, n in sorted(run['saved']['cold_programs'].items()))}"
             for name, run in payload["runs"].items() if "cold_programs" in run["saved"]]
    programs = f" Programs the saved answer built cold: {'; '.join(built)}." if built else ""
    return (markdown_table(columns, rows)
            + f"\n{payload['model']}, a {payload['tokens']}-token passkey document and its question "
              f"({payload['question_tokens']} tokens, fed by decode), {payload['max_new_tokens']} new tokens, greedy; "
              f"the full float32 cache of those tokens: {payload['full_float32_bytes'] / 2**20:.0f} MiB. Saved: "
              f"{how}; model loading "
              f"({payload['model_load_s']:.1f} s) excluded.{programs} {payload['machine'].get('cpu_model', '')}, "
              f"{payload['machine']['cpu_count']} cores. "
              f"{load_line(payload)}\n")


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    whens = ("cold", "cold_cached", "warm") if all("cold_cached_s" in r["saved"] for r in payload["runs"].values()) \
        else ("cold", "warm")
    fig, axes = plt.subplots(1, len(whens), figsize=(4.5 * len(whens), 3.5))
    for ax, when in zip(axes, whens):
        names = list(payload["runs"])
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [payload["runs"][n]["prefill"][f"{when}_s"] for n in names], 0.4, label="prefill again")
        ax.bar([i + 0.2 for i in x], [payload["runs"][n]["saved"][f"{when}_s"] for n in names], 0.4, label="saved state")
        ax.set_xticks(list(x), names)
        ax.set_yscale("log")
        ax.set_ylabel("seconds to answer")
        ax.set_title(when.replace("_", ", "))
    axes[0].legend()
    fig.suptitle(f"{payload['model']}, {payload['tokens']} tokens (shared CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8176, help="document and question (8K less the answer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=default_out("saved_state"))
    parser.add_argument("--work", default=None, help="where the saved states go (default: OUT/states, not kept)")
    parser.add_argument("--worker", choices=["saved", "prefill"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--state", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kv-dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return answer(args)

    import kvjax
    from kvjax.tasks.needles import passkey_samples

    args.work = args.work or os.path.join(args.out, "states")
    os.makedirs(args.work, exist_ok=True)
    model = kvjax.load_model(args.model)
    sample = passkey_samples(model.tokenizer, args.tokens, 1, args.seed)[0]
    new = sample.max_new_tokens
    with open(os.path.join(args.work, "sample.json"), "w") as f:
        json.dump({"context_ids": sample.context_ids, "question_ids": sample.question_ids, "max_new_tokens": new}, f)
    cfg = model.cfg
    runs = {}
    for name, (policy_name, options, kv_dtype) in POLICIES.items():
        options = {k: len(sample.context_ids) // 4 if v == "BUDGET" else v for k, v in options.items()}
        policy = kvjax.make_policy(policy_name, **options)
        pages_model = model.with_kv_dtype(kv_dtype) if kv_dtype else model
        state_dir = os.path.join(args.work, name)
        start = time.perf_counter()
        state, logits = kvjax.prefill(pages_model, [sample.context_ids], policy,
                                      max_new_tokens=len(sample.question_ids) + new)
        kvjax.save_state(state, state_dir, model=pages_model, policy=policy, logits=logits, model_name=args.model)
        save_s = time.perf_counter() - start
        del state, logits
        saved = in_fresh_process(args, "saved", state_dir, kv_dtype)
        again = in_fresh_process(args, "prefill", state_dir, kv_dtype)
        header = kvjax.read_header(state_dir)
        runs[name] = {"policy": header["policy"], "page_dtype": header["page_dtype"], "pages": header["pages"],
                      "disk_bytes": disk_bytes(state_dir), "prefill_and_save_s": save_s, "saved": saved,
                      "prefill": again, "answers_equal": saved["tokens"] == again["tokens"]
                      == saved["cached_tokens"] == again["cached_tokens"],
                      "answer": model.tokenizer.decode([t for t in saved["tokens"] if t >= 0], skip_special_tokens=True)}
        print(name, {k: v for k, v in runs[name].items() if k not in ("saved", "prefill")}, file=sys.stderr)
    shutil.rmtree(args.work, ignore_errors=True)
    payload = {"benchmark": "bench_saved_state", "machine": machine_info(), "model": args.model,
               "tokens": len(sample.context_ids) + len(sample.question_ids), "question_tokens": len(sample.question_ids),
               "max_new_tokens": new, "expected_answer": sample.answer,
               "full_float32_bytes": 2 * cfg.num_layers * cfg.num_kv_heads * len(sample.context_ids) * cfg.head_dim * 4,
               "model_load_s": min(r["saved"]["model_load_s"] for r in runs.values()), "runs": runs,
               "cpu_load_before": LOAD_AT_START, "cpu_load_after": cpu_load()}
    table = render(payload)
    paths = write_outputs(args.out, "bench_saved_state", payload, table)
    plot(payload, paths["json"].replace(".json", ".png"))
    print(table)
    return payload


if __name__ == "__main__":
    main()
