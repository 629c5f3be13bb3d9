"""Locret scored by its oracle labels: each context token's label against the question and gold answer
(`kvjax.locret.labels`), the Locret policy that evicts by those labels instead of its heads' predictions,
and a Locret that reports each appended token's score and each chunk's kept slots to the host (traces)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.locret.labels import Batch, compute_targets
from kvjax.policies.base import ChunkSchedule
from kvjax.policies.locret import Locret, with_sinks


def label_scores(layer, inputs, labels) -> jax.Array:
    """f32[B, C, H]: each appended token's label, looked up by its position in `labels f32[L, B, Tp, H]`."""
    table = labels[layer]  # [B, Tp, H]
    index = jnp.clip(inputs.positions, 0, table.shape[1] - 1)
    return jnp.take_along_axis(table, index[:, :, None], axis=1)


@dataclasses.dataclass(frozen=True)
class LabelScoredLocret(Locret):
    """Locret whose scores are the tokens' labels (`f32[L, B, Tp, H]`, rows in prefill order) instead of a
    retaining head's predictions. The labels are data, as the heads are: policies that differ only in them
    share compiled steps."""

    labels: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.labels is None:
            raise ValueError("LabelScoredLocret needs labels= (f32[L, B, Tp, H], from kvjax.locret.labels)")
        self.set_defaults({})

    @property
    def chunks(self) -> ChunkSchedule:
        return ChunkSchedule(tail=self.local_tail, score=with_sinks(label_scores, self.sink_size), params=self.labels)


# what `RecordedLocret`'s host callbacks report, row 0 only; one recorded prefill at a time (`recorded_prefill`)
RECORD: dict = {"scores": [], "kept": []}


def _on_score(layer, positions, scores):
    RECORD["scores"].append((int(layer), np.asarray(positions), np.asarray(scores)))


def _on_keep(layer, seen, slot_pos, keep):
    RECORD["kept"].append((int(layer), int(seen), [p[k[k >= 0]] for p, k in zip(np.asarray(slot_pos), np.asarray(keep))]))


@dataclasses.dataclass(frozen=True)
class RecordedLocret(Locret):
    """Locret (its heads, its eviction) that reports row 0 to the host as it prefills: every appended token's
    score (`RECORD["scores"]`: layer, positions int[C], scores f32[C, H]) and every chunk's eviction
    (`RECORD["kept"]`: layer, tokens seen so far, kept positions per kv head). `recorded_prefill` reads them."""

    @property
    def chunks(self) -> ChunkSchedule:
        inner = super().chunks

        def score(layer, inputs, params):
            scores = inner.score(layer, inputs, params)
            jax.debug.callback(_on_score, layer, inputs.positions[0], scores[0])
            return scores

        return inner._replace(score=score)

    def compress_layer(self, view, keep_bound: int):
        keep, budgets = super().compress_layer(view, keep_bound)
        jax.debug.callback(_on_keep, view.layer, view.next_position[0], view.slot_pos[0], keep[0])
        return keep, budgets


def recorded_prefill(model, policy: Locret, context, reserve: int, chunk_size: int):
    """`(state, logits, scores f32[L, T, H], kept {tokens seen: [layer][kv head] -> positions})` of one row
    `context` (T tokens, the local tail's scores included) prefilled by `policy` (a Locret, its options kept)
    in chunks of `chunk_size`."""
    from .retrieval import policy_state

    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(Locret)}
    recorded = RecordedLocret(**fields)
    RECORD["scores"].clear()
    RECORD["kept"].clear()
    state, logits = policy_state(model, None, recorded, [context], reserve, chunk_size=chunk_size)
    jax.effects_barrier()
    T, L = len(context), model.cfg.num_layers
    scores = np.full((L, T, model.cfg.num_kv_heads), np.nan, np.float32)
    for layer, positions, values in RECORD["scores"]:
        real = positions < T  # a padded chunk's rows past the prompt
        scores[layer, positions[real]] = values[real]
    kept: dict = {}
    for layer, seen, per_head in RECORD["kept"]:
        kept.setdefault(seen, [None] * L)[layer] = per_head
    return state, logits, scores, dict(sorted(kept.items()))


# compiled once per (cfg, dtype, chunk, shapes), not once per call
_labels_only = jax.jit(functools.partial(compute_targets, features=False), static_argnames=("cfg", "dtype", "chunk_size"))


def batch_labels(model, prefixes, answers, chunk: int, rows_at_once: int = 5) -> np.ndarray:
    """f32[L, B, Tp, H]: the labels of each row's prefix tokens (`prefixes[b]`, token ids) against its answer
    (`answers[b]`: in the oracle, the question fed by decode and the gold answer); Tp is the longest prefix
    rounded up to `chunk`."""
    Tp = -(-max(map(len, prefixes)) // chunk) * chunk
    A = max(map(len, answers))
    out = []
    for start in range(0, len(prefixes), rows_at_once):
        rows = range(start, min(start + rows_at_once, len(prefixes)))
        prefix = np.zeros((len(rows), Tp), np.int32)
        answer = np.zeros((len(rows), A), np.int32)
        for i, r in enumerate(rows):
            prefix[i, : len(prefixes[r])] = prefixes[r]
            answer[i, : len(answers[r])] = answers[r]
        batch = Batch(jnp.asarray(prefix), jnp.asarray([len(prefixes[r]) for r in rows], jnp.int32),
                      jnp.asarray(answer), jnp.asarray([len(answers[r]) for r in rows], jnp.int32))
        out.append(np.asarray(_labels_only(model.params, batch, cfg=model.cfg, dtype=model.dtype, chunk_size=chunk).labels))
    return np.concatenate(out, axis=1)
