"""A served model's layers as allocator groups: which layers attend fully and which through a sliding
window, and the group specs that page them (Jenga: one group per kind; uniform: one group for all layers).

Pure host code (no jax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvjax.serving.specs import FullAttentionSpec, GroupSpec, SlidingWindowSpec, UniformPagingSpec

PAGINGS = ("jenga", "uniform")
FULL_GROUP = "full_attention"


def sliding_group_name(window: int) -> str:
    return f"sliding_window_{window}"


def alternating_windows(num_layers: int, window: int, first_sliding: bool = True) -> tuple[int | None, ...]:
    """Gemma-2's pattern: layers alternate a sliding window of `window` tokens and full attention
    (Gemma-2's layer 0 is a sliding one). None marks a full-attention layer."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    start = 0 if first_sliding else 1
    return tuple(window if (layer - start) % 2 == 0 else None for layer in range(num_layers))


@dataclass(frozen=True)
class LayerGroups:
    """How a model's layers map onto allocator groups.

    specs: the allocator's groups. layer_group[l]: the group of model layer l; layer_slot[l]: its index
    among the group's layers (the page's first axis); layer_window[l]: its window, 0 for full attention.
    Every group's page is read as [layers, 2 (k, v), tokens_per_page, kv_heads, head_dim] of `dtype`
    (a uniform paging group's uint8 page has exactly that size: every layer has the same KV shape).
    """

    specs: tuple[GroupSpec, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    layer_window: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str
    paging: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def group_layers(self, group: int) -> int:
        return sum(1 for g in self.layer_group if g == group)


def build_layer_groups(
    windows: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    tokens_per_page: int = 16,
    paging: str = "jenga",
) -> LayerGroups:
    """Groups for a model whose layer l has window windows[l] (0: full attention).

    paging "jenga": one FullAttentionSpec group of the full layers and one SlidingWindowSpec group per
    distinct window. "uniform" (the baseline, vLLM v0): one UniformPagingSpec group of every layer, in model
    order, holding every token of every layer for the request's life; the sliding layers still attend
    within their window (the model is the same), only the memory differs.
    """
    if paging not in PAGINGS:
        raise ValueError(f"paging must be one of {PAGINGS}, got {paging!r}")
    windows = tuple(windows)
    shape = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, tokens_per_page=tokens_per_page)
    kinds = sorted(set(windows), key=lambda w: (w != 0, w))  # full attention first, then by window
    specs: list[GroupSpec] = []
    for window in kinds:
        count = windows.count(window)
        if window == 0:
            specs.append(FullAttentionSpec(name=FULL_GROUP, num_layers=count, **shape))
        else:
            specs.append(SlidingWindowSpec(name=sliding_group_name(window), num_layers=count, window=window, **shape))
    if paging == "uniform":
        uniform = UniformPagingSpec(members=tuple(specs), tokens_per_page=tokens_per_page)
        expected = len(windows) * tokens_per_page * 2 * num_kv_heads * head_dim * specs[0].itemsize
        assert uniform.page_bytes == expected, "uniform page must hold [layers, 2, tokens, kv_heads, head_dim]"
        return LayerGroups(
            (uniform,), (0,) * len(windows), tuple(range(len(windows))), windows, num_kv_heads, head_dim, dtype, paging
        )
    layer_group, layer_slot = [], []
    seen = [0] * len(kinds)
    for window in windows:
        group = kinds.index(window)
        layer_group.append(group)
        layer_slot.append(seen[group])
        seen[group] += 1
    return LayerGroups(tuple(specs), tuple(layer_group), tuple(layer_slot), windows, num_kv_heads, head_dim, dtype, paging)


__all__ = [
    "FULL_GROUP",
    "LayerGroups",
    "PAGINGS",
    "alternating_windows",
    "build_layer_groups",
    "sliding_group_name",
]
