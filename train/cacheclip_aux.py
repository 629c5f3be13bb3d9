"""Fine-tune CacheClip's auxiliary model on RAG prompts (`kvjax train cacheclip-aux`).

    python -m train.cacheclip_aux --model tiny --aux-layers 1 --steps 300 --out runs/cacheclip-aux
    kvjax train cacheclip-aux --model tiny --out runs/cacheclip-aux
    kvjax train cacheclip-aux --model smollm2-135m --task real --aux-layers 4 --out runs/cacheclip-aux-smollm2

The auxiliary model starts as the main model's first `--aux-layers` layers (with its embeddings, final
norm and head: `kvjax.rag.truncated_model`) and is trained so that its last-layer attention from the
question matches the main model's (averaged over layers) on the context: KL, `kvjax.rag.aux_tuning`.
Data (`--task records`, the default): `kvjax.tasks.rag_records` prompts (system prefix, `--chunks` chunks of
`--chunk-len` words holding records, a question; half ask a record that straddles a chunk boundary).
`--task real`, for real models: `kvjax.tasks.rag_real` requests (real prose chunks in the chat template,
`--records - 1` distractor facts), cycling through the kinds straddle, split and inside (the held-out
prompts: straddle); two-hop questions are left out of training, so every prompt has one shape and the
evaluation's two-hop set stays unseen. The answer rows are the value's tokens. Seeded by `--seed`; the
main model's targets are computed once per prompt. Optax AdamW, orbax checkpoints every `--save-every` steps;
a run started again with the same `--out` resumes from its latest checkpoint and repeats exactly what an
uninterrupted run does.

Before and after training, on `--eval-samples` held-out straddling prompts (another seed): selection
recall at 20% (the share of the main model's top-20% context tokens that the auxiliary model's top 20%
holds) and straddler recall (the share of the asked record's tokens after the boundary in the auxiliary
model's top 20%). Outputs in `--out`: `metrics.jsonl`, `checkpoints/`, `aux/` (`kvjax.rag.aux_tuning.load_aux`),
`summary.json` and `loss.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .locret import plot_losses, truncate_metrics


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvjax train cacheclip-aux", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="the main model: tiny, a fetched name, a HF directory or .gguf")
    p.add_argument("--aux-layers", type=int, default=None, help="layers of the auxiliary model (default: half)")
    p.add_argument("--samples", type=int, default=400, help="training prompts")
    p.add_argument("--eval-samples", type=int, default=50, help="held-out straddling prompts for recall")
    p.add_argument("--task", choices=["records", "real"], default="records",
                   help="records: synthetic records (the tiny model); real: cross-chunk facts in real text (real models)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--records", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--target", choices=["answer", "question"], default="answer",
                   help="rows of the main model's attention to match: the question and the answer (default), or the question")
    p.add_argument("--ratio", type=float, default=0.2, help="recompute ratio the recall is measured at")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/cacheclip-aux")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # simulate a kill (tests)
    args = p.parse_args(argv)
    for name in ("samples", "eval_samples", "steps", "batch_size", "save_every", "chunks", "chunk_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup <= args.steps:
        p.error(f"--warmup must be in [0, --steps={args.steps}], got {args.warmup}")
    return args


def prompts(tokenizer, count: int, args, seed: int, straddle_only: bool = False):
    """`count` prompts as (tokens int32[T], context_len, meta): context, question, then the answer's tokens
    (teacher-forced); every prompt has the same T and the same question and answer lengths
    (meta["question_len"], meta["answer_len"])."""
    import numpy as np

    rng = np.random.default_rng(seed)
    build = _real_prompts if args.task == "real" else _record_prompts
    out = build(tokenizer, count, args, rng, straddle_only)
    shapes = {(len(t), m["question_len"], m["answer_len"]) for t, _, m in out}
    if len(shapes) != 1:
        raise ValueError(f"prompts of several shapes {sorted(shapes)}: the recipe should give one")
    return out


def _record_prompts(tokenizer, count: int, args, rng, straddle_only: bool) -> list:
    """`prompts` from `kvjax.tasks.rag_records`, half asking a straddling record (all when `straddle_only`),
    the answer the record's digits."""
    import numpy as np

    from kvjax.tasks.rag_records import encode_words, rag_prompt

    out = []
    for i in range(count):
        prefix, chunks, question, meta = rag_prompt(tokenizer, rng, args.chunks, args.chunk_len, args.records,
                                                    straddle=straddle_only or i % 2 == 0)
        context = np.concatenate([prefix, *chunks])
        answer = encode_words(tokenizer, list(meta["answer"]))
        meta = dict(meta, question_len=len(question), answer_len=len(answer))
        out.append((np.concatenate([context, question, answer]).astype(np.int32), len(context), meta))
    return out


REAL_TRAINING_KINDS = ("straddle", "split", "inside")


def _real_prompts(tokenizer, count: int, args, rng, straddle_only: bool) -> list:
    """`prompts` from `kvjax.tasks.rag_real`: request i of kind `REAL_TRAINING_KINDS[i % 3]` (straddle only
    for held-out prompts), its answer the value's tokens (" 1234567.")."""
    import numpy as np

    from kvjax.tasks import rag_real

    kinds = ("straddle",) if straddle_only else REAL_TRAINING_KINDS
    counts = {k: len(range(j, count, len(kinds))) for j, k in enumerate(kinds)}
    requests = {k: iter(rag_real.rag_requests(tokenizer, k, n, rng, num_chunks=args.chunks, chunk_len=args.chunk_len,
                                              num_distractors=args.records - 1)) for k, n in counts.items() if n}
    out = []
    for i in range(count):
        request = next(requests[kinds[i % len(kinds)]])
        context = np.concatenate([request.prefix, *request.chunks])
        answer = np.asarray(request.value_ids(tokenizer), np.int32)
        meta = {"kind": request.kind, "answer": request.answer, "after_boundary": request.after_boundary,
                "question_len": len(request.query), "answer_len": len(answer)}
        out.append((np.concatenate([context, request.query, answer]).astype(np.int32), len(context), meta))
    return out


