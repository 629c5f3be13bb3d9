"""Locret scored by its oracle labels: each context token's label against the question and gold answer
(`kvjax.locret.labels`), and the Locret policy that evicts by those labels instead of its heads' predictions."""

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
