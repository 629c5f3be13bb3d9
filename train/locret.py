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
MIXED = "kvjax:real-text+needles"  # --data: real-text rows interleaved with the needle recipe's (seed 1000 + --data-seed)
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
    p.add_argument("--label", choices=["answer-logit", "kvzip"], default="answer-logit",
                   help="answer-logit: Locret's label, computed each step; kvzip: KVzip's question-agnostic score "
                        "(log), extracted once into --cache and trained with a ranking term")
    p.add_argument("--cache", default=None, help="--label kvzip: where the extracted inputs and labels go "
                                                 "(default OUT/targets; float16 inputs, resumed)")
    p.add_argument("--label-norm", choices=["sequence", "head"], default="sequence",
                   help="--label kvzip: z-score the log labels over the whole sequence or per layer and kv head")
    p.add_argument("--rank-weight", type=float, default=1.0, help="--label kvzip: weight of the listwise term")
    p.add_argument("--temperature", type=float, default=1.0, help="--label kvzip: listwise softmax temperature")
    p.add_argument("--heldout", type=int, default=4, help="--label kvzip: last examples held out for checkpoint choice")
    p.add_argument("--eval-every", type=int, default=25, help="--label kvzip: held-out recall every N steps")
    p.add_argument("--recall-shares", type=float, nargs="+", default=[0.125, 0.25],
                   help="--label kvzip: kept shares whose pooled top-b recall chooses the checkpoint")
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


