"""Runs sharded-vs-single-device checks on 8 simulated CPU devices and prints one JSON object.

XLA_FLAGS must be set before jax is imported, so tests/test_sharding.py runs this file in a subprocess:
    python tests/_sharding_worker.py --generate 1x8:tova,2x4:ada_snapkv --train 8x1 --indivisible
Nothing is asserted here; the test asserts on the JSON.
"""

from __future__ import annotations

import _simulated_devices

_simulated_devices.use(8)  # before anything makes jax's backend

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import distributed as dist  # noqa: E402
from kvjax.cache.compaction import kept_positions  # noqa: E402
from kvjax.models.config import ModelConfig  # noqa: E402
from kvjax.util.compile_count import count_compiles  # noqa: E402
from kvjax.models.loading import Model, init_params  # noqa: E402

VOCAB = 97
NEW_TOKENS = 6


def tiny_model(num_heads=16, num_kv_heads=8, seed=0) -> Model:
    """2 layers, hidden 64, head_dim 8, GQA group 2; weights wide enough that greedy choices are clear."""
    cfg = ModelConfig(
        model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8, max_position_embeddings=512,
    )
    return Model(cfg, init_params(cfg, seed=seed, std=0.1))


def prompts(batch=4, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [40, 29, 47, 21, 35, 44, 26, 38][:batch]
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


def policy(name: str, cfg: ModelConfig):
    budget = {"token_budget": 24}
    if name == "full":
        return kvjax.make_policy("full")
    if name == "quest":
        return kvjax.make_policy("quest", token_budget=32, dense_layers=1)
    if name in ("snapkv", "ada_snapkv", "pyramid", "ada_pyramid"):
        return kvjax.make_policy(name, window=4, kernel_size=3, **budget)
    if name == "locret":
        from kvjax.locret import HeadsConfig, init_heads

        heads = init_heads(HeadsConfig.for_model(cfg, hidden_size=16), seed=1)
        return kvjax.make_policy("locret", token_budget=24, stabilizers=4, local_tail=4, heads=heads)
    if name == "compose":
        return kvjax.make_policy(
            "compose", evict=policy("snapkv", cfg), select=kvjax.make_policy("quest", token_budget=32, dense_layers=1)
        )
    if name in ("loki", "key_int4"):  # selecting in layer 1: each shard fits its own heads' sketch
        return kvjax.make_policy(name, token_budget=32, dense_layers=1)
    return kvjax.make_policy(name, **budget)


def mesh_of(text: str):
    data, model = (int(x) for x in text.split("x"))
    return dist.make_mesh(data, model)


def kept_by_head(state, shards=None):
    """{(layer, b, h): kept original positions} of a plain state, or of a stacked one (global b, h)."""
    if shards is None:
        kept = kept_positions(state)
        return {(l, b, h): p.tolist() for l, lb in enumerate(kept) for b, bh in enumerate(lb) for h, p in enumerate(bh)}
    out = {}
    Sd, Sm = shards
    for d in range(Sd):
        for m in range(Sm):
            local = kept_positions(dist.shard_of(state, d, m))
            for l, lb in enumerate(local):
                for b, bh in enumerate(lb):
                    for h, p in enumerate(bh):
                        out[(l, d * len(lb) + b, m * len(bh) + h)] = p.tolist()
    return out


def check_generate(model: Model, mesh_name: str, name: str, on_indivisible="error", pol=None, rows=None) -> dict:
    mesh = mesh_of(mesh_name)
    pol = policy(name, model.cfg) if pol is None else pol
    rows = prompts(len(mesh.devices.flat) if mesh_name == "8x1" else 4) if rows is None else rows
    # the state after prefill: same kept positions per (layer, sequence, head), pages resident per shard.
    # Run first, so the generations below build only their decode programs.
    ref_state, ref_logits = kvjax.prefill(model, rows, pol, chunk_size=16, max_new_tokens=NEW_TOKENS)
    state, logits, plan = dist.prefill_sharded(
        model, rows, pol, mesh=mesh, chunk_size=16, max_new_tokens=NEW_TOKENS, on_indivisible=on_indivisible
    )
    start = time.time()
    ref = kvjax.generate(model, rows, NEW_TOKENS, pol, chunk_size=16)
    ref_seconds = time.time() - start
    start = time.time()
    with count_compiles() as compiles:
        out = dist.generate_sharded(model, rows, NEW_TOKENS, pol, mesh=mesh, chunk_size=16, on_indivisible=on_indivisible)
    seconds = time.time() - start
    decode_traces = compiles.of("decode_steps")  # the on-device decode loop, which holds the sharded decode step
    shards = {tuple(s.data.shape) for s in state.k_pages.addressable_shards}
    devices = {s.device for s in state.k_pages.addressable_shards}
    return {
        "mesh": mesh_name, "policy": name, "heads_sharded": plan.heads, "mlp_sharded": plan.mlp,
        "tokens_equal": bool(np.array_equal(ref, out)), "ref": ref.tolist(), "sharded": out.tolist(),
        "kept_equal": kept_by_head(ref_state) == kept_by_head(state, (plan.data, plan.head_shards)),
        "logits_max_diff": float(np.max(np.abs(np.asarray(ref_logits) - np.asarray(logits)[: len(rows)]))),
        "kv_dtype": str(np.dtype(model.cache_dtype)),
        "pool_pages_single": int(ref_state.num_pages),
        "pool_pages_per_device": [list(s) for s in shards],
        "pool_devices": len(devices),
        "decode_traces": decode_traces,  # the decode loop compiled once for all NEW_TOKENS - 1 steps
        "ref_seconds": ref_seconds, "sharded_seconds": seconds,
    }


def check_matrix(model: Model, mesh_name: str, case_ids: list[str]) -> list[dict]:
    """Every case of the policy matrix (tests/policy_cases.py), or those of `case_ids` when given, on a ragged
    batch of two, sharded against one device, as `check_generate` compares them."""
    from policy_cases import matrix_cases

    out = []
    for case in matrix_cases(model.cfg, page_size=16):
        if case_ids and case.id not in case_ids:
            continue
        try:
            out.append(check_generate(model, mesh_name, case.id, pol=case.policy, rows=prompts(2)))
        except Exception as error:  # one failing case must not hide the others
            out.append({"mesh": mesh_name, "policy": case.id, "error": f"{type(error).__name__}: {error}"})
    return out


def check_indivisible() -> dict:
    """8 query / 4 kv heads on a model axis of 8: the default raises; 'replicate' keeps heads whole."""
    model = tiny_model(num_heads=8, num_kv_heads=4, seed=3)
    try:
        dist.generate_sharded(model, prompts(), NEW_TOKENS, mesh=mesh_of("1x8"))
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error}


