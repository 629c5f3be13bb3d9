"""Cross-check kvjax's `kvzip` against kvpress 0.5.5's `KVzipPress` on the same random weights and tokenizer.

Runs in the kvpress venv of `eval/kvpress_crosscheck.py` (`--setup` makes it): the runner
(eval/_kvzip_runner.py) builds a tiny random Llama with a character tokenizer (no chat template, so
kvpress repeats the whole prompt, as kvjax does), records what `KVzipPress` keeps per (layer, kv head) and
its scores; kvjax loads the same directory and prefills the prompt under `kvzip`. Cases: the budget
pooled over all layers and heads (kvpress's default), over each layer's heads (`layerwise=True`), and the
prompt repeated in chunks of 128 (the later chunks' instruction, overlap and sinks). A difference counts as
a tie only when kvpress's scores of the two positions agree within `--tol` of the layer's largest score.

    python -m eval.kvzip_crosscheck [--length 512 --budget 128]
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

NUM_LAYERS = 3
CASES = {  # name -> (kvjax kvzip options beyond the budget, KVzipPress options)
    "pooled over layers and heads": ({"pool": "all"}, {"layerwise": False, "chunk_size": 2048}),
    "pooled per layer": ({"pool": "layer"}, {"layerwise": True, "chunk_size": 2048}),
    "chunks of 128": ({"pool": "all", "chunk": 128}, {"layerwise": False, "chunk_size": 128}),
}


def crosscheck(python: str, length: int = 512, budget: int = 128, seed: int = 0, tol: float = 1e-5) -> dict:
    """{case: compare(...)}: kvjax's kept positions against KVzipPress's, per (layer, kv head)."""
    import kvjax
    from kvjax.cache.compaction import kept_positions

    prompt = np.random.default_rng(seed).integers(0, 128, length).tolist()
    with tempfile.TemporaryDirectory() as model_dir:
        spec = {"model_dir": model_dir, "seed": seed, "prompt": prompt, "ratio": 1 - budget / length,
                "num_layers": NUM_LAYERS, "cases": {name: press for name, (_, press) in CASES.items()}}
        runner = os.path.join(os.path.dirname(__file__), "_kvzip_runner.py")
        result = subprocess.run([python, runner, json.dumps(spec)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"kvzip runner failed:\n{result.stderr[-4000:]}")
        pressed = json.loads(result.stdout)
        model = kvjax.load_model(model_dir)
        report = {}
        for name, (options, _) in CASES.items():
            policy = kvjax.make_policy("kvzip", token_budget=budget, **options)
            state, _ = kvjax.prefill(model, [prompt], policy=policy, chunk_size=128)
            ours = [[sorted(p.tolist()) for p in per_layer[0]] for per_layer in kept_positions(state)]
            report[name] = {**compare(ours, pressed[name]["kept"], pressed[name]["scores"], tol),
                            "kept_per_layer": [sum(map(len, layer)) for layer in ours],
                            "kvpress_kept_per_layer": [sum(map(len, layer)) for layer in pressed[name]["kept"]]}
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=os.path.join(VENV, "bin", "python"), help="the kvpress venv's python")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--tol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if not os.path.exists(args.python):
        raise SystemExit(f"no kvpress venv at {args.python}: python -m eval.kvpress_crosscheck --setup")
    report = crosscheck(args.python, args.length, args.budget, tol=args.tol)
    print(json.dumps(report, indent=2))
    if not all(r["agrees"] for r in report.values()):
        raise SystemExit("kvjax and kvpress keep different positions beyond score ties")


if __name__ == "__main__":
    main()
