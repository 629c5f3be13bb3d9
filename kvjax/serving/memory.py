"""What a decode batch's pages hold, sampled between dispatches, and what other paging schemes would hold
for the same rows.

Notes: docs/modules.md (`kvjax/serving/memory.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvjax.cache.state import KVState


@dataclass(frozen=True)
class MemorySample:
    """One batch between two dispatches. Slot counts are over every layer and kv head of the live rows.

    held_slots: slots of the distinct pages the live rows reference (page_size each);
    row_held_slots: the same counted per row (a shared page once per row that references it);
    kept_slots: slots in the distinct pages that hold a token; row_kept_slots: per row, as row_held_slots;
    seen_tokens: per live row, the tokens it has seen (its next position);
    kept: per live row, int[L, H] slots kept per layer and kv head."""

    dispatch: int
    page_size: int
    held_slots: int
    row_held_slots: int
    kept_slots: int
    row_kept_slots: int
    seen_tokens: tuple[int, ...]
    kept: tuple[np.ndarray, ...]


def sample_memory(state: KVState, rows: list[int], dispatch: int = 0) -> MemorySample:
    """Read `state`'s live `rows` (indices of sequences) on the host (see MemorySample)."""
    table = np.asarray(state.page_table)  # [L, B, H, P]
    valid = np.asarray(state.slot_pos) >= 0  # [N, ps]
    lengths = np.asarray(state.lengths)  # [L, B, H]
    positions = np.asarray(state.next_position)
    ps = state.page_size
    row_pages = [table[:, b][table[:, b] >= 0] for b in rows]
    distinct = np.unique(np.concatenate(row_pages)) if row_pages else np.zeros(0, np.int64)
    return MemorySample(
        dispatch=dispatch,
        page_size=ps,
        held_slots=int(distinct.size * ps),
        row_held_slots=int(sum(p.size for p in row_pages) * ps),
        kept_slots=int(valid[distinct].sum()),
        row_kept_slots=int(sum(valid[p].sum() for p in row_pages)),
        seen_tokens=tuple(int(positions[b]) for b in rows),
        kept=tuple(lengths[:, b].copy() for b in rows),
    )


def uniform_slots(sample: MemorySample, page_tokens: int = 16) -> int:
    """Slots vLLM v0's uniform paging holds for the sample's rows: every token seen, every layer and head."""
    total = 0
    for seen, kept in zip(sample.seen_tokens, sample.kept):
        layers, heads = kept.shape
        total += -(-seen // page_tokens) * page_tokens * layers * heads
    return total


def grouped_slots(sample: MemorySample, page_tokens: int = 16) -> int:
    """Slots Jenga's paging holds with a group per layer: per layer, pages for its fullest kv head."""
    total = 0
    for kept in sample.kept:
        heads = kept.shape[1]
        most = kept.max(axis=1)  # [L]
        total += int((-(-most // page_tokens) * page_tokens * heads).sum())
    return total


def waste(held: int, kept: int) -> float:
    """Share of held slots that hold nothing attention reads."""
    return 1.0 - kept / held if held else 0.0


__all__ = ["MemorySample", "grouped_slots", "sample_memory", "uniform_slots", "waste"]
