"""What limits a query-aware selector: at the question's last token, did each head's selection hold the
needle's page?

For one real-text sample of the sweep, full attention's mass on the needle per layer and query head is
measured over context + question (`trace_needle.needle_attention`): the heads that retrieve. The context is
prefilled once (`shared_prefill`), each selector's state derived from it, the question fed by decode, and at
its last token (whose logits give the first answer token) the pages every selecting layer and query head
reads are recorded (for the token oracle, the slots). Reported per selector: the share of the needle's mass (summed over layers and query
heads) whose head read a page holding the needle, the same over the layers >= dense_layers only, and the
layers whose top retrieving head missed it. JSON and Markdown.

    python -m eval.trace_selection --task real_passkey --length 2048 --samples 5 --num-samples 20 --budgets 64 128 \
        --policies quest:dense_layers=2 oracle_page:dense_layers=2 loki:dense_layers=2 key_int4:dense_layers=2
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import numpy as np

from .lib import retrieval
from .lib.needles import needle_attention, needle_span, value_span
from .lib.policies import build_policy
from .lib.report import default_out, markdown_table, write_outputs
from .lib.tables import recorded_load


@dataclasses.dataclass(frozen=True)
class RecordingSelect:
    """`inner`'s selection, each selecting layer's `int32[B, Hq, K]` sent to `record(layer, selected)` on
    the host. Every other attribute is `inner`'s (its sketch hooks too)."""

    inner: Any
    record: Any

    def __hash__(self):
        return hash((self.inner, id(self.record)))

    def __getattr__(self, name):
        if name in ("inner", "record"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def selector(self):  # the selector role is this recorder's (the inner policy's other roles stay its own)
        return self

    def select_pages(self, view):
        selected = self.inner.selector.select_pages(view)
        jax.debug.callback(self.record, view.layer, selected)
        return selected


def trace(model, task: str, length: int, sample_index: int, policies, budgets, seed: int = 0,
          num_samples: int = 50) -> dict:
    from kvjax.engine.generation import feed_tokens
    from kvjax.engine.shared_prefill import shared_prefill

    sample = retrieval.task_samples(model, task, length, num_samples, seed)[sample_index]
    span = needle_span(model, sample)
    values = value_span(model, sample, span)
    mass = needle_attention(model, sample.context_ids + sample.question_ids, values)  # [L, Hq]
    context, question, max_new = retrieval.split_sample(model, sample, task)
    built = {f"{p}@{b}": build_policy(p, b, 0) for b in budgets for p in policies}
    shared = shared_prefill(model, [context], list(built.values()), reserve_tokens=len(question) + max_new)
    value_pages = set(int(p) // 16 for p in values)
    out = {"task": task, "length": length, "sample": sample_index, "depth": sample.depth,
           "answer": sample.answer, "value_pages": sorted(value_pages), "mass": mass.tolist(), "budgets": list(budgets),
           "policies": {}}
    for name, policy in built.items():
        state, logits = retrieval.policy_state(model, shared, policy, [context], len(question) + max_new)
        hits = np.ones(mass.shape, bool)  # dense layers read every page
        # a token-level selector (`Selector.unit` "slot") lists slots: the value's positions, not its pages
        slots = policy.selector is not None and policy.selector.unit == "slot"
        targets = set(int(p) for p in values) if slots else value_pages

        def record(layer, selected, hits=hits, targets=targets):
            chosen = np.asarray(selected)[0]  # [Hq or H, K]
            if chosen.shape[0] != hits.shape[1]:
                chosen = np.repeat(chosen, hits.shape[1] // chosen.shape[0], axis=0)
            hits[int(layer)] = [bool(targets & set(row[row >= 0].tolist())) for row in chosen]

        # every question token's step records (one compile); the last one's selection is what stays
        recorder = RecordingSelect(policy, record)
        state, logits = feed_tokens(model, state, logits, np.asarray([question], np.int32), recorder)
        jax.block_until_ready(logits)
        dense = policy.dense_layers
        selecting = mass[dense:]
        out["policies"][name] = {
            "hits": hits.tolist(),
            "mass_read": float((mass * hits).sum() / mass.sum()),
            "mass_read_selecting_layers": float((selecting * hits[dense:]).sum() / selecting.sum()),
            "missed_layers": [int(l) for l in range(dense, mass.shape[0]) if not hits[l, int(mass[l].argmax())]],
        }
    return out


def trace_table(result: dict) -> str:
    mass = np.asarray(result["mass"])
    top = np.argsort(mass.max(1))[::-1][:6]
    rows = [[name, f"{100 * r['mass_read']:.0f}%", f"{100 * r['mass_read_selecting_layers']:.0f}%",
             " ".join(str(l) for l in r["missed_layers"]) or "none"] for name, r in result["policies"].items()]
    head = (f"Selection trace: {result['task']}, {result['length']} tokens, sample {result['sample']} (depth "
            f"{result['depth']:.2f}, answer {result['answer']}), budgets {result['budgets']}; value on pages "
            f"{result['value_pages']}. Layers with the most mass on the value: "
            f"{', '.join(f'{l} ({mass[l].max():.2f})' for l in top)}\n\n")
    return head + markdown_table(["selector", "needle mass read (all layers)", "in selecting layers",
                                  "layers whose top head missed it"], rows)


def render(payload: dict) -> str:
    """The committed JSON as the docs show it: `trace_table` of each traced sample, with the run's load."""
    return "\n".join(trace_table(r) for r in payload["results"]) + "\n" + recorded_load(payload)


def main(argv=None) -> dict:
    import kvjax

    parser = argparse.ArgumentParser(description="Whether each selector's heads read the needle's page")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="real_passkey", choices=list(retrieval.REAL_TASKS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, nargs="+", default=[0], help="which of the sweep's samples")
    parser.add_argument("--num-samples", type=int, default=50, help="the sweep's --samples (sample i at depth i / (n - 1))")
    parser.add_argument("--policies", nargs="+", default=["quest:dense_layers=2", "oracle_page:dense_layers=2"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128])
    parser.add_argument("--out", default=default_out("trace_selection"))
    args = parser.parse_args(argv)
    model = kvjax.load_model(args.model)
    results, tables = [], []
    for index in args.samples:
        result = trace(model, args.task, args.length, index, args.policies, args.budgets, num_samples=args.num_samples)
        results.append(result)
        tables.append(trace_table(result))
        print(tables[-1], flush=True)
    name = f"selection_{args.task}_{args.length}_s{'-'.join(map(str, args.samples))}"
    write_outputs(args.out, name, {"benchmark": "trace_selection", "results": results}, "\n".join(tables))
    return {"results": results}


if __name__ == "__main__":
    main()
