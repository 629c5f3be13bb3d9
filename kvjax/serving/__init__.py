"""Serving: the batch engine (`batch_engine.BatchEngine`), which serves every policy with `generate`'s own
prefill, step, state and decode loop, and the HTTP server over it (`http`); and Jenga's memory manager for
caches whose layers differ in per-token size: layer-group specs, a two-level page allocator, prefix caching
aligned across group types, and typed jnp views of its one uint8 device pool (docs/jenga.md says where
it fits).

The allocator's modules (specs, layout, page_pool, prefix_cache, allocator, model_groups) are pure Python;
`views` and `batch_engine` import jax and are loaded on first use.
"""

from kvjax.serving.allocator import (
    Allocation,
    CommitResult,
    GroupStats,
    JengaAllocator,
    PageCopy,
    PoolStats,
    RequestTooLargeError,
    StalePrefixHitError,
)
from kvjax.hashing import ROOT_HASH, chain_hashes, hash_block
from kvjax.serving.layout import PoolLayout, choose_large_page_bytes
from kvjax.serving.model_groups import alternating_windows
from kvjax.serving.prefix_cache import PrefixHit, longest_common_hit
from kvjax.serving.specs import (
    AuxiliaryModelSpec,
    BudgetedSpec,
    FullAttentionSpec,
    GroupSpec,
    QuestMetadataSpec,
    SlidingWindowSpec,
    UniformPagingSpec,
)

_VIEW_NAMES = (
    "make_pool", "typed_view", "reinterpret_pages", "read_typed_pages", "write_typed_pages", "apply_page_copies",
)
_BATCH_ENGINE_NAMES = ("BatchEngine", "BatchRequest")


def __getattr__(name: str):
    if name in _VIEW_NAMES:
        from kvjax.serving import views

        return getattr(views, name)
    if name in _BATCH_ENGINE_NAMES:
        from kvjax.serving import batch_engine

        return getattr(batch_engine, name)
    raise AttributeError(f"module 'kvjax.serving' has no attribute {name!r}")


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
    "SlidingWindowSpec",
    "StalePrefixHitError",
    "UniformPagingSpec",
    "alternating_windows",
    "chain_hashes",
    "choose_large_page_bytes",
    "hash_block",
    "longest_common_hit",
    *_VIEW_NAMES,
    *_BATCH_ENGINE_NAMES,
]
