"""The sweep runner: policies x budgets x lengths on the retrieval tasks, each batch prefilled once and every
cell derived from it (`kvjax.engine.shared_prefill`), resumable by batch; `eval.sweep` and `eval.demo` run it."""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import jax
import numpy as np

from kvjax.engine.shared_prefill import shared_prefill

from . import retrieval
from .policies import DEFAULT_DENSE_LAYERS, DEFAULT_POLICIES, build_policy, cell_key, parse_cell_key, sweep_cells
from .report import machine_info
from .timing import DecodeRun


def time_decodes(model, policies: dict, prompts: Sequence[Sequence[int]], steps: int = 16) -> dict:
    """Prefill `prompts` once (`kvjax.engine.shared_prefill`), derive each of `policies` ({key: Policy}; one that
    compresses during prefill or scores in a pass of its own, Locret or KVzip, is prefilled alone), then time
    `steps` decode steps after one warm-up step: {key: {decode_ms_per_step (median), decode_tokens_per_s, batch}}."""
    shareable = [p for p in policies.values() if not retrieval.compresses_in_prefill(p)]
    shared = shared_prefill(model, prompts, shareable, reserve_tokens=steps + 8) if shareable else None
    out = {}
    for key, policy in policies.items():
        result = DecodeRun(model, *retrieval.policy_state(model, shared, policy, prompts, steps + 8), policy).run(steps)
        out[key] = {"decode_ms_per_step": 1e3 * result["decode_step_s"],
                    "decode_tokens_per_s": result["decode_tokens_per_s"], "batch": len(prompts)}
    return out