def recalls(main_targets, aux_scores, data, ratio: float) -> dict:
    """Mean selection recall and straddler recall of `aux_scores` (one row per prompt of `data`)."""
    import numpy as np

    from kvjax.rag.aux_tuning import selection_recall

    sel, strad = [], []
    for target, scores, (_, context_len, meta) in zip(main_targets, aux_scores, data):
        sel.append(selection_recall(target, scores, context_len, ratio))
        after = meta["after_boundary"]
        if after is not None:
            k = max(1, int(round(ratio * context_len)))
            top = np.argsort(-np.asarray(scores)[:context_len], kind="stable")[:k]
            strad.append(float(np.isin(after, top).mean()))
    return {"selection_recall": float(np.mean(sel)), "straddler_recall": float(np.mean(strad)) if strad else None}


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    import kvjax
    from kvjax.rag import truncated_model
    from kvjax.rag.aux_tuning import attention_target, aux_attention, make_optimizer, make_train_step, save_aux

    main_model = kvjax.load_model(args.model)
    if main_model.tokenizer is None:
        raise SystemExit(f"{args.model!r} has no tokenizer; the RAG prompts need one")
    layers = args.aux_layers or max(1, main_model.cfg.num_layers // 2)
    aux = truncated_model(main_model, layers)
    train_data = prompts(main_model.tokenizer, args.samples, args, args.seed)
    eval_data = prompts(main_model.tokenizer, args.eval_samples, args, args.seed + 10_000, straddle_only=True)
    query_len, answer_len = train_data[0][2]["question_len"], train_data[0][2]["answer_len"]
    target_fn = jax.jit(lambda p, t: attention_target(p, t, query_len, answer_len, cfg=main_model.cfg,
                                                      dtype=main_model.dtype, answer_rows=args.target == "answer"))
    aux_fn = jax.jit(lambda p, t: aux_attention(p, t, query_len, answer_len, cfg=aux.cfg, dtype=aux.dtype))

    def in_batches(fn, params, data, desc=None):
        rows = []
        for i in tqdm(range(0, len(data), args.batch_size), desc=desc, disable=args.no_progress or desc is None):
            tokens = np.stack([t for t, _, _ in data[i : i + args.batch_size]])
            rows.append(np.asarray(fn(params, jnp.asarray(tokens))))
        return np.concatenate(rows)

    targets = in_batches(target_fn, main_model.params, train_data, desc="main model's attention")
    eval_targets = in_batches(target_fn, main_model.params, eval_data)
    before = recalls(eval_targets, in_batches(aux_fn, aux.params, eval_data), eval_data, args.ratio)
    print(f"before tuning: {before}", file=sys.stderr)

    optimizer = make_optimizer(args.lr, args.steps, args.warmup)
    step_fn = make_train_step(optimizer, cfg=aux.cfg, query_len=query_len, answer_len=answer_len, dtype=aux.dtype)
    params, opt_state = aux.params, optimizer.init(aux.params)

    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    manager = ocp.CheckpointManager(
        os.path.abspath(os.path.join(args.out, "checkpoints")),
        options=ocp.CheckpointManagerOptions(save_interval_steps=args.save_every, max_to_keep=2,
                                             enable_async_checkpointing=False),
    )
    start = 0
    if not args.no_resume and manager.latest_step() is not None:
        start = manager.latest_step()
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt_state))
        params, opt_state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        truncate_metrics(metrics_path, start)
        print(f"resumed from step {start}", file=sys.stderr)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)

    n = len(train_data)
    loss, reached = float("nan"), start
    began = time.perf_counter()
    bar = tqdm(total=args.steps, initial=start, desc="aux", unit="step", disable=args.no_progress)
    with open(metrics_path, "a") as log:
        for step in range(start, args.steps):
            if args.stop_after is not None and step - start >= args.stop_after:
                break
            epoch, offset = divmod(step * args.batch_size, n)
            order = np.random.default_rng([args.seed, epoch]).permutation(n)
            index = [int(order[(offset + j) % n]) for j in range(args.batch_size)]
            tokens = jnp.asarray(np.stack([train_data[i][0] for i in index]))
            context_len = jnp.asarray([train_data[i][1] for i in index], jnp.int32)
            params, opt_state, loss_array = step_fn(params, opt_state, tokens, jnp.asarray(targets[index]), context_len)
            loss, reached = float(loss_array), step + 1
            log.write(json.dumps({"step": step + 1, "loss": loss}) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                manager.save(step + 1, args=ocp.args.StandardSave((params, opt_state)), force=True)
    bar.close()
    manager.wait_until_finished()
    manager.close()
    summary = {"aux_layers": layers, "steps_done": reached, "final_loss": loss,
               "seconds": time.perf_counter() - began, "recall_before": before, "args": vars(args)}
    if args.stop_after is None:
        import dataclasses

        tuned = dataclasses.replace(aux, params=params)
        summary["recall_after"] = recalls(eval_targets, in_batches(aux_fn, params, eval_data), eval_data, args.ratio)
        print(f"after tuning: {summary['recall_after']}", file=sys.stderr)
        save_aux(os.path.join(args.out, "aux"), tuned, extra={"model": args.model, "steps": args.steps})
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_losses(metrics_path, os.path.join(args.out, "loss.png"), title=f"CacheClip auxiliary model ({layers} layers)",
                    ylabel="KL(main model's attention || auxiliary's)")
    return summary


if __name__ == "__main__":
    main()
