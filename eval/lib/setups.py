"""Shapes and byte counts several benchmarks share: page tables as the allocator lays them out, the
attention-heavy model config, and the bytes a selecting decode step reads."""

from __future__ import annotations

import numpy as np


def chunked_page_tables(num_layers, num_kv_heads, max_pages, pages_per_chunk):
    """Page tables as kvjax's allocator builds them on a prefill in chunks: each chunk hands every
    (layer, kv head) in turn `pages_per_chunk` consecutive pages. int32[L, 1, KVH, P]."""
    layer = np.arange(num_layers)[:, None, None]
    head = np.arange(num_kv_heads)[None, :, None]
    page = np.arange(max_pages)[None, None, :]
    chunk = page // pages_per_chunk
    physical = ((chunk * num_layers + layer) * num_kv_heads + head) * pages_per_chunk + page % pages_per_chunk
    return physical.astype(np.int32)[:, None]


def step_bytes(selector: str, n: int, budget: int, *, head_dim: int = 64, page_size: int = 16, group: int = 3,
               rank: int = 16, kv_itemsize: int = 4) -> dict:
    """{metadata, scores, chosen, total}: bytes one decode step reads per (layer, kv head)."""
    pages = -(-n // page_size)
    kv_slot = 2 * head_dim * kv_itemsize
    if selector == "full":
        return {"metadata": 0, "scores": 0, "chosen": n * kv_slot, "total": n * kv_slot}
    metadata = {
        "quest": pages * 2 * head_dim * 4,
        "oracle_page": n * head_dim * kv_itemsize,
        "oracle_token": n * head_dim * kv_itemsize,
        "loki": n * rank * 2 + head_dim * rank * 4,
        "key_int4": n * head_dim // 2 + head_dim * 4,
    }[selector]
    rows = n if selector == "oracle_token" else pages
    scores = 4 * rows * group + 4 * pages
    chosen = group * min(budget, n) * kv_slot
    return {"metadata": metadata, "scores": scores, "chosen": chosen, "total": metadata + scores + chosen}


def param_bytes(params) -> int:
    """Bytes of every array in a parameter tree."""
    import jax

    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params)))


def attention_heavy_config(vocab: int):
    return {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
        "max_position_embeddings": 65536, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