def recipe_rows(tokenizer, recipe: str, rows: int, lengths, seed: int, progress: bool) -> list[dict]:
    """The offline recipe's rows: `REAL_TEXT`'s, or (`MIXED`) real-text and needle rows alternating,
    `rows` in all (`kvjax.tasks.longalpaca`)."""
    from kvjax.tasks.longalpaca import needle_rows, real_text_rows

    if recipe == REAL_TEXT:
        return real_text_rows(tokenizer, rows, lengths, seed, progress=progress)
    text = real_text_rows(tokenizer, -(-rows // 2), lengths, seed, progress=progress)
    needles = needle_rows(tokenizer, rows // 2, lengths, 1000 + seed, progress=progress)
    return [row for pair in zip(text, needles + [None]) for row in pair if row is not None][:rows]


def cache_kvzip_targets(model, examples, directory: str, chunk_size: int, setting: dict, progress: bool = True) -> list[str]:
    """Each example's head inputs and KVzip label (`kvjax.locret.labels.kvzip_targets`) in
    `directory/NNNNN.npz`: `x f16[L, T, (Hq + 2H) * D]` (q, k, v before RoPE, concatenated) and
    `labels f32[L, T, H]` over its T real tokens. Files already there are kept (the extraction resumes);
    `setting` (the data's options) is checked against the directory's `setting.json`."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from kvjax.locret.data import make_batch
    from kvjax.locret.labels import kvzip_targets

    os.makedirs(directory, exist_ok=True)
    meta = os.path.join(directory, "setting.json")
    if os.path.exists(meta):
        with open(meta) as f:
            found = json.load(f)
        if found != setting:
            raise SystemExit(f"{directory} holds targets of another setting {found}; got {setting} (use another --cache)")
    else:
        with open(meta, "w") as f:
            json.dump(setting, f)
    paths = [os.path.join(directory, f"{i:05d}.npz") for i in range(len(examples))]
    for example, path in tqdm(list(zip(examples, paths)), desc="kvzip targets", unit="example", disable=not progress):
        if os.path.exists(path):
            continue
        targets = kvzip_targets(model, make_batch([example], chunk_size), chunk_size=chunk_size)
        T = len(example.prefix)
        x = jax.numpy.concatenate([a[:, 0, :T].reshape(a.shape[0], T, -1) for a in targets[:3]], axis=-1)
        np.savez(path + ".tmp.npz", x=np.asarray(x, np.float16), labels=np.asarray(targets.labels[:, 0, :T]))
        os.replace(path + ".tmp.npz", path)  # a killed extraction leaves no half-written file
    return paths


def _cached(path: str, chunk: int):
    """One cached sequence, padded to a bucketed width (few compiles): (x f16[L, Tb, F], labels, valid bool[Tb])."""
    import numpy as np

    from kvjax.locret.data import padded_width

    with np.load(path) as f:
        x, labels = f["x"], f["labels"]
    T = x.shape[1]
    Tb = padded_width(T, chunk)
    pad = ((0, 0), (0, Tb - T), (0, 0))
    return np.pad(x, pad), np.pad(labels, pad), np.arange(Tb) < T


def heldout_recall(heads, paths, chunk: int, shares) -> dict:
    """Mean over `paths` of `top_share_recall` (pooled over all layers and heads) per share."""
    import jax
    import numpy as np

    from kvjax.locret.training import cached_predictions, top_share_recall

    predict = jax.jit(cached_predictions)
    out = {share: [] for share in shares}
    for path in paths:
        x, labels, valid = _cached(path, chunk)
        pred = np.asarray(predict(heads, x))
        for share in shares:
            out[share].append(top_share_recall(pred, labels, valid, share))
    return {f"recall@{share:g}": float(np.mean(v)) for share, v in out.items()}


def train_on_kvzip(args, model, examples, config, heads, skipped: dict) -> dict:
    """`--label kvzip`: extract every example's inputs and KVzip label once (`cache_kvzip_targets`), train on
    the cached ones but the last `--heldout` (`kvjax.locret.training.ranked_loss`), score the held-out ones
    every `--eval-every` steps by pooled top-b recall and export the best heads."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from kvjax.locret import RetainingHeads, export_safetensors, save_heads
    from kvjax.locret.data import batch_indices
    from kvjax.locret.training import lr_schedule, make_cached_step, make_optimizer

    if args.mesh:
        raise SystemExit("--label kvzip trains on one device (no --mesh)")
    if not 0 < args.heldout < len(examples):
        raise SystemExit(f"--heldout must be in [1, {len(examples)}), got {args.heldout}")
    setting = {k: getattr(args, k) for k in ("data", "data_rows", "data_lengths", "data_seed", "max_length",
                                             "max_answer", "chunk_size", "model")}
    started, load_before = time.perf_counter(), os.getloadavg()
    paths = cache_kvzip_targets(model, examples, args.cache or os.path.join(args.out, "targets"), args.chunk_size,
                                setting, not args.no_progress)
    extract_seconds = time.perf_counter() - started
    cache = args.cache or os.path.join(args.out, "targets")
    # the extraction's wall time, resumed or not: from the cache's setting file to its newest target file
    extract_wall = max(map(os.path.getmtime, paths)) - os.path.getmtime(os.path.join(cache, "setting.json"))
    train, held = paths[: -args.heldout], paths[-args.heldout :]
    optimizer = make_optimizer(args.lr, args.steps, args.warmup, args.b1, args.b2, args.weight_decay, args.clip)
    step_fn = make_cached_step(optimizer, alpha=args.alpha, rank_weight=args.rank_weight,
                               temperature=args.temperature, scope=args.label_norm)
    opt_state, schedule = optimizer.init(heads), lr_schedule(args.lr, args.steps, args.warmup)
    best, best_recall, history = jax.tree.map(np.asarray, heads), -1.0, []
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as log:
        for step in tqdm(range(args.steps), desc="locret (kvzip)", unit="step", disable=args.no_progress):
            x, labels, valid = _cached(train[batch_indices(step, 1, len(train), args.seed)[0]], args.chunk_size)
            heads, opt_state, loss = step_fn(heads, opt_state, x, labels, valid)
            row = {"step": step + 1, "loss": float(loss), "lr": float(schedule(step))}
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                row.update(heldout_recall(heads, held, args.chunk_size, args.recall_shares))
                mean = float(np.mean([row[f"recall@{s:g}"] for s in args.recall_shares]))
                history.append(row)
                if mean > best_recall:
                    best, best_recall, row["best"] = jax.tree.map(np.asarray, heads), mean, True
            log.write(json.dumps(row) + "\n")
            log.flush()
    train_seconds = time.perf_counter() - started
    final = RetainingHeads(config, best)
    model_name = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    save_heads(os.path.join(args.out, "heads"), final, extra={"model": model_name, "steps": args.steps, "label": "kvzip"})
    export_safetensors(final, os.path.join(args.out, "heads.safetensors"), args.export_dtype)
    summary = {"label": "kvzip", "examples": len(examples), "trained_on": len(train), "heldout": len(held),
               "skipped": skipped, "extract_seconds": extract_wall, "extract_seconds_this_run": extract_seconds, "train_seconds": train_seconds,
               "load": {"before": load_before, "after": os.getloadavg(), "cpu_count": os.cpu_count()},
               "best_heldout": max(history, key=lambda r: np.mean([r[f"recall@{s:g}"] for s in args.recall_shares])),
               "heldout_history": history, "untrained_heldout": heldout_recall(
                   init_heads_like(config, args.seed), held, args.chunk_size, args.recall_shares), "args": vars(args)}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_losses(os.path.join(args.out, "metrics.jsonl"), os.path.join(args.out, "loss.png"),
                title=f"Locret heads (KVzip label) for {model_name}", ylabel="Smooth-L1 + listwise + alpha * smoothness")
    return summary


def init_heads_like(config, seed: int) -> dict:
    from kvjax.locret import init_heads

    return init_heads(config, seed).params


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
    if args.data in (REAL_TEXT, MIXED) and not os.path.exists(args.data):
        source = recipe_rows(model.tokenizer, args.data, args.data_rows, args.data_lengths, args.data_seed,
                             not args.no_progress)
    examples, skipped = build_examples(
        source, model.tokenizer, args.max_length, args.max_answer, args.split, args.limit, not args.no_progress
    )
    if skipped:
        print(f"skipped {sum(skipped.values())} bad rows: {dict(skipped)}", file=sys.stderr)
    if not examples:
        raise SystemExit(f"no usable rows in {args.data!r} (skipped: {dict(skipped)})")

    config = HeadsConfig.for_model(model.cfg, args.hidden)
    heads = init_heads(config, args.seed).params
    if args.label == "kvzip":
        return train_on_kvzip(args, model, examples, config, heads, dict(skipped))
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
