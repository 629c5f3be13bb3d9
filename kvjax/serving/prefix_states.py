"""A prefix cache of prefill carries: the batch engine's prefix hits.

Notes: docs/modules.md (`kvjax/serving/prefix_states.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp

from kvjax.engine.generation import PrefillCarry
from kvjax.util.hashing import chain_hashes
from kvjax.util.lru import BytesLRU
from kvjax.cache.rows import narrow_row
from kvjax.util.trees import copied


def chunk_boundaries(prompt: Sequence[int], chunk: int) -> list[tuple[int, bytes]]:
    """`(tokens, chained hash of prompt[:tokens])` at every whole chunk of `prompt`: computed once per
    prompt, used for lookup, storing and page sharing."""
    return [((i + 1) * chunk, digest) for i, digest in enumerate(chain_hashes([int(t) for t in prompt], chunk))]


def carry_bytes(carry: PrefillCarry) -> int:
    """Device bytes an entry holds."""
    return sum(x.nbytes for x in jax.tree.leaves((carry.state, carry.last_queries, carry.logits)))


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens whose prefill a hit skipped
    prompt_tokens: int = 0  # prompt tokens looked up
    stored: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixStates:
    """Prefill carries at chunk boundaries, keyed by `(key, chained hash of the prompt's first chunks)`, in a
    `BytesLRU` of `max_bytes` (or in `lru`, shared with other stores such as `kvjax.rag.ChunkStore`)."""

    def __init__(self, max_bytes: int = 0, lru: BytesLRU | None = None):
        self.lru = lru if lru is not None else BytesLRU(max_bytes)
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return sum(1 for k in self.lru.keys() if k[0] == _NAMESPACE)

    @property
    def bytes(self) -> int:
        return sum(self.lru.size_of(k) for k in self.lru.keys() if k[0] == _NAMESPACE)

    def sizes(self) -> list[int]:
        return [self.lru.size_of(k) for k in self.lru.keys() if k[0] == _NAMESPACE]

    def clear(self) -> None:
        """Drop every entry (the statistics stay)."""
        self.lru.remove_if(lambda k: k[0] == _NAMESPACE)

    def lookup(self, key: Hashable, boundaries: Sequence[tuple[int, bytes]], prompt_tokens: int) -> PrefillCarry | None:
        """The carry at the longest of a prompt's chunk `boundaries` (`chunk_boundaries`) cached under `key`,
        or None; `prompt_tokens` (the prompt's length) feeds the hit rate."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_tokens
        for tokens, digest in reversed(boundaries):
            carry = self.lru.get((_NAMESPACE, key, digest))
            if carry is not None:
                self.stats.hits += 1
                self.stats.hit_tokens += tokens
                return carry
        return None

    def store(self, key: Hashable, boundaries: Sequence[tuple[int, bytes]], carry: PrefillCarry) -> None:
        """Keep a compact copy of `carry`, the prefill up to one of the prompt's chunk `boundaries`
        (`carry.tokens`), unless it is cached already or alone larger than the cache. A carry between the
        boundaries (a prompt shorter than the engine's chunk prefills in smaller chunks) is not kept."""
        digest = dict(boundaries).get(carry.tokens)
        if digest is None:
            return
        name = (_NAMESPACE, key, digest)
        if name in self.lru:
            self.lru.get(name)
            return
        if self.lru.max_bytes == 0:
            return
        copy = PrefillCarry(narrow_row(carry.state), copied(carry.last_queries),
                            jnp.copy(carry.logits), carry.tokens)
        evicted = self.lru.evicted
        if self.lru.put(name, copy, carry_bytes(copy)):
            self.stats.stored += 1
        self.stats.evicted += self.lru.evicted - evicted


_NAMESPACE = "prefill"
