"""The batch engine's pages from Jenga's two-level pool: a decode batch's layers and kv heads grouped by
lifetime and size, each group's small pages mapped onto the device pool's single-head pages."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvjax.engine.step import compressor_acts
from kvjax.jenga.allocator import JengaAllocator, PrefixHit
from kvjax.jenga.layout import choose_large_page_bytes
from kvjax.jenga.specs import BudgetedSpec, FullAttentionSpec, GroupSpec, RingWindowSpec
from kvjax.models.config import ModelConfig
from kvjax.policies import Policy

FULL = "full"


def layer_groups(cfg: ModelConfig, policy: Policy, heads: int, page_size: int, dtype: str, uniform: bool = False
                 ) -> tuple[tuple[GroupSpec, ...], tuple[np.ndarray, ...]]:
    """(group specs, per group its members `int32[M, 2]` of (layer, kv head)) for a batch serving `policy`:
    layers the policy leaves whole, one group of every head (`FULL`: every token for the request's life);
    each sliding window's layers, one group of every head (`RingWindowSpec`: a window's slots, rewritten in
    place); each (layer, head) the policy compresses or evicts in, a group of its own (`BudgetedSpec`: its
    kept slots, which differ by layer and head, so no head holds pages for another's). `heads` are the kv
    heads of one shard; a small page holds `page_size` slots of every member. `uniform`: the baseline Jenga
    is measured against, paging before it: one group of every layer and head, each holding its fullest
    member's pages (a window layer as many as the global layers)."""
    rewrites = policy.compresses or policy.evicts_while_decoding
    full, windows, own = [], {}, []
    for layer in range(cfg.num_layers):
        window = cfg.windows[layer] if cfg.windows else 0
        if window:
            windows.setdefault(window, []).append(layer)
        elif rewrites and compressor_acts(policy, layer, cfg.windows):
            own.append(layer)
        else:
            full.append(layer)
    if uniform:
        full, windows, own = list(range(cfg.num_layers)), {}, []
    kv = dict(num_kv_heads=heads, head_dim=cfg.head_dim, dtype=dtype, tokens_per_page=page_size)
    specs, members = [], []

    def add(spec: GroupSpec, layers: Sequence[int], group_heads: Sequence[int]) -> None:
        specs.append(spec)
        members.append(np.array([(l, h) for l in layers for h in group_heads], np.int32).reshape(-1, 2))

    if full:
        add(FullAttentionSpec(name=FULL, num_layers=len(full), **kv), full, range(heads))
    for window, layers in sorted(windows.items()):
        add(RingWindowSpec(name=f"window{window}", num_layers=len(layers), window=window, **kv), layers, range(heads))
    for layer in own:
        for head in range(heads):
            spec = BudgetedSpec(name=f"layer{layer}.head{head}", num_layers=1, budget=1 << 30,
                                **{**kv, "num_kv_heads": 1})
            add(spec, [layer], [head])
    return tuple(specs), tuple(members)


class RowPool:
    """One decode batch's pool: a `JengaAllocator` over `layer_groups`, and where its pages lie in the
    device state's pool of `num_pages` single-head pages `[N, ps, D]` (`KVState.k_pages`). Small page `p`
    of group `g` is `members[g]` consecutive device pages, one per (layer, head) member, starting at
    `first_page(g, p)`; a large page is `large_pages` device pages, typed by the group it is split into.

    `pool_pages`: device pages asked for, rounded up to whole large pages (None: `default_pages` and a
    large page per group, what rounding each group's pages up to whole large pages may cost); `caching`:
    prefix caching of the positional groups' whole blocks (`hit`, `register`); `uniform`: `layer_groups`'s
    baseline (no caching then on a model with windows: its window pages are rewritten in place)."""

    def __init__(self, cfg: ModelConfig, policy: Policy, heads: int, page_size: int, dtype: str,
                 pool_pages: int | None, default_pages: int, caching: bool, uniform: bool = False):
        self.specs, self.members = layer_groups(cfg, policy, heads, page_size, dtype, uniform)
        caching = caching and not (uniform and any(cfg.windows or ()))
        self.cfg, self.heads, self.page_size = cfg, heads, page_size
        unit = self.specs[0].page_bytes // len(self.members[0])  # bytes of one device page (k and v)
        large = choose_large_page_bytes([s.page_bytes for s in self.specs])
        self.large_pages = large // unit
        if pool_pages is None:
            pool_pages = default_pages + len(self.specs) * self.large_pages
        num_large = -(-max(pool_pages, 1) // self.large_pages)
        self.allocator = JengaAllocator(self.specs, num_large * large, large_page_bytes=large,
                                        enable_prefix_caching=caching)
        self.num_pages = num_large * self.large_pages
        self.caching = caching
        self._per_large = [self.allocator.layout.pages_per_large(g) for g in range(len(self.specs))]
        self._windows = np.array([w or 0 for w in (cfg.windows or (0,) * cfg.num_layers)], np.int64)

    def first_page(self, group: int, page: int) -> int:
        """The device page of small page `page` of `group`'s first member."""
        large, slot = divmod(page, self._per_large[group])
        return large * self.large_pages + slot * len(self.members[group])

    def device_pages(self, group: int, pages: Sequence[int]) -> np.ndarray:
        """int32[len(pages) * M]: every member's device page of the small `pages` of `group`."""
        pages = np.asarray(pages, np.int64).reshape(-1)
        large, slot = np.divmod(pages[pages >= 0], self._per_large[group])
        first = (large * self.large_pages + slot * len(self.members[group]))[:, None]
        return (first + np.arange(len(self.members[group]))[None, :]).reshape(-1).astype(np.int32)

    def blocks(self, held: np.ndarray) -> dict[str, int]:
        """Pages each group must hold for a row whose (layer, head) `held int[L, H]` pages: its fullest member."""
        return {s.name: int(held[m[:, 0], m[:, 1]].max()) for s, m in zip(self.specs, self.members)}

    def pages_ahead(self, lengths: np.ndarray, tokens: np.ndarray, read_pages: tuple | None, max_pages: int
                    ) -> np.ndarray:
        """int[L, B, H]: logical pages each (layer, row, head) may need after `tokens int[B]` more tokens on
        `lengths int[L, B, H]`: one slot a token, up to the layer's read bound and, in a sliding-window
        layer (which drops its oldest slot once it holds the window), its window."""
        need = -(-(lengths + tokens[None, :, None]) // self.page_size)
        bound = np.full(lengths.shape[0], max_pages) if read_pages is None else np.asarray(read_pages)
        windowed = self._windows > 0
        bound = np.where(windowed, np.minimum(bound, -(-self._windows // self.page_size)), bound)
        return np.minimum(need, bound[:, None, None])

    def table(self, request_id: str, max_pages: int) -> np.ndarray:
        """int32[L, H, P]: the request's device page table (-1: none)."""
        out = np.full((self.cfg.num_layers, self.heads, max_pages), -1, np.int32)
        for group, (spec, members) in enumerate(zip(self.specs, self.members)):
            for block, page in enumerate(self.allocator.block_tables(request_id)[spec.name]):
                if page >= 0 and block < max_pages:
                    first = self.first_page(group, page)
                    out[members[:, 0], members[:, 1], block] = first + np.arange(len(members))
        return out

    def hit(self, prefix: Sequence[int], alignment: int) -> PrefixHit | None:
        """The cached whole blocks of `prefix` (a multiple of `alignment` tokens long), or None."""
        if not self.caching or len(prefix) < alignment:
            return None
        hit = self.allocator.get_computed_prefix(prefix, max_tokens=len(prefix), alignment=alignment)
        return hit if hit.num_tokens else None

    def shared(self, hit: PrefixHit | None, max_pages: int) -> np.ndarray:
        """bool[L, H, P]: the logical pages a row starting with `hit` shares rather than copies."""
        if hit is None:
            return self.first_blocks({}, max_pages)
        return self.first_blocks({s.name: hit.num_tokens // s.tokens_per_page for s in self.specs
                                  if s.is_positional and s.caches_prefix}, max_pages)

    def first_blocks(self, blocks: dict[str, int], max_pages: int) -> np.ndarray:
        """bool[L, H, P]: the first `blocks[group]` logical pages of each group's members."""
        out = np.zeros((self.cfg.num_layers, self.heads, max_pages), bool)
        for spec, members in zip(self.specs, self.members):
            out[members[:, 0], members[:, 1], : blocks.get(spec.name, 0)] = True
        return out

    def whole_blocks(self, lengths: np.ndarray, rewritten: np.ndarray) -> dict[str, int]:
        """Small pages per group that rows continuing one state of `lengths int[L, H]` slots may read from
        one copy: each member's whole pages (the partial last page takes the next token), none in a group
        with a layer whose slots a decode step rewrites (`rewritten bool[L]`)."""
        whole = lengths // self.page_size
        return {s.name: 0 if rewritten[m[:, 0]].any() else int(whole[m[:, 0], m[:, 1]].min())
                for s, m in zip(self.specs, self.members)}

    def device_page_count(self, blocks: dict[str, int]) -> int:
        """Device pages of `blocks` small pages per group."""
        return sum(blocks.get(s.name, 0) * len(m) for s, m in zip(self.specs, self.members))

    def held_pages(self, request_id: str) -> int:
        """Device pages the request's tables hold (shared ones included)."""
        tables = self.allocator.block_tables(request_id)
        return self.device_page_count({name: sum(p >= 0 for p in pages) for name, pages in tables.items()})

    def hit_blocks(self, hit: PrefixHit | None) -> dict[str, int]:
        """Small pages per group of a hit that live rows hold already (sharing them takes no room; a cached
        page it revives does)."""
        if hit is None:
            return {}
        return {name: sum(p >= 0 and self.allocator.page_refcount(name, p) > 0 for p in pages)
                for name, pages in hit.pages.items()}

    def live_pages(self) -> int:
        """Device pages held by requests (not free, not cached for reuse)."""
        return self.device_page_count(self.allocator.num_live_pages())

    def room_to_finish(self, final: dict[str, np.ndarray], joining: np.ndarray, reused: dict[str, int]) -> bool:
        """Whether the pool holds every live request up to its last tokens (`final`: request id -> the
        pages `int[L, H]` its (layer, head)s will hold then, `pages_ahead`) and a joining row holding
        `joining int[L, H]` pages at its end, of which `reused` small pages per group live rows hold already
        (a prefix hit's, a document's). Counted in device pages, a large page per group kept for rounding:
        the batch engine's admission (no preemption, so a row joins only when it can finish)."""
        needed = sum(self.device_page_count(self.blocks(pages)) - self.held_pages(rid) for rid, pages in final.items())
        needed += self.device_page_count(self.blocks(joining)) - self.device_page_count(reused)
        return self.live_pages() + needed <= self.num_pages - len(self.specs) * self.large_pages

    def used_slots(self, lengths: dict[str, np.ndarray]) -> int:
        """Slots of the live requests' pages that hold a token, each device page once (a shared prefix page
        counted once): request id -> the slots `int[L, H]` each (layer, head) holds, its first slots in its
        table's order. `live_pages() * page_size` less this is what the pool holds and nothing reads."""
        filled = np.zeros(self.num_pages, np.int64)
        for rid, held in lengths.items():
            tables = self.allocator.block_tables(rid)
            for group, (spec, members) in enumerate(zip(self.specs, self.members)):
                pages = np.asarray(tables[spec.name], np.int64)
                blocks = np.nonzero(pages >= 0)[0]
                slots = held[members[:, 0], members[:, 1]]  # [M]
                count = np.clip(slots[None, :] - blocks[:, None] * self.page_size, 0, self.page_size)
                np.maximum.at(filled, self.device_pages(group, pages[blocks]), count.reshape(-1))
        return int(filled.sum())


__all__ = ["FULL", "RowPool", "layer_groups"]
