"""The serving engine with the shipped tiny model's heads split over a 1x2 mesh of simulated CPU devices,
against the same engine on one device (full attention); then `kvjax serve --mesh 1x2` answering over
HTTP. Prints one JSON object (tests/test_multiprocess.py asserts on it). XLA_FLAGS must be set before jax
is imported.
"""

from __future__ import annotations

import os
import sys

import _simulated_devices

_simulated_devices.use(2)  # before anything makes jax's backend

import json  # noqa: E402
import urllib.request  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import distributed as dist  # noqa: E402
from kvjax.cli import build_parser, server_of  # noqa: E402
from kvjax.serving.batch_engine import BatchEngine  # noqa: E402
from kvjax.serving.http import serve_in_background  # noqa: E402

ENGINE = dict(max_rows=2, capacity=256, chunk_size=32, steps_per_dispatch=4)
# three full-attention requests for two rows (the third waits for a row to be released); the policies'
# own sharded paths (compaction, selection) are tested by the generation runs
REQUESTS = 3
HTTP_PROMPT = np.random.default_rng(1).integers(3, 124, size=37).tolist()  # the tiny model's vocabulary: 124


def serve_all(model, backend=None) -> dict:
    engine = BatchEngine(model, backend=backend, **ENGINE)
    rng = np.random.default_rng(0)
    for i in range(REQUESTS):
        prompt = rng.integers(3, model.cfg.vocab_size, size=40 + 7 * i).tolist()
        engine.submit(prompt, 6 + i, eos_token_id=[], request_id=f"r{i}")
    if backend is None:  # what the HTTP request below must answer
        engine.submit(HTTP_PROMPT, 8, request_id="http")
    done = engine.run()
    return {rid: request.tokens for rid, request in sorted(done.items())}, engine.leaked_pages


def main() -> None:
    model = kvjax.load_model("tiny")
    ref, _ = serve_all(model)
    sharded_model, backend = dist.on_mesh(model, dist.make_mesh(1, 2))
    out, leaked = serve_all(sharded_model, backend)
    pool = jax.tree.leaves(backend.new_state(model.cfg, 2, 64, 16, None, model.cache_dtype, False, None).k_pages)[0]

    args = build_parser().parse_args(["serve", "--mesh", "1x2", "--max-rows", "2", "--max-context", "256",
                                      "--chunk-size", "32", "--steps-per-dispatch", "4"])
    served_model, config = server_of(args)
    server = serve_in_background(served_model, config)
    try:
        body = json.dumps({"model": "tiny", "prompt": HTTP_PROMPT, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"{server.url}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.load(response)["choices"][0]["text"]
    finally:
        server.stop()
    expected_text = model.tokenizer.decode(ref.pop("http"), skip_special_tokens=True)
    print(json.dumps({
        "devices": len(jax.devices()), "ref": ref, "sharded": out, "leaked_pages": leaked,
        "pool_devices": len(pool.sharding.device_set), "pool_shard_shape": list(pool.addressable_shards[0].data.shape),
        "http_text": text, "expected_text": expected_text,
    }))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _multiprocess_runs import die_with_parent

    die_with_parent()
    main()
