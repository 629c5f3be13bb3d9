"""Saved states across placements on 4 simulated CPU devices: a state saved on one device and loaded onto a 2x2
mesh (sequences over "data", kv heads over "model"), and a state prefilled on that mesh, saved and loaded on one
device: the pages each head reads and the greedy answer, against the one-device run; `kvjax generate --state DIR
--mesh 2x2` too. Prints one JSON object (tests/test_saved_state.py asserts on it). XLA_FLAGS: set before jax starts.
"""

from __future__ import annotations

import os

import _simulated_devices

_simulated_devices.use(4)  # before anything makes jax's backend

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import distributed as dist  # noqa: E402
from kvjax.cli import main as cli  # noqa: E402
from kvjax.engine.saved_state import whole_state  # noqa: E402

PAGE = 8
rng = np.random.default_rng(48)
DOCS = [rng.integers(3, 120, 90).tolist(), rng.integers(3, 120, 70).tolist()]  # two sequences: one per data shard
QUESTION = [7, 19, 33, 5, 61]
NEW = 6
# Loki: Quest's pages and metadata plus a key sketch (codes per page, a basis per layer, sequence and head)
POLICY = ("loki", dict(token_budget=32, rank=8, dense_layers=1))


def pages_read(state) -> dict:
    """What each (layer, sequence, head) reads, in table order, of a state anywhere (merged on the host): keys,
    values, positions, min/max and sketch codes of its pages; -1 tables read as -1."""
    whole = whole_state(state)
    table = whole.page_table
    taken = np.maximum(table, 0)
    out = {"table_used": (table >= 0).tolist(), "lengths": whole.lengths.tolist()}
    for name in ("k_pages", "v_pages", "kmin", "kmax", "slot_pos"):
        out[name] = np.where((table >= 0).reshape(table.shape + (1,) * (getattr(whole, name).ndim - 1)),
                             getattr(whole, name)[taken], 0).tolist()
    out["sketch_codes"] = np.where((table >= 0)[..., None, None], whole.key_sketch.codes[taken], 0).tolist()
    out["sketch_params"] = [np.asarray(x).tolist() for x in jax.tree.leaves(whole.key_sketch.params)]
    return out


def main() -> None:
    model = kvjax.load_model("tiny")
    policy = kvjax.make_policy(POLICY[0], **POLICY[1])
    room = len(QUESTION) + NEW
    out = {"devices": len(jax.devices())}
    with tempfile.TemporaryDirectory() as work:
        one, on_mesh = os.path.join(work, "one"), os.path.join(work, "mesh")
        state, logits = kvjax.prefill(model, DOCS, policy, page_size=PAGE, max_new_tokens=room)
        kvjax.save_state(state, one, model=model, policy=policy, logits=logits, model_name="tiny")
        saved = kvjax.load_state(one, model)
        reference = pages_read(saved.state)
        out["reference"] = kvjax.generate_from_state(model, saved, QUESTION, NEW).tolist()

        # saved on one device, loaded onto the mesh
        mesh = dist.make_mesh(2, 2)
        placed, saved = dist.load_state_sharded(one, model, mesh=mesh)
        pool = saved.state.k_pages
        out.update(pool_devices=len(pool.sharding.device_set), pool_shard_shape=list(pool.addressable_shards[0].data.shape),
                   loaded_on_mesh_reads_the_same=pages_read(saved.state) == reference,
                   loaded_on_mesh=kvjax.generate_from_state(placed, saved, QUESTION, NEW).tolist())

        try:  # two sequences over four data shards: refused by name, before anything is placed
            dist.load_state_sharded(one, model, mesh=dist.make_mesh(4, 1))
            out["indivisible"] = "loaded"
        except ValueError as error:
            out["indivisible"] = str(error)

        # prefilled on the mesh, saved, loaded on one device
        # (the mesh's prefill rounds its float sums in another order, and a sketch basis may flip sign: what it
        # held is the reference for the round trip, the tokens are the one-device run's)
        state, logits, _ = dist.prefill_sharded(model, DOCS, policy, mesh=mesh, page_size=PAGE, max_new_tokens=room)
        held = pages_read(state)
        kvjax.save_state(state, on_mesh, model=model, policy=policy, logits=logits, model_name="tiny")
        saved = kvjax.load_state(on_mesh, model)
        out.update(saved_on_mesh_reads_the_same=pages_read(saved.state) == held,
                   saved_on_mesh=kvjax.generate_from_state(model, saved, QUESTION, NEW).tolist())

        # the command line: the question as text, on the mesh, against the Python API on one device
        question = "alpha 12 beta"
        ids = model.tokenizer(question, add_special_tokens=False)["input_ids"]
        out["cli_expected"] = [int(t) for t in kvjax.generate_from_state(model, kvjax.load_state(one, model), ids, NEW)[0]]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out["cli_code"] = cli(["generate", "--state", one, "--prompt", question, "--max-new-tokens", str(NEW),
                                   "--json", "--mesh", "2x2"])
        out["cli_mesh"] = json.loads(printed.getvalue())["token_ids"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
