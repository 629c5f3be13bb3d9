"""Do more host devices make CPU decode read faster? Dense paged decode with the heads split over N CPU devices.

Each run starts a fresh process with `jax_num_cpu_devices = N` (fixed when JAX starts) and times, with
`shard_map` giving every device 1/N of the heads and a pool of its own: a large read (`jnp.sum` over
`--read-mib`), and `pallas_kernels.paged_decode` on Llama-2-7B's shape (32 heads of 128, MHA, page size
16, pages placed as kvjax's allocator places them after a chunked prefill) at `--context`, rotating over
4 layers. Bandwidth = bytes read / median time; process CPU time over wall time shows how many cores the
program kept busy.

    python -m eval.bench_host_devices                 # N = 1 and 2, 16K context
    python -m eval.bench_host_devices --devices 1 2 --context 8192

Writes bench_host_devices.{json,md,png} under --out (default ./kvjax-results/host_devices).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from .lib.report import default_out, machine_info, markdown_table, write_outputs
from .lib.setups import chunked_page_tables

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE = 4, 32, 128, 16


def measure(devices: int, context: int, read_mib: int, repeats: int) -> dict:
    """One process's figures (run in a fresh process: the device count is fixed at start)."""
    import time

    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from kvjax import pallas_kernels as pk

    if len(jax.devices()) != devices:
        raise SystemExit(f"asked for {devices} CPU devices, JAX has {len(jax.devices())}")
    mesh = Mesh(np.array(jax.devices()), ("d",))
    shard = NamedSharding(mesh, P("d"))
    heads, pages = HEADS // devices, context // PAGE_SIZE
    num_pages = LAYERS * heads * pages
    tables = chunked_page_tables(LAYERS, heads, pages, max(1, 1024 // PAGE_SIZE))  # [L, 1, h, P]

    def stacked(seed: int, shape):
        return jax.device_put(jnp.stack([jax.random.normal(jax.random.PRNGKey(seed + i), shape, jnp.float32)
                                         for i in range(devices)]), shard)

    k, v = stacked(0, (num_pages, PAGE_SIZE, HEAD_DIM)), stacked(100, (num_pages, PAGE_SIZE, HEAD_DIM))
    q = stacked(200, (1, heads, HEAD_DIM))
    lengths = jax.device_put(jnp.full((devices, 1, heads), context, jnp.int32), shard)
    layer_tables = [jax.device_put(jnp.stack([jnp.asarray(tables[layer])] * devices), shard) for layer in range(LAYERS)]
    decode = jax.jit(jax.shard_map(
        lambda q, k, v, t, n: pk.paged_decode(q[0], k[0], v[0], t[0], n[0])[None], mesh=mesh,
        in_specs=(P("d"),) * 5, out_specs=P("d"), check_vma=False))
    floats = read_mib * 2**20 // 4 // devices
    data = jax.device_put(jnp.full((devices, floats), 0.5, jnp.float32), shard)
    read = jax.jit(jax.shard_map(lambda a: jnp.sum(a, axis=1), mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def timed(fn, args_of):
        for i in range(2):
            jax.block_until_ready(fn(*args_of(i)))
        walls, cpus = [], []
        for r in range(repeats):
            args = args_of(r)
            cpu, start = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn(*args))
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        order = np.argsort(walls)
        mid = order[len(order) // 2]
        return walls[mid], cpus[mid]

    read_s, read_cpu = timed(read, lambda r: (data,))
    decode_s, decode_cpu = timed(decode, lambda r: (q, k, v, layer_tables[r % LAYERS], lengths))
    kv_bytes = 2 * HEADS * pages * PAGE_SIZE * HEAD_DIM * 4
    return {"devices": devices, "context": context,
            "large_read": {"bytes": read_mib * 2**20, "median_s": read_s, "gbps": read_mib * 2**20 / read_s / 1e9,
                           "cpu_over_wall": read_cpu / read_s},
            "paged_decode": {"bytes": kv_bytes, "median_s": decode_s, "gbps": kv_bytes / decode_s / 1e9,
                             "cpu_over_wall": decode_cpu / decode_s}}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    labels = [str(r["devices"]) for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["large_read"]["gbps"] for r in rows], width=0.4, label="large read")
    ax.bar([i + 0.2 for i in x], [r["paged_decode"]["gbps"] for r in rows], width=0.4, label="paged decode")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("CPU devices (heads split over them)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"Llama-2 shape, {rows[0]['context']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--read-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", default=default_out("host_devices"))
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one process's run
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.context, args.read_mib, args.repeats)))
        return {}
    rows = []
    for devices in args.devices:
        if HEADS % devices:
            raise SystemExit(f"--devices {devices} must divide the {HEADS} heads")
        done = subprocess.run([sys.executable, "-m", __spec__.name, "--one", str(devices), "--context",
                               str(args.context), "--read-mib", str(args.read_mib), "--repeats", str(args.repeats)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    payload = {"benchmark": "bench_host_devices", "machine": machine_info(), "rows": rows}
    table = markdown_table(
        ["CPU devices", "large read GB/s", "(CPU / wall)", "paged decode ms", "GB/s", "of large read", "(CPU / wall)"],
        [[r["devices"], r["large_read"]["gbps"], f"{r['large_read']['cpu_over_wall']:.1f}",
          1e3 * r["paged_decode"]["median_s"], r["paged_decode"]["gbps"],
          f"{r['paged_decode']['gbps'] / r['large_read']['gbps']:.0%}", f"{r['paged_decode']['cpu_over_wall']:.1f}"]
         for r in rows])
    table += (f"\nLlama-2-7B shape (32 heads of 128, MHA), {args.context} tokens, page size 16, float32, 4 layers "
              f"rotated; medians of {args.repeats}. {payload['machine'].get('cpu_model', '')}, "
              f"{payload['machine']['cpu_count']} cores.\n")
    paths = write_outputs(args.out, "bench_host_devices", payload, table)
    plot(rows, paths["json"].replace(".json", ".png"))
    print(table)
    return payload


if __name__ == "__main__":
    main()
