"""Prefix caching across group types: per-group maps from chained block hash to page, the per-type hit
rules combined into the longest prefix valid for every group, and eviction aligned across groups."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvjax.util.hashing import chain_hashes
from kvjax.jenga.page_pool import Journal, TwoLevelPagePool
from kvjax.jenga.specs import GroupSpec, base_hash_block_tokens, hit_alignment


def longest_common_hit(
    specs: Sequence[GroupSpec],
    limit: int,
    is_cached: Sequence[Callable[[int], bool]],
    alignment: int | None = None,
) -> int:
    """Longest prefix length L <= limit that every group can reuse, a multiple of `alignment` (default:
    the LCM of the groups' page lengths).

    `is_cached[g](end)` says whether group g's cache entry for the prefix ending at token `end` exists.
    Each group's rule (GroupSpec.largest_hit) gives its largest valid length <= L; L shrinks to the
    smallest of them until every group accepts it. Every length valid for all groups and <= limit stays
    <= L throughout, so the fixed point is the longest common one.
    """
    step = alignment or hit_alignment(specs)
    length = limit // step * step
    while length > 0:
        agreed = True
        for spec, cached in zip(specs, is_cached):
            group_length = spec.largest_hit(length, cached) // step * step
            if group_length < length:
                length, agreed = group_length, False
        if agreed:
            break
    return max(length, 0)


@dataclass(frozen=True)
class PrefixHit:
    """Result of `JengaAllocator.get_computed_prefix`.

    num_tokens: length of the reusable prefix (0 when nothing is reusable).
    pages: per group name, the page ids the request can reuse, one per block of the prefix; -1 for blocks
        the group no longer needs (a sliding window's blocks before its last window). For a budgeted
        group: the snapshot's pages, which the allocator copies into fresh pages of the request.
    token_ids, block_hashes: the prefix's tokens and its base-block chain hashes (internal use).
    shared_prefix_tokens: how far the full-attention groups alone match the cache (>= num_tokens): where
        this prompt leaves a known shared prefix, even when other groups' blocks there are gone.
    """

    num_tokens: int
    pages: dict[str, tuple[int, ...]]
    token_ids: tuple[int, ...] = field(repr=False)
    block_hashes: tuple[bytes, ...] = field(repr=False)
    shared_prefix_tokens: int = 0


class PrefixCache:
    """Maps (group, chained hash of the prefix ending at a page's end) to the page holding it.

    A positional group's page for block [e - tokens_per_page, e) is keyed by the hash of tokens[:e]; a
    budgeted group's snapshot after e tokens is keyed the same way. Hashes are computed over base blocks
    of gcd(tokens_per_page) tokens so every group's boundaries have one.
    """

    def __init__(self, specs: Sequence[GroupSpec], pool: TwoLevelPagePool, journal: Journal) -> None:
        self.specs = tuple(specs)
        self.pool = pool
        self.journal = journal
        self.base_tokens = base_hash_block_tokens(self.specs)
        self.alignment = hit_alignment(self.specs)
        self.page_of_hash: list[dict[bytes, tuple[int, ...]]] = [{} for _ in self.specs]
        self.hash_of_page: list[dict[int, bytes]] = [{} for _ in self.specs]

    # --- hashes ---------------------------------------------------------------------------------------
    def hash_at(self, block_hashes: Sequence[bytes], end: int) -> bytes:
        """Hash naming the prefix tokens[:end] (`end` a positive multiple of the base block)."""
        return block_hashes[end // self.base_tokens - 1]

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return chain_hashes(token_ids, self.base_tokens)

    # --- entries ---------------------------------------------------------------------------------------
    def lookup(self, group: int, block_hash: bytes) -> tuple[int, ...] | None:
        """Pages cached under `block_hash` for `group`: one page for a positional group, the snapshot's
        pages for a budgeted group; None if absent."""
        return self.page_of_hash[group].get(block_hash)

    def register(self, group: int, pages: Sequence[int], block_hash: bytes, prefix_end: int) -> bool:
        """Caches live pages under `block_hash`. False (nothing done) if the hash already has an entry (a
        duplicate computed by a concurrent request stays private to it)."""
        pages = tuple(pages)
        if block_hash in self.page_of_hash[group] or any(p in self.hash_of_page[group] for p in pages):
            return False
        self.page_of_hash[group][block_hash] = pages
        for page in pages:
            self.hash_of_page[group][page] = block_hash

        def undo() -> None:
            del self.page_of_hash[group][block_hash]
            for page in pages:
                del self.hash_of_page[group][page]

        self.journal.record(undo)
        for page in pages:
            self.pool.mark_cached(group, page, prefix_end)
        return True

    def unregister(self, group: int, block_hash: bytes) -> None:
        """Forgets an entry; its evictable pages become free, live ones stay with their owners."""
        pages = self.page_of_hash[group].pop(block_hash)
        for page in pages:
            del self.hash_of_page[group][page]

        def undo() -> None:
            self.page_of_hash[group][block_hash] = pages
            for page in pages:
                self.hash_of_page[group][page] = block_hash

        self.journal.record(undo)
        for page in pages:
            self.pool.unmark_cached(group, page)

    def is_evictable_entry(self, group: int, block_hash: bytes) -> bool:
        pages = self.page_of_hash[group].get(block_hash)
        return pages is not None and all(self.pool.refcount[group][p] == 0 for p in pages)

    def evict(self, group: int, page: int) -> None:
        """Evicts the entry holding an evictable page, all its pages together (a budgeted snapshot spans
        several). If the group needs the whole prefix (full attention, Quest metadata, an auxiliary
        model), no prefix ending at or past this page can hit any more, so every group's evictable entry
        for the same prefix is evicted with it."""
        block_hash = self.hash_of_page[group][page]
        if not self.is_evictable_entry(group, block_hash):
            raise ValueError(f"page {page} of group {self.specs[group].name!r} belongs to a live cache entry")
        self.unregister(group, block_hash)
        if not self.specs[group].requires_full_prefix:
            return
        for other in range(len(self.specs)):
            if other != group and self.is_evictable_entry(other, block_hash):
                self.unregister(other, block_hash)

    # --- hits -----------------------------------------------------------------------------------------
    def find_hit(self, token_ids: Sequence[int], max_tokens: int | None = None, alignment: int | None = None):
        """(hit length, base-block hashes of token_ids, per-group page lists, full-attention match length)
        for the longest reusable prefix of `token_ids`, at most `max_tokens` (default len(token_ids) - 1:
        the last token is always computed so the step yields logits), a multiple of `alignment` as well as
        of the groups' page lengths (the engine's chunk: only whole chunks are prefilled alike)."""
        hashes = self.block_hashes(token_ids)
        limit = len(token_ids) - 1 if max_tokens is None else min(max_tokens, len(token_ids))
        limit = min(limit, len(hashes) * self.base_tokens)
        memo: list[dict[int, bool]] = [{} for _ in self.specs]

        def cached_fn(group: int) -> Callable[[int], bool]:
            page_of_hash, seen = self.page_of_hash[group], memo[group]

            def is_cached(end: int) -> bool:
                if end not in seen:
                    seen[end] = self.hash_at(hashes, end) in page_of_hash
                return seen[end]

            return is_cached

        lookups = [cached_fn(g) for g in range(len(self.specs))]
        step = self.alignment if alignment is None else math.lcm(self.alignment, alignment)
        length = longest_common_hit(self.specs, max(limit, 0), lookups, step)
        pages = [self._hit_pages(g, hashes, length) for g in range(len(self.specs))]
        shared = max(limit, 0)
        for group, spec in enumerate(self.specs):
            if spec.is_positional and spec.requires_full_prefix:
                shared = min(shared, spec.largest_hit(shared, lookups[group]))
        return length, hashes, pages, max(shared, length) if any(
            s.is_positional and s.requires_full_prefix for s in self.specs
        ) else length

    def _hit_pages(self, group: int, hashes: Sequence[bytes], length: int) -> list[int]:
        spec = self.specs[group]
        if length == 0 or not spec.caches_prefix:
            return []
        if not spec.is_positional:
            return list(self.page_of_hash[group][self.hash_at(hashes, length)])
        tpp = spec.tokens_per_page
        first_block = spec.first_needed_token(length) // tpp
        return [-1] * first_block + [
            self.page_of_hash[group][self.hash_at(hashes, (block + 1) * tpp)][0]
            for block in range(first_block, length // tpp)
        ]