def locret_batch(n: int, seed: int = 0):
    from kvjax.locret import Batch

    rng = np.random.default_rng(seed)
    Tp, A = 32, 8
    prefix_len = rng.integers(12, Tp + 1, size=n).astype(np.int32)
    answer_len = rng.integers(2, A + 1, size=n).astype(np.int32)
    return Batch(
        prefix=rng.integers(0, VOCAB, size=(n, Tp)).astype(np.int32), prefix_len=prefix_len,
        answer=rng.integers(0, VOCAB, size=(n, A)).astype(np.int32), answer_len=answer_len,
    )


def check_train(model: Model, mesh_name: str) -> dict:
    """Locret's loss on 8 sequences: data-parallel over the mesh vs one device accumulating the same
    microbatches (8 / data sequences each); then one AdamW step on each."""
    from kvjax.locret import HeadsConfig, init_heads
    from kvjax.locret.training import loss_fn, make_optimizer

    mesh = mesh_of(mesh_name)
    data = mesh.shape["data"]
    heads = init_heads(HeadsConfig.for_model(model.cfg, hidden_size=16), seed=2).params
    batch = locret_batch(8)
    loss = functools.partial(loss_fn, cfg=model.cfg, dtype=jnp.float32, chunk_size=16)
    optimizer = make_optimizer(learning_rate=1e-2, total_steps=10, warmup_steps=0)

    ref_loss, ref_grads = dist.accumulated_value_and_grad(loss, heads, model.params, batch, data)
    ref_params = jax.tree.map(np.asarray, heads)
    updates, _ = optimizer.update(ref_grads, optimizer.init(heads), heads)
    ref_updated = jax.tree.map(np.asarray, jax.tree.map(jnp.add, heads, updates))

    dp_loss, dp_grads = jax.jit(dist.data_parallel_value_and_grad(loss, mesh))(
        dist.replicate(heads, mesh), dist.replicate(model.params, mesh), dist.place_batch(batch, mesh)
    )
    step = dist.make_data_parallel_step(loss, optimizer, mesh)
    placed = dist.replicate(heads, mesh)
    updated, _, step_loss = step(placed, optimizer.init(placed), dist.replicate(model.params, mesh), dist.place_batch(batch, mesh))
    diff = lambda a, b: max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    scale = lambda a: max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(a))
    # the whole-batch loss on one device differs (token-weighted over 8 rows): shows the check can fail
    whole = float(jax.jit(loss)(heads, model.params, batch))
    return {
        "mesh": mesh_name, "microbatch": 8 // data, "loss_accumulated": float(ref_loss), "loss_data_parallel": float(dp_loss),
        "loss_step": float(step_loss), "loss_whole_batch_one_device": whole,
        "grad_max_diff": diff(ref_grads, dp_grads), "grad_max_abs": scale(ref_grads),
        "param_max_diff": diff(ref_updated, updated), "param_max_change": diff(ref_updated, ref_params),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generate", default="", help="comma list of MESH:POLICY[:replicate|:int8], e.g. 1x8:tova")
    parser.add_argument("--train", default="", help="comma list of meshes, e.g. 8x1,2x4")
    parser.add_argument("--indivisible", action="store_true")
    parser.add_argument("--matrix", default="", help="a mesh for every policy matrix case, e.g. 1x2")
    parser.add_argument("--cases", default="", help="comma list of the matrix's case ids (default: every case)")
    args = parser.parse_args(argv)
    result = {"devices": len(jax.devices()), "jax": jax.__version__, "generate": [], "train": []}
    model = tiny_model()
    for item in filter(None, args.generate.split(",")):
        mesh_name, name, *mode = item.split(":")
        if mode == ["int8"]:  # int8 KV pages: scales sharded with their pages, moved by compaction
            result["generate"].append(check_generate(model.with_kv_dtype("int8"), mesh_name, name))
            continue
        target = tiny_model(num_heads=8, num_kv_heads=4, seed=3) if mode else model
        result["generate"].append(check_generate(target, mesh_name, name, mode[0] if mode else "error"))
    for mesh_name in filter(None, args.train.split(",")):
        result["train"].append(check_train(model, mesh_name))
    if args.indivisible:
        result["indivisible"] = check_indivisible()
    if args.matrix:
        result["matrix"] = check_matrix(model, args.matrix, list(filter(None, args.cases.split(","))))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
