"""Serving-side memory management (Jenga): layer-group specs, a two-level page allocator for
heterogeneous KV caches, prefix caching aligned across group types, typed jnp views of the pool, and a
continuous-batching engine that serves a model over them (full attention and sliding windows); and the
batch engine (`batch_engine.BatchEngine`) that serves every policy with `generate`'s own prefill, step
and decode loop.

Host-side modules (specs, layout, hashing, page_pool, prefix_cache, allocator, model_groups) are pure
Python; `views`, `paged_step`, `engine` and `batch_engine` import jax and are loaded on first use.
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
from kvjax.serving.model_groups import LayerGroups, alternating_windows, build_layer_groups
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
_ENGINE_NAMES = ("Engine", "EngineMetrics", "RequestOutput")
_BATCH_ENGINE_NAMES = ("BatchEngine", "BatchRequest")


def __getattr__(name: str):
    if name in _VIEW_NAMES:
        from kvjax.serving import views

        return getattr(views, name)
    if name in _ENGINE_NAMES:
        from kvjax.serving import engine

        return getattr(engine, name)
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
    "LayerGroups",
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
    "build_layer_groups",
    "chain_hashes",
    "choose_large_page_bytes",
    "hash_block",
    "longest_common_hit",
    *_VIEW_NAMES,
    *_ENGINE_NAMES,
    *_BATCH_ENGINE_NAMES,
]
