"""Cross-check kvjax's kvpress-compatible policies against kvpress 0.5.x on the same random weights.

kvpress pins transformers < 5.3, so it lives in its own venv (`.venv-kvpress`, made by `--setup`). The
runner (eval/_kvpress_runner.py) builds a tiny random Llama in that venv, saves it, and records what each
press keeps; kvjax loads the saved weights, prefills the same prompt with the matching policy, and the
kept positions per (layer, kv head) are compared. A difference counts as a tie only when kvpress's own
scores of the two positions agree within `--tol` (relative to the layer's largest score).

    python -m eval.kvpress_crosscheck --setup     # one command: make the venv if needed, run, report

Options that match kvpress (they differ from the papers' defaults; see docs/design.md):
  snapkv:     window 64, avg pooling with kernel 5, budget includes the window
  ada_snapkv: form="kvpress", alpha 0.2 (each head's top alpha * budget protected, then the layer's top)
  streaming:  4 sinks + the most recent; tova: the last query's head-averaged attention, last token kept
  pyramid:    SnapKV's options, beta 4; kvpress's PyramidKVPress given the beta that makes its layer budgets
              kvjax's (the two split a budget differently, below)
  h2o:        recent_size 0 (kvpress keeps no recent window)

Where the definitions differ, the check records kvpress's own press beside the matched one and expects a
difference (`DIFFERS`): kvpress's PyramidKVPress puts the window inside each layer's pyramid budget and, when
the last layer's budget is below the window (beta 20 at budget 128, window 64), falls back to SnapKV's uniform
budget, where kvjax follows PyramidKV's code (a pyramid over budget - window, the window added to every
layer); kvpress's ObservedAttentionPress (its H2O) averages each key's attention over the queries that see
it, where H2O sums it. `h2o_accumulated` is that press with the average undone (kvpress's own attention
weights, summed), which kvjax's H2O must match.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from .lib.crosscheck import VENV, compare

NUM_LAYERS = 2  # the runner's tiny Llama
SNAPKV = {"window": 64, "kernel_size": 5, "pooling": "avg"}
PAIRS = {  # kvpress press -> (kvjax policy, options beyond the budget)
    "snapkv": ("snapkv", SNAPKV),
    "streaming": ("streaming", {"sink_size": 4}),
    "tova": ("tova", {}),
    "adakv_snapkv": ("ada_snapkv", {**SNAPKV, "alpha": 0.2, "form": "kvpress"}),
    "pyramidkv": ("pyramid", {**SNAPKV, "beta": 4}),
    "h2o_accumulated": ("h2o", {"recent_size": 0}),
}
DIFFERS = {  # kvpress press -> (kvjax policy, options): definitions that differ (the docstring says how)
    "pyramidkv_beta20": ("pyramid", {**SNAPKV, "beta": 20}),
    "observed_attention": ("h2o", {"recent_size": 0}),
}


def kvpress_pyramid_beta(budget: int, window: int, beta: int) -> float:
    """The beta for which kvpress's PyramidKVPress keeps PyramidKV's per-layer counts on NUM_LAYERS (2) layers,
    written from PyramidKV's code (KVCache-Factory), not from kvjax: its last layer keeps (budget - window) //
    beta + window and its two layers sum to 2 * budget; kvpress's last layer keeps budget / beta, and its two
    layers sum to 2 * budget as well."""
    assert NUM_LAYERS == 2
    return budget / ((budget - window) // beta + window)


def setup_venv(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        # torch first, pinned to the CPU build, so kvpress's torch requirement installs nothing more
        subprocess.run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "kvpress==0.5.5"], check=True)
    return python


def run_kvpress(python: str, spec: dict) -> dict:
    runner = os.path.join(os.path.dirname(__file__), "_kvpress_runner.py")
    result = subprocess.run([python, runner, json.dumps(spec)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"kvpress runner failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout)


def most_kept(kept: list) -> list[int]:
    """Per layer, the most positions a kv head keeps (kept: [layer][head] -> positions)."""
    return [max(len(head) for head in layer) for layer in kept]


def crosscheck(python: str, length: int = 512, budget: int = 128, seed: int = 0, tol: float = 1e-5) -> dict:
    import kvjax
    from kvjax.cache.compaction import kept_positions

    prompt = np.random.default_rng(seed).integers(0, 128, length).tolist()
    with tempfile.TemporaryDirectory() as model_dir:
        spec = {"model_dir": model_dir, "seed": seed, "prompt": prompt, "ratio": 1 - budget / length,
                "window": 64, "kernel": 5, "alpha": 0.2, "num_layers": NUM_LAYERS,
                "pyramid_beta": kvpress_pyramid_beta(budget, SNAPKV["window"], PAIRS["pyramidkv"][1]["beta"])}
        pressed = run_kvpress(python, spec)
        model = kvjax.load_model(model_dir)
        report = {}
        for press, (name, options) in {**PAIRS, **DIFFERS}.items():
            policy = kvjax.make_policy(name, token_budget=budget, **options)
            state, _ = kvjax.prefill(model, [prompt], policy=policy, chunk_size=128)
            ours = [[sorted(p.tolist()) for p in per_layer[0]] for per_layer in kept_positions(state)]
            result = compare(ours, pressed[press]["kept"], pressed[press]["scores"], tol)
            report[press] = {"policy": name, **result, "expected": "differs" if press in DIFFERS else "agrees",
                             "kept_per_layer": most_kept(ours), "kvpress_kept_per_layer": most_kept(pressed[press]["kept"])}
    return report


def as_expected(result: dict) -> bool:
    return result["agrees"] == (result["expected"] == "agrees")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help=f"create {VENV} with kvpress if it is missing")
    parser.add_argument("--python", default=os.path.join(VENV, "bin", "python"), help="the kvpress venv's python")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--tol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    python = setup_venv(VENV) if args.setup else args.python
    if not os.path.exists(python):
        raise SystemExit(f"no kvpress venv at {python}: run with --setup")
    report = crosscheck(python, args.length, args.budget, tol=args.tol)
    print(json.dumps(report, indent=2))
    if not all(as_expected(r) for r in report.values()):
        raise SystemExit("kvjax and kvpress keep different positions beyond score ties, or a known difference vanished")


if __name__ == "__main__":
    main()
