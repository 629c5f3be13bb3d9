"""Paged decode-attention kernels for kvjax: Quest page scoring, top-page selection, sparse and dense
paged decode. Each kernel has a pure-jnp reference (the oracle), a tuned XLA path (the CPU default), a
Pallas Mosaic TPU kernel and a Pallas GPU kernel; `backend=` overrides the choice by platform."""

from ._backend import resolve_backend, target_platform
from ._quant import (
    BFLOAT16_BITS,
    bfloat16_bits,
    dequantize,
    is_bfloat16_bits,
    page_values,
    quantize_int8,
)
from .decode_reference import paged_decode_reference, sparse_paged_decode_reference
from .paged_decode import paged_decode, sparse_paged_decode
from .sketch_scores import sketch_page_scores, sketch_page_scores_reference
from .quest_scores import (
    quest_page_scores,
    quest_page_scores_reference,
    select_top_pages,
    select_top_pages_reference,
)

__all__ = [
    "target_platform",
    "BFLOAT16_BITS",
    "bfloat16_bits",
    "dequantize",
    "is_bfloat16_bits",
    "page_values",
    "quantize_int8",
    "quest_page_scores",
    "quest_page_scores_reference",
    "select_top_pages",
    "select_top_pages_reference",
    "sketch_page_scores",
    "sketch_page_scores_reference",
    "sparse_paged_decode",
    "sparse_paged_decode_reference",
    "paged_decode",
    "paged_decode_reference",
    "resolve_backend",
]
