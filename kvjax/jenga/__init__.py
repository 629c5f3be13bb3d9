"""Jenga's memory manager for caches whose layers differ in per-token size: layer-group specs, a two-level
page allocator, prefix caching aligned across group types, and typed jnp views of one uint8 device pool.

Notes: docs/modules.md (`kvjax/jenga/__init__.py`)."""

from kvjax.jenga.allocator import (
    Allocation,
    CommitResult,
    GroupStats,
    JengaAllocator,
    PageCopy,
    PoolStats,
    RequestTooLargeError,
    StalePrefixHitError,
)
from kvjax.jenga.layout import PoolLayout, choose_large_page_bytes
from kvjax.jenga.model_groups import alternating_windows
from kvjax.jenga.prefix_cache import PrefixHit, longest_common_hit
from kvjax.jenga.specs import (
    AuxiliaryModelSpec,
    BudgetedSpec,
    FullAttentionSpec,
    GroupSpec,
    QuestMetadataSpec,
    RingWindowSpec,
    SlidingWindowSpec,
    UniformPagingSpec,
)
from kvjax.util.hashing import ROOT_HASH, chain_hashes, hash_block

_VIEW_NAMES = (
    "make_pool", "typed_view", "reinterpret_pages", "read_typed_pages", "write_typed_pages", "apply_page_copies",
)


def __getattr__(name: str):
    if name in _VIEW_NAMES:
        from kvjax.jenga import views

        return getattr(views, name)
    raise AttributeError(f"module 'kvjax.jenga' has no attribute {name!r}")


__all__ = [
    "Allocation",
    "AuxiliaryModelSpec",
    "BudgetedSpec",
    "CommitResult",
    "FullAttentionSpec",
    "GroupSpec",
    "GroupStats",
    "JengaAllocator",
    "PageCopy",
    "PoolLayout",
    "PoolStats",
    "PrefixHit",
    "QuestMetadataSpec",
    "ROOT_HASH",
    "RequestTooLargeError",
    "RingWindowSpec",
    "SlidingWindowSpec",
    "StalePrefixHitError",
    "UniformPagingSpec",
    "alternating_windows",
    "chain_hashes",
    "choose_large_page_bytes",
    "hash_block",
    "longest_common_hit",
    *_VIEW_NAMES,
]