def run_sweep(model, policies: Sequence[str] = DEFAULT_POLICIES, budgets: Sequence[int] = (64, 128),
              lengths: Sequence[int] = (2048,), tasks: Sequence[str] = ("passkey", "multikey"), num_samples: int = 20,
              num_records: int = 4, seed: int = 0, dense_layers: int = DEFAULT_DENSE_LAYERS, batch_size: int = 8,
              latency: bool = True, progress: bool = True, checkpoint: str | None = None,
              clear_compiled: bool = True, max_batches: int | None = None, latency_batch: int = 1,
              question_in_prefill: bool = False, reuse: str | None = None) -> dict:
    """Accuracy rows {task, length, policy, budget, accuracy, correct, samples} and latency rows.

    Each batch of samples is prefilled once, and every cell that compresses after prefill (or only
    selects pages) is derived from that one state (`retrieval.answer_shared`); Locret prefills on its own.
    With `checkpoint` (a jsonl path) every finished batch is appended there with every cell's scores, and
    batches already in it (same setting) are not run again: a killed sweep resumes at the next batch, and
    `max_batches` bounds the batches run per (task, length) in this call (a long sweep spread over several
    sessions: the tables report the samples done so far). With `reuse` (another sweep's checkpoint), the cells it
    holds for the same setting and a batch this call runs are copied from it, not run (the same samples; the
    line says `reused_from`). The report covers every task, length and cell the
    checkpoint holds for this setting, named in this call or not; the call runs only those named. With `latency`, decode speed per policy at the
    largest budget is timed on `latency_batch` prompts (`time_decodes`). `clear_compiled` drops JAX's compiled steps after
    each (task, length) (long sweeps; the demo keeps them, so its latency pass reuses them)."""
    from tqdm import tqdm

    cells = sweep_cells(policies, budgets)
    setting = {"samples": num_samples, "records": num_records, "seed": seed, "dense_layers": dense_layers,
               "batch_size": batch_size}
    if question_in_prefill:
        setting["question_in_prefill"] = True
    done, seconds = read_checkpoint(checkpoint, setting)  # seconds: (task, length) -> seconds of the batches run
    reused = read_checkpoint(reuse, setting)[0] if reuse else {}
    scores: dict = {}  # (task, length, cell key) -> [score per sample]; filled from `done` at the end
    batches = -(-num_samples // batch_size)
    for task in tasks:
        for n_tokens in lengths:
            samples = None
            ran = 0
            bar = tqdm(total=batches * len(cells), desc=f"{task} {n_tokens}", disable=not progress)
            for index in range(batches):
                have = done.get((task, n_tokens, index), {})
                todo = [(p, b) for p, b in cells if cell_key(p, b) not in have]
                if max_batches is not None and ran >= max_batches:
                    todo = []  # this call's batches are spent: report what earlier runs checkpointed
                if todo:
                    there = reused.get((task, n_tokens, index), {})
                    new = {cell_key(p, b): there[cell_key(p, b)] for p, b in todo if cell_key(p, b) in there}
                    copied = len(new)
                    bar.update(len(cells) - len(todo) + copied)
                    todo = [(p, b) for p, b in todo if cell_key(p, b) not in new]
                    started = time.perf_counter()
                    if todo:
                        if samples is None:
                            samples = retrieval.task_samples(model, task, n_tokens, num_samples, seed, num_records)
                        # strided: depths go in order over the samples, so each batch spans every depth and a
                        # partial run (max_batches) is not biased towards the start of the context
                        records = retrieval.answer_shared(
                            model, {cell_key(p, b): build_policy(p, b, dense_layers) for p, b in todo},
                            samples[index::batches], task, n_tokens, progress=bar,
                            question_in_prefill=question_in_prefill)
                        new.update({key: [r.score if r.score is not None else float(r.correct) for r in rs]
                                    for key, rs in records.items()})
                    have = {**have, **new}
                    seconds[(task, n_tokens)] = seconds.get((task, n_tokens), 0.0) + time.perf_counter() - started
                    ran += 1
                    if checkpoint:
                        line = {"task": task, "length": n_tokens, "batch": index, "scores": new,
                                "seconds": round(time.perf_counter() - started, 2), "setting": setting}
                        if copied:
                            line["reused_from"] = reuse
                        with open(checkpoint, "a") as f:
                            f.write(json.dumps(line) + "\n")
                else:
                    bar.update(len(cells))
                if have:
                    done[(task, n_tokens, index)] = have
            bar.close()
            # every (policy, budget) compiles its own steps; dropping them bounds the process's memory maps (a
            # long sweep otherwise ended in "LLVM compilation error: Cannot allocate memory" on a default
            # vm.max_map_count)
            if clear_compiled:
                jax.clear_caches()
    # the report covers every task, length and cell the checkpoint holds for this setting, not only those
    # named in this call (resuming one task must not drop the others from the tables)
    for (task, n_tokens, _), have in sorted(done.items(), key=lambda item: item[0][2]):
        for key, values in have.items():
            scores.setdefault((task, n_tokens, key), []).extend(values)
    report_tasks = list(dict.fromkeys([*tasks, *(t for t, _, _ in done)]))
    report_lengths = sorted({*lengths, *(n for _, n, _ in done)})
    report_cells = [parse_cell_key(key) for key in dict.fromkeys(
        [cell_key(p, b) for p, b in cells] + [key for have in done.values() for key in have])]
    report_policies = list(dict.fromkeys([*policies, *(p for p, _ in report_cells)]))
    report_budgets = sorted({*budgets, *(b for _, b in report_cells if b is not None)})
    rows = []
    for task in report_tasks:
        for n_tokens in report_lengths:
            for spec, budget in report_cells:
                values = scores.get((task, n_tokens, cell_key(spec, budget)))
                if values:
                    rows.append({"task": task, "length": n_tokens, "policy": spec, "budget": budget,
                                 "accuracy": float(np.mean(values)), "correct": int(sum(v == 1.0 for v in values)),
                                 "samples": len(values)})
    latency_rows = []
    if latency:
        for n_tokens in tqdm(lengths, desc="latency", disable=not progress):
            samples = retrieval.task_samples(model, tasks[0], n_tokens, latency_batch, seed, num_records)
            prompts = [retrieval.split_sample(model, s, tasks[0])[0] for s in samples]
            budget = max(budgets)
            timed = time_decodes(model, {p: build_policy(p, None if p == "full" else budget, dense_layers)
                                         for p in policies}, prompts)
            latency_rows += [{"length": n_tokens, "policy": p, "budget": None if p == "full" else budget, **timed[p]}
                             for p in policies]
    return {
        "machine": machine_info(), "policies": report_policies, "budgets": report_budgets, "lengths": report_lengths,
        "tasks": report_tasks, "num_samples": num_samples, "num_records": num_records, "dense_layers": dense_layers,
        "seed": seed, "question_in_prefill": question_in_prefill, "accuracy": rows, "latency": latency_rows,
        "seconds": {f"{t} {n}": round(v, 1) for (t, n), v in seconds.items()},
    }


def read_checkpoint(path: str | None, setting: dict) -> tuple[dict, dict]:
    """A sweep checkpoint's batches of `setting`: ({(task, length, batch): {cell key: [score per sample]}},
    {(task, length): seconds}); empty where `path` is None or missing."""
    done: dict = {}
    seconds: dict = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.pop("setting", None) == setting:
                    done.setdefault((row["task"], row["length"], row["batch"]), {}).update(row["scores"])
                    key = (row["task"], row["length"])
                    seconds[key] = seconds.get(key, 0.0) + row.get("seconds", 0.0)
    return done, seconds


def pool_batches(done: dict) -> dict:
    """{(task, cell key): {"scores": [...], "needle_kept": [...]}} over the batches `done` ({(task, batch):
    {cell key: {"scores", "needle_kept"}}}), batches in order."""
    pooled: dict = {}
    for (task, _), have in sorted(done.items()):
        for key, values in have.items():
            into = pooled.setdefault((task, key), {"scores": [], "needle_kept": []})
            into["scores"] += values["scores"]
            into["needle_kept"] += values["needle_kept"]
    return pooled
