"""Train Locret's retaining heads on a frozen model (`kvjax train locret`).

    python -m train.locret --model DIR --data Yukang/LongAlpaca-12k --out runs/locret
    python -m train.locret --model kvjax/assets/tiny-llama --data rows.jsonl --steps 200 --warmup 50
    kvjax train locret --model smollm2-135m --data kvjax:real-text --data-rows 600 --max-length 8192 --hidden 128

`--model`: a Hugging Face directory, a `.gguf` file, `tiny` or a registered name (`kvjax fetch NAME`).
Data: LongAlpaca's fields (`instruction`, `output`) from the hub or a local json / jsonl / parquet file;
bad rows are skipped and counted. `--data kvjax:real-text` builds the offline recipe in memory with the
model's tokenizer (`kvjax.tasks.longalpaca.real_text_rows`: spans of long real text to continue or quote;
`python -m train.locret_data` writes the same rows to a file). Each step computes labels through kvjax's
chunked-prefill forward of the frozen model and takes one AdamW step on the heads (Locret's paper's defaults:
lr 5e-4, betas 0.9 / 0.95, warm-up 2000 of 3000 steps, clip by value 0.5, batch 1, sequences cut to 10240
tokens).

Outputs in `--out`: `metrics.jsonl` (one line per step), `checkpoints/` (orbax CheckpointManager, every
`--save-every` steps), and at the end `heads/` (orbax, for `make_policy("locret", heads=...)`),
`heads.safetensors` (`--export-dtype`, bfloat16 by default: the format of the heads kvjax ships, so the
file can be dropped in as `kvjax/assets/locret-heads/MODEL.safetensors`), `summary.json` (throughput over
steps that did not compile) and `loss.png` (the loss curve of `metrics.jsonl`). A run started again with
the same `--out` resumes from its latest checkpoint and repeats exactly what an uninterrupted run does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

REAL_TEXT = "kvjax:real-text"  # --data: the offline recipe on long real text, built in memory
DEFAULTS = dict(
    steps=3000, warmup=2000, lr=5e-4, b1=0.9, b2=0.95, weight_decay=0.01, clip=0.5, alpha=0.0025,
    batch_size=1, max_length=10240, max_answer=512, chunk_size=1024, hidden=1024, save_every=500,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvjax train locret", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the frozen model: HF directory, .gguf, tiny or a registered name")
    p.add_argument("--data", required=True,
                   help=f"hub dataset name, a local .json/.jsonl/.parquet file, or {REAL_TEXT} (the offline recipe)")
    p.add_argument("--data-rows", type=int, default=600, help=f"rows {REAL_TEXT} builds")
    p.add_argument("--data-lengths", type=int, nargs="+", default=[2048, 4096, 8192],
                   help=f"document lengths in tokens {REAL_TEXT} cycles through")
    p.add_argument("--data-seed", type=int, default=0, help=f"seed of the {REAL_TEXT} rows")
    p.add_argument("--split", default="train", help="hub split (default train)")
    p.add_argument("--out", default="runs/locret", help="output directory (resumed when it holds checkpoints)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="linear warm-up steps")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--b1", type=float, default=DEFAULTS["b1"])
    p.add_argument("--b2", type=float, default=DEFAULTS["b2"])
    p.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"])
    p.add_argument("--clip", type=float, default=DEFAULTS["clip"], help="clip each gradient entry to [-clip, clip]")
    p.add_argument("--alpha", type=float, default=DEFAULTS["alpha"], help="weight of the smoothness term")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--max-length", type=int, default=DEFAULTS["max_length"], help="tokens per sequence, at most")
    p.add_argument("--max-answer", type=int, default=DEFAULTS["max_answer"], help="answer tokens per sequence, at most")
    p.add_argument("--chunk-size", type=int, default=DEFAULTS["chunk_size"], help="prefill chunk of the label forward")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="retaining-head hidden size")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model compute dtype")
    p.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="bfloat16", help="heads.safetensors dtype")
    p.add_argument("--save-every", type=int, default=DEFAULTS["save_every"], help="checkpoint every N steps")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--limit", type=int, default=None, help="use at most this many examples")
    p.add_argument("--seed", type=int, default=0, help="heads' initialisation and data order")
    p.add_argument("--no-resume", action="store_true", help="start afresh even if --out holds checkpoints")
    p.add_argument("--mesh", default=None, metavar="DATAx1",
                   help="data-parallel over a device mesh (--batch-size split over DATA), also over several processes "
                        "started by python -m kvjax.distributed.launch; checkpoints resume on any mesh")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # simulate a kill (tests)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "chunk_size", "hidden", "save_every", "max_length", "max_answer", "data_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup <= args.steps:
        p.error(f"--warmup must be in [0, --steps={args.steps}], got {args.warmup}")
    return args


@functools.lru_cache(maxsize=4)
def _optimizer_and_step(options: tuple, cfg, dtype, chunk_size: int, alpha: float):
    """The optimizer and jitted train step, cached so that runs in one process (resume tests, sweeps)
    share a compile."""
    from kvjax.locret.training import make_optimizer, make_train_step

    optimizer = make_optimizer(**dict(options))
    return optimizer, make_train_step(optimizer, cfg=cfg, dtype=dtype, chunk_size=chunk_size, alpha=alpha)


def _manager(directory: str, save_every: int, keep: int):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=("state", "meta"))


def _restore(manager, template):
    """The latest checkpoint, placed as `template`'s arrays are (one device, or replicated over a mesh of
    any number of processes, whichever wrote it)."""
    import jax
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), template
    )
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return step, restored["state"], restored["meta"]


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop metric lines past the restored step (a killed run may have logged steps it never saved)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [l for l in f if l.strip() and json.loads(l)["step"] <= last_step]
    with open(path, "w") as f:
        f.writelines(lines)


def plot_losses(metrics_path: str, png: str, title: str = "Locret heads",
                ylabel: str = "Smooth-L1 + alpha * smoothness") -> str:
    """The loss per step of `metrics.jsonl` (and its running mean over 50 steps) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps, losses = np.array([r["step"] for r in rows]), np.array([r["loss"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, lw=0.6, alpha=0.5, label="loss")
    window = min(50, len(losses))
    if window > 1:
        mean = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], mean, lw=1.5, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.mesh:  # join the multi-process runtime (kvjax.distributed.launch) before any JAX computation
        from kvjax import distributed as dist

        dist.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    import kvjax
    from kvjax.locret import HeadsConfig, RetainingHeads, export_safetensors, init_heads, save_heads
    from kvjax.locret.data import batch_indices, build_examples, make_batch
    from kvjax.locret.training import lr_schedule

    model = kvjax.load_model(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model!r} has no tokenizer; training needs one to read the data")
    source = args.data
    if args.data == REAL_TEXT and not os.path.exists(args.data):
        from kvjax.tasks.longalpaca import real_text_rows

        source = real_text_rows(model.tokenizer, args.data_rows, args.data_lengths, args.data_seed,
                                progress=not args.no_progress)
    examples, skipped = build_examples(
        source, model.tokenizer, args.max_length, args.max_answer, args.split, args.limit, not args.no_progress
    )
    if skipped:
        print(f"skipped {sum(skipped.values())} bad rows: {dict(skipped)}", file=sys.stderr)
    if not examples:
        raise SystemExit(f"no usable rows in {args.data!r} (skipped: {dict(skipped)})")

    config = HeadsConfig.for_model(model.cfg, args.hidden)
    heads = init_heads(config, args.seed).params
    options = dict(
        learning_rate=args.lr, total_steps=args.steps, warmup_steps=args.warmup, b1=args.b1, b2=args.b2,
        weight_decay=args.weight_decay, clip_value=args.clip,
    )
    optimizer, step_fn = _optimizer_and_step(tuple(sorted(options.items())), model.cfg, model.dtype, args.chunk_size, args.alpha)
    opt_state = optimizer.init(heads)
    place = lambda batch: jax.tree_util.tree_map(jnp.asarray, batch)  # noqa: E731
    frozen, main_process = model.params, jax.process_index() == 0
    if args.mesh:  # heads, optimizer state and model replicated; each step's batch split over "data"
        from kvjax.locret.training import loss_fn

        mesh = dist.mesh_from_text(args.mesh)
        if args.batch_size % mesh.shape["data"]:
            raise SystemExit(f"--batch-size {args.batch_size} must divide by the mesh's data axis ({mesh.shape['data']})")
        loss = functools.partial(loss_fn, cfg=model.cfg, dtype=model.dtype, chunk_size=args.chunk_size, alpha=args.alpha)
        step_fn = dist.make_data_parallel_step(loss, optimizer, mesh)
        heads, opt_state, frozen = (dist.replicate(tree, mesh) for tree in (heads, opt_state, model.params))
        place = functools.partial(dist.place_batch, mesh=mesh)
    schedule = lr_schedule(args.lr, args.steps, args.warmup)

    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    manager = _manager(os.path.join(args.out, "checkpoints"), args.save_every, args.keep)
    start = 0
    restored = None if args.no_resume else _restore(manager, {"heads": heads, "opt_state": opt_state})
    if restored is not None:
        start, state, meta = restored
        heads, opt_state = state["heads"], state["opt_state"]
        print(f"resumed from step {start} ({meta})", file=sys.stderr)
        if main_process:
            truncate_metrics(metrics_path, start)
    elif os.path.exists(metrics_path) and main_process:
        os.remove(metrics_path)

    timed_steps, timed_seconds, timed_tokens = 0, 0.0, 0
    shapes_seen = set()  # a step with a new padded shape compiles: throughput leaves it out
    loss = float("nan")
    bar = tqdm(total=args.steps, initial=start, desc="locret", unit="step", disable=args.no_progress)
    with open(metrics_path if main_process else os.devnull, "a") as log:  # one process writes the metrics
        for step in range(start, args.steps):
            if args.stop_after is not None and step - start >= args.stop_after:
                break
            batch = make_batch([examples[i] for i in batch_indices(step, args.batch_size, len(examples), args.seed)], args.chunk_size)
            tokens = int(batch.prefix_len.sum() + batch.answer_len.sum())
            began = time.perf_counter()
            heads, opt_state, loss_array = step_fn(heads, opt_state, frozen, place(batch))
            loss = float(loss_array)
            seconds = time.perf_counter() - began
            shape = (batch.prefix.shape, batch.answer.shape)
            if shape in shapes_seen:
                timed_steps, timed_seconds, timed_tokens = timed_steps + 1, timed_seconds + seconds, timed_tokens + tokens
            shapes_seen.add(shape)
            log.write(json.dumps({"step": step + 1, "loss": loss, "lr": float(schedule(step)), "tokens": tokens, "seconds": seconds}) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                manager.save(
                    step + 1,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave({"heads": heads, "opt_state": opt_state}),
                        meta=ocp.args.JsonSave({"step": step + 1, "loss": loss, "data": args.data}),
                    ),
                    force=True,
                )
    bar.close()
    manager.wait_until_finished()
    manager.close()
    summary = {
        "steps_done": manager.latest_step() if args.stop_after is not None else args.steps,
        "final_loss": loss,
        "examples": len(examples),
        "skipped": dict(skipped),
        "steps_per_second": timed_steps / timed_seconds if timed_seconds else None,
        "tokens_per_second": timed_tokens / timed_seconds if timed_seconds else None,
        "timed_steps": timed_steps,
        "args": vars(args),
    }
    if args.stop_after is None:
        model_name = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
        # every process takes part in orbax's save; one writes the other files
        save_heads(os.path.join(args.out, "heads"), RetainingHeads(config, heads), extra={"model": model_name, "steps": args.steps})
        if not main_process:
            return summary
        final = RetainingHeads(config, jax.tree_util.tree_map(np.asarray, heads))
        export_safetensors(final, os.path.join(args.out, "heads.safetensors"), args.export_dtype)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_losses(metrics_path, os.path.join(args.out, "loss.png"), title=f"Locret heads for {model_name}")
    return summary


if __name__ == "__main__":
    main()
