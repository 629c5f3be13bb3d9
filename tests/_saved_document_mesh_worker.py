"""Saved documents served on a mesh, on 2 simulated CPU devices: a state saved on one device joins a 1x2 serving
engine's batch (each head shard's pages on its own pool) and answers as the one-device engine does; then `kvjax
serve --mesh 1x2 --documents DIR` answers a `kv_state` request (argument `serve`); or `kvjax prefill --mesh 1x2
--save` against the one-device prefill (argument `prefill`); or a one-sequence state on a 2x1 mesh with padding
rows (argument `padded`). Prints one JSON object (tests/test_saved_documents_mesh.py
asserts on it). XLA_FLAGS: set before jax starts.
"""

from __future__ import annotations

import os
import sys

import _simulated_devices

_simulated_devices.use(2)  # before anything makes jax's backend

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import urllib.request  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import distributed as dist  # noqa: E402
from kvjax.cli import build_parser, server_of  # noqa: E402
from kvjax.cli import main as cli  # noqa: E402
from kvjax.engine.saved_state import held_rows  # noqa: E402
from kvjax.serving.batch_engine import BatchEngine  # noqa: E402
from kvjax.serving.http import serve_in_background  # noqa: E402
from kvjax.serving.saved_documents import SavedDocuments  # noqa: E402

PAGE = 8
DOC = np.random.default_rng(48).integers(3, 120, 90).tolist()
QUESTIONS = [[7, 19, 33, 5, 61], [44, 2, 90]]  # two rows of one batch, each from its own copy of the document
NEW = 6
POLICY = ("quest", dict(token_budget=32, dense_layers=1))  # pages, min/max metadata and decode-time selection
ENGINE = dict(max_rows=2, capacity=256, page_size=PAGE, chunk_size=32, steps_per_dispatch=4)


def answers(model, folder, backend=None) -> tuple[list, int, tuple]:
    """Every question answered from the saved document at once by one engine: tokens, leaked pages, loads."""
    engine = BatchEngine(model, backend=backend, **ENGINE)
    documents = SavedDocuments(folder, model, engine.cache, PAGE, engine.backend)
    ids = [documents.submit(engine, "doc", q, NEW, eos_token_id=[]) for q in QUESTIONS]
    done = engine.run()
    return [done[i].tokens for i in ids], engine.leaked_pages, (documents.stats.loads, documents.stats.lookups)


def keys_read(state) -> tuple[np.ndarray, np.ndarray]:
    """Which table entries a one-device state uses, and the keys each (layer, sequence, head) reads there."""
    table = np.asarray(state.page_table)
    keys = np.asarray(state.k_pages, np.float32)[np.maximum(table, 0)]
    return table >= 0, np.where((table >= 0).reshape(table.shape + (1,) * (keys.ndim - table.ndim)), keys, 0)


def prefill_on_mesh() -> dict:
    """The same document prefilled by `kvjax prefill` on one device and on a 1x2 mesh, each saved and loaded on
    one device: headers and greedy answers; and a 2x1 mesh refused by name."""
    folder = tempfile.mkdtemp(prefix="kvjax-prefill-")
    spec = f"{POLICY[0]}:" + ",".join(f"{k}={v}" for k, v in POLICY[1].items())
    common = ["prefill", "--prompt", "The secret code is blue seven. " * 6, "--policy", spec, "--page-size", str(PAGE),
              "--chunk-size", "32", "--room", "32", "--json"]
    out, model = {"devices": len(jax.devices())}, kvjax.load_model("tiny")
    for name, extra in (("one_device", []), ("mesh", ["--mesh", "1x2"])):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = cli(common + ["--save", os.path.join(folder, name)] + extra)
        saved = kvjax.load_state(os.path.join(folder, name), model)
        out[name] = {"code": code, "report": json.loads(printed.getvalue()), "batch": saved.header["batch"],
                     "answers": [[int(t) for t in kvjax.generate_from_state(model, saved, q, NEW)[0]] for q in QUESTIONS]}
    reads = [keys_read(kvjax.load_state(os.path.join(folder, name), model).state) for name in ("one_device", "mesh")]
    out["tables_equal"] = bool(np.array_equal(reads[0][0], reads[1][0]))
    out["keys_max_diff"] = float(np.abs(reads[0][1] - reads[1][1]).max())
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            cli(common + ["--save", os.path.join(folder, "refused"), "--mesh", "2x1"])
        except SystemExit as refused:
            out["refused"] = str(refused)
    out["refused_saved"] = os.path.exists(os.path.join(folder, "refused"))
    return out


