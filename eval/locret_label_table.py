"""Candidate Locret labels judged before training: eviction by each label itself, with the budget per kv head,
pooled over a layer's heads, or pooled over all layers and heads (issue 50's deliverable 1).

For each batch of the sweep's samples the frozen model reads each context once (a full prefill shared by
every cell); each cell then scores the context's slots by one label, spreads its budget one way
(`kvzip`'s pool: `head`, `layer` or `all`, 4 sink tokens kept in every case), evicts once, and the question is
fed by decode after compression (Quest's protocol), as in `eval/locret_oracle.py`. Labels:

- `question+answer logit`: the oracle's label so far, the largest pre-softmax logit `q . k / sqrt(D)` any
  query of the question and gold answer gives the token, max over the GQA group;
- `answer logit (Locret)`: official Locret's, the same over the gold answer's queries only;
- `KVzip`: the largest softmax attention the token gets while the model repeats the context after
  "Repeat the previous context exactly." (`kvjax.engine.reconstruction`), with no question: what the
  `kvzip` policy keeps. (Its log, a regression target, ranks the same.)

The two logit labels know the question or the answer, so they bound what heads predicting them could do;
KVzip's is question-agnostic. Each cell reports accuracy and the share of the needle's tokens kept (mean
over layers and kv heads). Resumes by batch from `<name>.batches.jsonl`.

    python -m eval.locret_label_table --length 2048 --budgets 256 512 --tasks real_passkey niah_single --batches 1
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from .lib import retrieval
from .lib.needles import answer_ids, needle_kept, needle_span
from .lib.report import cpu_load, machine_info, markdown_table, write_and_print
from .lib.sweep import pool_batches

LABELS = ("question+answer logit", "answer logit (Locret)", "KVzip")
SPREADS = {"per kv head": "head", "pooled per layer": "layer", "pooled over all layers": "all"}
SINKS = 4


def answer_labels(model, state, contexts, questions, answers) -> tuple[jax.Array, jax.Array]:
    """The two logit labels `f32[L, B, H, S]` (slot order) of each context slot, from one pass that feeds
    question + answer after the prefilled `state` (a copy: it is donated) through the one step with
    `observe`: the largest `q . k / sqrt(D)` over the question's and answer's queries, and over the answer's
    alone, max over the GQA group (`kvjax.locret.labels`' label, context keys only)."""
    from kvjax.cache.attention import attention_max
    from kvjax.cache.state import gather_layer
    from kvjax.engine.step import append_chunk
    from kvjax.policies import FullPolicy

    fed = [list(q) + list(a) for q, a in zip(questions, answers)]
    B, C = len(fed), max(map(len, fed))
    if max(map(len, fed)) > state.capacity - max(map(len, contexts)):
        raise ValueError("question + answer do not fit the room the shared prefill reserved")
    tokens = np.zeros((B, C), np.int32)
    for b, row in enumerate(fed):
        tokens[b, : len(row)] = row
    real = np.arange(C)[None, :] < np.array([len(r) for r in fed])[:, None]
    answer_only = real & (np.arange(C)[None, :] >= np.array([len(q) for q in questions])[:, None])
    n = jnp.asarray([len(c) for c in contexts], jnp.int32)
    L, _, H = state.page_table.shape[:3]
    S = state.max_pages * state.page_size

    def observe(layer, inputs, state, out):
        k, _, pos, valid = gather_layer(state, layer)
        ok = valid & (pos < n[:, None, None])
        best = [attention_max(inputs.q, inputs.positions, jnp.asarray(r), k, pos, ok, probs=False)
                for r in (real, answer_only)]
        return tuple(o.at[layer].set(jnp.where(ok, x, -jnp.inf)) for o, x in zip(out, best))

    empty = jnp.full((L, B, H, S), -jnp.inf, jnp.float32)
    _, _, _, (both, answer) = append_chunk(
        model.params, state, None, jnp.asarray(tokens), jnp.asarray(real.sum(-1).astype(np.int32)),
        jnp.zeros((B, model.cfg.vocab_size), jnp.float32), cfg=model.cfg, dtype=model.dtype, policy=FullPolicy(),
        observe=observe, observed=(empty, empty))
    return both, answer


def run_batch(model, samples, task: str, length: int, budgets, chunk: int, progress=None) -> dict:
    """{cell key: {"scores": [per sample], "needle_kept": [per sample]}} for one batch: `full`, and
    `label / spread @ budget` for every label, spread and budget. One full prefill serves every cell; the
    labels come from passes over copies of it (question + answer fed once; the reconstruction)."""
    from kvjax.engine.generation import bucketed, compress_prefilled, continue_rows
    from kvjax.engine.reconstruction import reconstruction_scores, score_slots
    from kvjax.engine.shared_prefill import shared_prefill
    from kvjax.policies import FullPolicy
    from kvjax.policies.kvzip import INSTRUCTION_ROOM, KVzip

    split = [retrieval.split_sample(model, s, task) for s in samples]
    contexts = [c for c, _, _ in split]
    questions = [list(q) for _, q, _ in split]
    answers = [answer_ids(model, s) for s in samples]
    lengths = [len(c) for c in contexts]
    max_new = max(m for _, _, m in split)
    reserve = max(max(len(q) for q in questions) + max_new, max(len(q) + len(a) for q, a in zip(questions, answers)))
    spans = [needle_span(model, s) for s in samples]
    spec = KVzip(sink_size=SINKS).scoring_pass
    longest = max(lengths)
    capacity = bucketed(longest + max(reserve, min(spec.chunk, longest) + INSTRUCTION_ROOM))  # room for the pass
    shared = shared_prefill(model, contexts, [FullPolicy()], reserve_tokens=reserve, capacity=capacity,
                            chunk_size=chunk)
    copy = lambda: jax.tree.map(jnp.copy, shared.state)
    scores = dict(zip(LABELS[:2], answer_labels(model, copy(), contexts, questions, answers)))
    scores[LABELS[2]] = reconstruction_scores(model, copy(), contexts, spec)[1]

    out = {}
    full = FullPolicy()  # nothing is selected or evicted while decoding: one decode program for every cell

    def decode(key, state):
        kept = needle_kept(state, spans)
        tokens = continue_rows(model, state, shared.logits, [np.asarray(q, np.int32) for q in questions], max_new, full)
        scored = [retrieval.score_sample(model, s, task, length, row) for s, row in zip(samples, np.asarray(tokens))]
        out[key] = {"scores": [r.score if r.score is not None else float(r.correct) for r in scored], "needle_kept": kept}
        if progress is not None:
            progress.update(1)

    decode("full", copy())
    for budget in budgets:
        for spread, pool in SPREADS.items():
            policy = KVzip(token_budget=budget, pool=pool, sink_size=SINKS)
            for label in LABELS:
                state = score_slots(copy(), scores[label], policy=policy)
                decode(f"{label} / {spread}@{budget}", compress_prefilled(model, state, None, policy, lengths, reserve))
    return out


def run(model, tasks, length: int, budgets, num_samples: int = 50, batch_size: int = 5, max_batches: int | None = None,
        chunk: int = 512, seed: int = 0, checkpoint: str | None = None, progress: bool = True) -> dict:
    """Every task's first batches (`samples[index::batches]`, the sweep's order), resumed from `checkpoint`;
    returns {"cells": [{task, length, label, spread, budget, accuracy, needle_kept, samples}], ...}."""
    from tqdm import tqdm

    setting = {"length": length, "samples": num_samples, "batch_size": batch_size, "seed": seed, "chunk": chunk,
               "sinks": SINKS, "budgets": list(budgets)}
    done: dict = {}
    loads = []
    if checkpoint and os.path.exists(checkpoint):
        with open(checkpoint) as f:
            for line in f:
                row = json.loads(line)
                if row["setting"] == setting:
                    done[(row["task"], row["batch"])] = row["cells"]
                    loads.append(row["load"])
    batches = -(-num_samples // batch_size)
    per_batch = 1 + len(budgets) * len(LABELS) * len(SPREADS)
    for task in tasks:
        samples = None
        wanted = range(batches if max_batches is None else min(batches, max_batches))
        bar = tqdm(total=len(wanted) * per_batch, desc=f"{task} {length}", disable=not progress)
        for index in wanted:
            if (task, index) in done:
                bar.update(per_batch)
                continue
            if samples is None:
                samples = retrieval.task_samples(model, task, length, num_samples, seed)
            started, before = time.perf_counter(), cpu_load()
            cells = run_batch(model, samples[index::batches], task, length, budgets, chunk, progress=bar)
            done[(task, index)] = cells
            loads.append({"before": before, "after": cpu_load()})
            if checkpoint:
                with open(checkpoint, "a") as f:
                    f.write(json.dumps({"task": task, "batch": index, "cells": cells, "setting": setting,
                                        "load": loads[-1], "seconds": round(time.perf_counter() - started, 1)}) + "\n")
        bar.close()
        jax.clear_caches()
    rows = []
    for (task, key), values in pool_batches(done).items():
        name, _, budget = key.rpartition("@")
        label, _, spread = (name or key).partition(" / ")
        rows.append({"task": task, "length": length, "label": label, "spread": spread or None,
                     "budget": int(budget) if budget.isdigit() else None,
                     "accuracy": float(np.mean(values["scores"])), "needle_kept": float(np.mean(values["needle_kept"])),
                     "samples": len(values["scores"])})
    return {"machine": machine_info(), "setting": setting, "load": loads, "cells": rows}


def table(result: dict) -> str:
    """Per task: rows = label x spread, columns = budgets, "accuracy (needle tokens kept)"; full attention first."""
    parts = []
    length = result["setting"]["length"]
    for task in dict.fromkeys(c["task"] for c in result["cells"]):
        mine = [c for c in result["cells"] if c["task"] == task]
        budgets = sorted({c["budget"] for c in mine if c["budget"] is not None})
        full = next(c for c in mine if c["label"] == "full")
        rows = [["full attention", ""] + [f"{100 * full['accuracy']:.0f}%"] * len(budgets)]
        for label in LABELS:
            for spread in SPREADS:
                row = [label, spread]
                for budget in budgets:
                    found = [c for c in mine if c["label"] == label and c["spread"] == spread and c["budget"] == budget]
                    row.append(f"{100 * found[0]['accuracy']:.0f}% ({100 * found[0]['needle_kept']:.0f}%)" if found else "")
                rows.append(row)
        n = min(c["samples"] for c in mine)
        parts.append(f"**{task}**, {length} tokens, {n} samples a cell: accuracy (share of the needle's tokens kept, "
                     "mean over layers and kv heads)\n\n"
                     + markdown_table(["label", "budget spread"] + [f"{b} (1/{round(length / b)})" for b in budgets], rows))
    loads = [x for entry in result.get("load", []) for x in (entry.get("before"), entry.get("after")) if x]
    note = ""
    if loads:
        one_minute = [x[0] for x in loads]
        note = (f"\n\nLoad average (1 min) {min(one_minute):.1f}-{max(one_minute):.1f} on "
                f"{result['machine'].get('cpu_count')} cores shared with other sessions.")
    return "\n\n".join(parts) + note + "\n"


def main(argv=None) -> dict:
    from kvjax.models.loading import load_model
    from kvjax.util.compilation_cache import enable_compilation_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=["real_passkey", "niah_single"], choices=retrieval.REAL_TASKS)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--batches", type=int, default=None, help="batches per task in this call (resume later)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", default="results/locret")
    parser.add_argument("--name", default="locret_label_table")
    args = parser.parse_args(argv)
    enable_compilation_cache()  # later calls (more batches) reuse this one's compiled steps
    model = load_model(args.model)
    os.makedirs(args.out, exist_ok=True)
    result = run(model, args.tasks, args.length, args.budgets, args.samples, args.batch_size, args.batches,
                 args.chunk, checkpoint=os.path.join(args.out, f"{args.name}.batches.jsonl"))
    return write_and_print(args.out, args.name, result, table(result))


if __name__ == "__main__":
    main()
