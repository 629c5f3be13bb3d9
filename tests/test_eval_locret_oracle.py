"""eval.locret_oracle: Locret scored by given labels evicts exactly by them, chunk by chunk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions
from kvjax.eval.locret_oracle import LabelScoredLocret

CHUNK, BUDGET, TAIL, STABLE = 32, 24, 8, 6  # evict budget b = BUDGET - TAIL = 16


def test_label_scored_locret_keeps_its_labels_top_per_chunk(hf_models):
    """Two chunks and a tail. Chunk one (not the last) keeps its STABLE newest slots and the labels' top of
    the rest; chunk two (the last) keeps the labels' top of what survived and its own tokens; the tail is
    appended without eviction. Rows are padded to different lengths, so labels are read by position."""
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    T = 2 * CHUNK + TAIL
    labels = np.random.default_rng(0).normal(size=(L, 2, T, H)).astype(np.float32)
    policy = LabelScoredLocret(token_budget=BUDGET, stabilizers=STABLE, local_tail=TAIL, labels=jnp.asarray(labels))
    tokens = random_tokens(3, (2, T))
    rows = [tokens[0], tokens[1, : T - 5]]  # the second row: its last chunk is short
    state, _ = kvjax.prefill(model, rows, policy=policy, chunk_size=CHUNK, page_size=8, max_new_tokens=4)
    kept = kept_positions(state)
    b = BUDGET - TAIL
    for row, n in enumerate(len(r) for r in rows):
        evicted = n - TAIL  # the prompt before its tail: two chunks
        for layer in range(L):
            for h in range(H):
                score = labels[layer, row, :, h]
                first = {int(i) for i in np.argsort(-score[: CHUNK - STABLE])[: b - STABLE]} | set(range(CHUNK - STABLE, CHUNK))
                candidates = np.array(sorted(first | set(range(CHUNK, evicted))))
                final = {int(i) for i in candidates[np.argsort(-score[candidates])[:b]]}
                assert set(kept[layer][row][h].tolist()) == final | set(range(evicted, n)), (row, layer, h)