def padded_on_mesh() -> dict:
    """A one-sequence state loaded onto a 2x1 mesh: refused, then padded (`pad_rows`): the greedy answer against
    one device's, and the rows the mesh holds."""
    model = kvjax.load_model("tiny")
    policy = kvjax.make_policy(POLICY[0], **POLICY[1])
    path = os.path.join(tempfile.mkdtemp(prefix="kvjax-padded-"), "doc")
    state, logits = kvjax.prefill(model, [DOC], policy, page_size=PAGE, max_new_tokens=32)
    kvjax.save_state(state, path, model=model, policy=policy, logits=logits, model_name="tiny")
    out = {"devices": len(jax.devices()),
           "one_device": kvjax.generate_from_state(model, kvjax.load_state(path, model), QUESTIONS[0], NEW).tolist()}
    try:
        dist.load_state_sharded(path, model, mesh=dist.make_mesh(2, 1))
    except ValueError as refused:
        out["refused"] = str(refused)
    mesh_model, saved = dist.load_state_sharded(path, model, mesh=dist.make_mesh(2, 1), pad_rows=True)
    out["held_rows"] = held_rows(saved)
    out["mesh"] = kvjax.generate_from_state(mesh_model, saved, QUESTIONS[0], NEW).tolist()
    return out


def serve_on_mesh() -> None:
    model = kvjax.load_model("tiny")
    policy = kvjax.make_policy(POLICY[0], **POLICY[1])
    folder = tempfile.mkdtemp(prefix="kvjax-documents-")
    state, logits = kvjax.prefill(model, [DOC], policy, page_size=PAGE, max_new_tokens=32)
    kvjax.save_state(state, os.path.join(folder, "doc"), model=model, policy=policy, logits=logits, model_name="tiny")
    saved = kvjax.load_state(os.path.join(folder, "doc"), model)
    out = {"devices": len(jax.devices()),
           "alone": [[int(t) for t in kvjax.generate_from_state(model, saved, q, NEW)[0]] for q in QUESTIONS]}
    out["one_device"], _, _ = answers(model, folder)
    sharded_model, backend = dist.on_mesh(model, dist.make_mesh(1, 2))
    out["mesh"], out["leaked_pages"], out["loads_lookups"] = answers(sharded_model, folder, backend)

    args = build_parser().parse_args(["serve", "--mesh", "1x2", "--max-rows", "2", "--max-context", "256",
                                      "--page-size", str(PAGE), "--chunk-size", "32", "--steps-per-dispatch", "4",
                                      "--documents", folder])
    served_model, config = server_of(args)
    server = serve_in_background(served_model, config)
    try:
        body = json.dumps({"model": "tiny", "prompt": QUESTIONS[0], "max_tokens": NEW, "temperature": 0,
                           "kv_state": "doc"}).encode()
        request = urllib.request.Request(f"{server.url}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            out["http_text"] = json.load(response)["choices"][0]["text"]
    finally:
        server.stop()
    first = [t for t in out["one_device"][0] if t not in model.eos_token_ids]
    out["expected_text"] = model.tokenizer.decode(first, skip_special_tokens=True)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _multiprocess_runs import die_with_parent

    die_with_parent()
    if sys.argv[1:] == ["prefill"]:
        print(json.dumps(prefill_on_mesh()))
    elif sys.argv[1:] == ["padded"]:
        print(json.dumps(padded_on_mesh()))
    else:  # serve
        serve_on_mesh()
