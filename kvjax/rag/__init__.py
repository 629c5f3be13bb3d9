"""CacheClip and baselines for RAG: reusable chunk KV caches, assembly, and selective recomputation
(docs/cacheclip.md).

Notes: docs/modules.md (`kvjax/rag/__init__.py`)."""

from kvjax.rag.assemble import AssembledContext, assemble
from kvjax.rag.baselines import cacheblend_prefill, direct_reuse, full_prefill
from kvjax.rag.pipeline import METHODS, greedy_continue, rag_prefill
from kvjax.rag.prefill import RagPrefill, recompute
from kvjax.rag.recompute import AuxScorer, cacheclip_prefill, group_windows, truncated_model
from kvjax.rag.rope_shift import RopeShiftError, rotate_keys, shift_keys
from kvjax.rag.store import ChunkKV, ChunkMismatchError, ChunkStore, Fingerprint, model_fingerprint

__all__ = [
    "AssembledContext",
    "AuxScorer",
    "ChunkKV",
    "ChunkMismatchError",
    "ChunkStore",
    "Fingerprint",
    "METHODS",
    "RagPrefill",
    "RopeShiftError",
    "assemble",
    "cacheblend_prefill",
    "cacheclip_prefill",
    "direct_reuse",
    "full_prefill",
    "greedy_continue",
    "group_windows",
    "model_fingerprint",
    "rag_prefill",
    "recompute",
    "rotate_keys",
    "shift_keys",
    "truncated_model",
]
