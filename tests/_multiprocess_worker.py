"""One process of tests/test_multiprocess.py: joins JAX's multi-process runtime from the environment
`kvjax.distributed.launch` sets, generates on two meshes, and writes `OUT/process{i}.json`.

    python -m kvjax.distributed.launch -n 2 --cpu-devices 2 -- python tests/_multiprocess_worker.py OUT \
        inside=full,h2o spans=quest

Every process runs the same program (SPMD). First the processes split the policies between them and run
each on one device (their first) for reference. Nothing is asserted here; the test asserts on the JSON files.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402

from kvjax.distributed import initialize  # noqa: E402

initialize()
jax.devices()  # the backend starts here, with the launcher's device count
sys.path.insert(0, HERE)
import _sharding_worker as cases  # noqa: E402  (its XLA_FLAGS line comes after the backend started: no effect)

import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import distributed as dist  # noqa: E402

NEW_TOKENS = 4
MESHES = {  # the model axis inside each process (2 data x 2 model), and across both (1 x 4)
    "inside": lambda: dist.local_model_mesh(2, 2),
    "spans": lambda: dist.make_mesh(1, 4),
}


def reference(model, name: str) -> tuple[dict, list]:
    """Kept positions after prefill and the tokens of `name`'s policy on one device (this process's first)."""
    policy, rows = cases.policy(name, model.cfg), cases.prompts(4)
    with jax.default_device(jax.local_devices()[0]):
        state, _ = kvjax.prefill(model, rows, policy, chunk_size=16, max_new_tokens=NEW_TOKENS)
        tokens = np.asarray(kvjax.generate(model, rows, NEW_TOKENS, policy, chunk_size=16)).tolist()
    return cases.kept_by_head(state), tokens


def run_case(model, mesh_name: str, name: str, references: dict) -> dict:
    mesh = MESHES[mesh_name]()
    policy = cases.policy(name, model.cfg)
    rows = cases.prompts(4)
    state, _, plan = dist.prefill_sharded(model, rows, policy, mesh=mesh, chunk_size=16, max_new_tokens=NEW_TOKENS)
    kept = cases.kept_by_head(dist.to_host(state), (plan.data, plan.head_shards))
    tokens = dist.generate_sharded(model, rows, NEW_TOKENS, policy, mesh=mesh, chunk_size=16)
    out = {
        "mesh": mesh_name, "policy": name, "tokens": np.asarray(tokens).tolist(),
        "mesh_processes": [[d.process_index for d in row] for row in mesh.devices],
        "state_fully_addressable": bool(state.k_pages.is_fully_addressable),
    }
    if name in references:
        ref_kept, out["ref_tokens"] = references[name]
        out["kept_equal"] = ref_kept == kept
    return out


def main(out_dir: str, *meshes: str) -> None:
    model = cases.tiny_model()
    result = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
              "local_devices": jax.local_device_count(), "runs": []}
    todo = [(mesh_name, name) for item in meshes for mesh_name, names in [item.split("=")] for name in names.split(",")]
    # the references first, split between the processes (no collective yet, so neither waits on the other)
    names = list(dict.fromkeys(name for _, name in todo))
    references = {name: reference(model, name) for i, name in enumerate(names) if i % jax.process_count() == jax.process_index()}
    for mesh_name, name in todo:
        result["runs"].append(run_case(model, mesh_name, name, references))
    with open(os.path.join(out_dir, f"process{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
