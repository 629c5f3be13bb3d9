"""The Jenga allocator: request-level API over the two-level pool and the prefix cache.

Notes: docs/modules.md (`kvjax/jenga/allocator.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kvjax.util.hashing import ROOT_HASH, chain_hashes
from kvjax.jenga.layout import PoolLayout
from kvjax.jenga.page_pool import CACHED, FREE, HELD_BY_RUNNING, LIVE, Journal, TwoLevelPagePool
from kvjax.jenga.prefix_cache import PrefixCache, PrefixHit
from kvjax.jenga.specs import BudgetedSpec, GroupSpec, validate_group_specs


class RequestTooLargeError(ValueError):
    """A request needs more memory than the whole pool holds, so waiting or preempting cannot help."""


class StalePrefixHitError(ValueError):
    """A PrefixHit's pages were evicted between get_computed_prefix and allocate."""


@dataclass(frozen=True)
class PageCopy:
    """Device copy of one small page of `group` from page id `src` to page id `dst`."""

    group: str
    src: int
    dst: int


@dataclass(frozen=True)
class Allocation:
    """Result of a successful allocate.

    new_pages: per group, the page ids appended to the request's block table this call.
    copies: copies to apply to the pool before the step runs (a budgeted group's snapshot hit is copied
        into the request's own pages, which its policy will overwrite).
    """

    new_pages: dict[str, tuple[int, ...]]
    copies: tuple[PageCopy, ...] = ()


@dataclass(frozen=True)
class CommitResult:
    """Result of commit: `copies` store budgeted-group snapshots (request page -> cache page); apply them
    before the next step writes the request's pages."""

    copies: tuple[PageCopy, ...] = ()


@dataclass(frozen=True)
class GroupStats:
    """Bytes of one group. `needed_bytes` counts slots holding tokens some layer still reads (or is about
    to write this step), each shared page once."""

    name: str
    page_bytes: int
    held_large_pages: int
    live_pages: int
    cached_pages: int
    kept_pages: int  # live pages held only for reuse (keep_shared_prefix_window), wholly out of the window
    free_pages_in_held_large: int
    needed_bytes: float
    slack_bytes: int

    @property
    def live_bytes(self) -> int:
        return self.live_pages * self.page_bytes

    @property
    def cached_bytes(self) -> int:
        return self.cached_pages * self.page_bytes

    @property
    def kept_bytes(self) -> int:
        return self.kept_pages * self.page_bytes

    @property
    def free_small_bytes(self) -> int:
        return self.free_pages_in_held_large * self.page_bytes


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of pool usage.

    held = live + cached + free small pages inside held large pages + tail slack of held large pages.
    waste = held - needed - reusable: unfilled slots and tokens no layer needs inside live pages
    (`internal_bytes`), plus free small pages and slack inside held large pages (`external_bytes`).
    Reusable bytes (cached evictable pages, and live pages kept only for a shared prefix's last window)
    hold prefixes for reuse and count as neither needed nor waste.
    """

    pool_bytes: int
    large_page_bytes: int
    num_large_pages: int
    free_large_pages: int
    groups: tuple[GroupStats, ...] = field(repr=False)

    @property
    def held_bytes(self) -> int:
        return (self.num_large_pages - self.free_large_pages) * self.large_page_bytes

    @property
    def live_bytes(self) -> int:
        return sum(g.live_bytes for g in self.groups)

    @property
    def cached_bytes(self) -> int:
        return sum(g.cached_bytes for g in self.groups)

    @property
    def kept_bytes(self) -> int:
        return sum(g.kept_bytes for g in self.groups)

    @property
    def reusable_bytes(self) -> int:
        return self.cached_bytes + self.kept_bytes

    @property
    def needed_bytes(self) -> float:
        return sum(g.needed_bytes for g in self.groups)

    @property
    def internal_bytes(self) -> float:
        return self.live_bytes - self.kept_bytes - self.needed_bytes

    @property
    def external_bytes(self) -> int:
        return sum(g.free_small_bytes + g.slack_bytes for g in self.groups)

    @property
    def waste_bytes(self) -> float:
        return self.held_bytes - self.reusable_bytes - self.needed_bytes

    @property
    def waste_fraction(self) -> float:
        """Waste over held bytes (0 when nothing is held)."""
        return self.waste_bytes / self.held_bytes if self.held_bytes else 0.0


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]  # chained hashes of the full base blocks of token_ids[:num_computed]
    num_computed: int
    num_scheduled: int  # computed plus reserved for the step in flight
    tables: list[list[int]]  # per group; -1 for blocks released or skipped (sliding windows)
    first_live: list[int]  # per group: index of the first table entry that is not -1
    next_release: list[int]  # per positional group: blocks before this were considered for early release
    num_dead: list[int]  # per group: -1 entries in the table
    keep_blocks: list[range]  # per group: blocks kept (not released early) for reuse at the shared prefix
    num_registered: list[int]  # per positional group: blocks already offered to the prefix cache
    kept: list[int]  # per budgeted group: slots kept after the last commit
    large_hint: list[int]  # per group: the large page the request last took a small page from
    released_early: list[tuple[int, int, bytes]] = field(default_factory=list)  # (group, page, hash)


class JengaAllocator:
    """Two-level page allocator with prefix caching for a set of heterogeneous layer groups.

    Args:
        specs: the groups (kvjax.jenga.specs); names must be unique.
        pool_bytes: size of the device pool; it holds pool_bytes // large_page_bytes large pages.
        large_page_bytes: default: choose_large_page_bytes(page sizes, max_large_page_ratio).
        enable_prefix_caching: cache full blocks (and budgeted snapshots) for reuse.
        fresh_large_page_first: where a small page goes when the large page the request last used for
            its group is full. False (default): another partly used large page of the group, then a
            fresh one. True (the Jenga paper's request-aware order): a fresh large page first, so a
            finished request's small pages tend to free whole large pages. eval/bench_serving.py
            measures both (docs/jenga.md).
        align_early_released: sliding-window pages released early (out of the window) are evictable at
            once, but rank after every page of a finished request until their own request finishes,
            when they take its release time like its other pages (the pages of one prefix are evicted
            together). False: they rank by the time they left the window, so they go first.
        keep_shared_prefix_window: a request whose prompt starts with a cached prefix (full-attention
            blocks matched by get_computed_prefix, hit or not) keeps the sliding-window blocks of the
            last window of that prefix until it finishes instead of releasing them early: the blocks
            the next request with the same prefix needs to hit it, shared by all requests that hit it.
    """

    def __init__(
        self,
        specs: Sequence[GroupSpec],
        pool_bytes: int,
        *,
        large_page_bytes: int | None = None,
        max_large_page_ratio: int = 8,
        enable_prefix_caching: bool = True,
        fresh_large_page_first: bool = False,
        align_early_released: bool = True,
        keep_shared_prefix_window: bool = True,
    ) -> None:
        self.specs = validate_group_specs(specs)
        self.layout = PoolLayout.from_pool_bytes(self.specs, pool_bytes, large_page_bytes, max_large_page_ratio)
        self.enable_prefix_caching = enable_prefix_caching
        self.fresh_large_page_first = fresh_large_page_first
        self.align_early_released = align_early_released
        self.keep_shared_prefix_window = keep_shared_prefix_window
        self._journal = Journal()
        self._pool = TwoLevelPagePool(self.layout, self._journal)
        self._cache = PrefixCache(self.specs, self._pool, self._journal)
        self._requests: dict[str, _Request] = {}
        self._snapshot_slots: dict[tuple[int, bytes], int] = {}
        self._per_large = [self.layout.pages_per_large(g) for g in range(len(self.specs))]

    # =================================================================================================
    # Prefix hits
    # =================================================================================================
    def get_computed_prefix(self, token_ids: Sequence[int], *, max_tokens: int | None = None,
                            alignment: int | None = None) -> PrefixHit:
        """The longest prefix of `token_ids` whose cache every group can reuse (at most `max_tokens`,
        default len(token_ids) - 1 so one token is always computed; a multiple of `alignment` when given),
        with its pages per group."""
        token_ids = list(token_ids)
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return PrefixHit(0, {s.name: () for s in self.specs}, (), ())
        length, hashes, pages, shared = self._cache.find_hit(token_ids, max_tokens, alignment)
        return PrefixHit(
            num_tokens=length,
            pages={spec.name: tuple(p) for spec, p in zip(self.specs, pages)},
            token_ids=tuple(token_ids[:length]),
            block_hashes=tuple(hashes[: length // self._cache.base_tokens]),
            shared_prefix_tokens=shared,
        )

    # =================================================================================================
    # Allocation
    # =================================================================================================
    def can_allocate(self, request_id: str, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        """Whether allocate(request_id, <num_new_tokens tokens>, prefix_hit) would succeed now: a dry run
        of allocate, undone before returning. Raises RequestTooLargeError if it could never succeed."""
        return bool(self._allocate(request_id, None, num_new_tokens, prefix_hit, dry_run=True))

    def allocate(
        self, request_id: str, new_token_ids: Sequence[int], prefix_hit: PrefixHit | None = None
    ) -> Allocation | None:
        """Reserves slots for `new_token_ids` (the tokens this step computes) in every group.

        The first call of a request may pass the PrefixHit from get_computed_prefix: the request then
        starts with the hit's pages (shared, refcounted) and `new_token_ids` continue after the hit.
        Returns None, with nothing changed, when the pool cannot hold the step now (the engine may wait
        or preempt); raises RequestTooLargeError when even an empty pool could not.
        """
        new_token_ids = list(new_token_ids)
        return self._allocate(request_id, new_token_ids, len(new_token_ids), prefix_hit, dry_run=False)

    def _allocate(self, request_id, new_token_ids, num_new, prefix_hit, dry_run):
        """allocate / can_allocate: validate, size, then take pages inside a journal transaction that a
        failure (or a dry run) rolls back."""
        if not isinstance(num_new, int) or num_new <= 0:
            raise ValueError(f"request {request_id!r}: need at least one new token, got {num_new!r}")
        request = self._requests.get(request_id)
        if request is not None:
            if prefix_hit is not None:
                raise ValueError(f"request {request_id!r}: prefix_hit is only for a request's first allocate")
            if request.num_scheduled != request.num_computed:
                raise ValueError(
                    f"request {request_id!r}: {request.num_scheduled - request.num_computed} scheduled tokens "
                    "are not committed; call commit before allocating again"
                )
        elif prefix_hit is not None:
            self._check_hit_is_current(request_id, prefix_hit)
        hit = prefix_hit if (request is None and prefix_hit is not None and prefix_hit.num_tokens > 0) else None

        counts, live_after = self._page_counts(request, hit, num_new)
        self._check_fits(request_id, request, hit, num_new, live_after)
        if request is not None and not any(counts):  # most decode steps: the pages are already there
            if not dry_run:
                request.num_scheduled += num_new
                request.token_ids.extend(new_token_ids)
                return Allocation({s.name: () for s in self.specs})
            return True

        journal = self._journal
        journal.begin()
        try:
            self._pool.clock += 1
            if request is None:
                shared = prefix_hit.shared_prefix_tokens if prefix_hit is not None else 0
                request = self._create_request(request_id, hit, shared)
            pinned = self._pin_snapshot_sources(hit)
            pages = self._take_pages(request, counts)
            if pages is None:
                journal.rollback()
                return None
            copies = []
            for group, spec in enumerate(self.specs):
                if hit is not None and not spec.is_positional:
                    copies += [PageCopy(spec.name, src, dst) for src, dst in zip(hit.pages[spec.name], pages[group])]
                self._extend_table(request, group, pages[group])
            for group, page in pinned:
                self._pool.decref(group, page)
            if dry_run:
                journal.rollback()
                return True
            journal.commit()
        except BaseException:
            if journal.is_open:
                journal.rollback()
            raise
        request.num_scheduled += num_new
        request.token_ids.extend(new_token_ids)
        return Allocation({s.name: tuple(p) for s, p in zip(self.specs, pages)}, tuple(copies))

    def _check_hit_is_current(self, request_id: str, hit: PrefixHit) -> None:
        for group, spec in enumerate(self.specs):
            pages = [p for p in hit.pages.get(spec.name, ()) if p >= 0]
            if not spec.caches_prefix:
                continue
            if hit.num_tokens and not spec.is_positional:
                expected = self._cache.lookup(group, self._cache.hash_at(hit.block_hashes, hit.num_tokens))
                if expected is None or tuple(pages) != expected:
                    raise StalePrefixHitError(
                        f"request {request_id!r}: the snapshot of group {spec.name!r} at {hit.num_tokens} tokens "
                        "was evicted since get_computed_prefix; call it again"
                    )
                continue
            for block, page in enumerate(hit.pages.get(spec.name, ())):
                if page < 0:
                    continue
                end = (block + 1) * spec.tokens_per_page
                if self._cache.lookup(group, self._cache.hash_at(hit.block_hashes, end)) != (page,):
                    raise StalePrefixHitError(
                        f"request {request_id!r}: page {page} of group {spec.name!r} (tokens {end - spec.tokens_per_page}"
                        f"..{end}) was evicted since get_computed_prefix; call it again"
                    )

    def _page_counts(self, request, hit, num_new):
        """(new small pages per group, live pages per group after this allocation)."""
        counts, live_after = [], []
        for group, spec in enumerate(self.specs):
            tpp = spec.tokens_per_page
            if request is not None:
                table_len, dead = len(request.tables[group]), request.num_dead[group]
            elif hit is not None:
                hit_pages = hit.pages[spec.name]
                table_len = 0 if not spec.is_positional else len(hit_pages)
                dead = 0 if not spec.is_positional else sum(1 for p in hit_pages if p < 0)
            else:
                table_len = dead = 0
            if spec.is_positional:
                start = request.num_scheduled if request is not None else (hit.num_tokens if hit else 0)
                needed_len = -(-(start + num_new) // tpp)
            else:
                kept = request.kept[group] if request is not None else self._hit_kept_slots(group, hit)
                needed_len = -(-(kept + num_new) // tpp)
            counts.append(max(0, needed_len - table_len))
            live_after.append(max(needed_len, table_len) - dead)
        return counts, live_after

    def _hit_kept_slots(self, group: int, hit: PrefixHit | None) -> int:
        if hit is None:
            return 0
        block_hash = self._cache.hash_at(hit.block_hashes, hit.num_tokens)
        return self._snapshot_slots[(group, block_hash)]

    def _check_fits(self, request_id, request, hit, num_new, live_after) -> None:
        large_needed = sum(-(-live // per) for live, per in zip(live_after, self._per_large))
        if large_needed <= self.layout.num_large_pages:
            return
        start = request.num_scheduled if request is not None else (hit.num_tokens if hit else 0)
        per_group = ", ".join(
            f"{spec.name}: {live} pages x {spec.page_bytes} B" for spec, live in zip(self.specs, live_after)
        )
        raise RequestTooLargeError(
            f"request {request_id!r} at {start + num_new} tokens ({num_new} new) needs {large_needed} large pages "
            f"({large_needed * self.layout.large_page_bytes} bytes) but the pool has {self.layout.num_large_pages} "
            f"({self.layout.pool_bytes} bytes) [{per_group}]"
        )

    def _create_request(self, request_id: str, hit: PrefixHit | None, shared_prefix_tokens: int = 0) -> _Request:
        num_groups = len(self.specs)
        request = _Request(
            request_id=request_id,
            token_ids=list(hit.token_ids) if hit else [],
            block_hashes=list(hit.block_hashes) if hit else [],
            num_computed=hit.num_tokens if hit else 0,
            num_scheduled=hit.num_tokens if hit else 0,
            tables=[[] for _ in range(num_groups)],
            first_live=[0] * num_groups,
            next_release=[0] * num_groups,
            num_dead=[0] * num_groups,
            keep_blocks=[range(0) for _ in range(num_groups)],
            num_registered=[0] * num_groups,
            kept=[0] * num_groups,
            large_hint=[-1] * num_groups,
        )
        self._requests[request_id] = request
        self._journal.record(lambda: self._requests.pop(request_id))
        if shared_prefix_tokens and self.keep_shared_prefix_window and self.enable_prefix_caching:
            for group, spec in enumerate(self.specs):
                if spec.is_positional and not spec.requires_full_prefix:
                    tpp = spec.tokens_per_page
                    end_block = shared_prefix_tokens // tpp
                    request.keep_blocks[group] = range(spec.first_needed_token(end_block * tpp) // tpp, end_block)
        if hit is not None:
            for group, spec in enumerate(self.specs):
                if spec.is_positional:
                    pages = list(hit.pages[spec.name])
                    for page in pages:
                        if page >= 0:
                            self._pool.incref(group, page)
                    request.tables[group] = pages
                    request.first_live[group] = request.next_release[group] = request.num_dead[group] = sum(
                        1 for p in pages if p < 0
                    )
                    request.num_registered[group] = hit.num_tokens // spec.tokens_per_page
                elif spec.caches_prefix:
                    request.kept[group] = self._hit_kept_slots(group, hit)
        return request

    # =================================================================================================
    # Pages by block count (the batch engine)
    # =================================================================================================
    def reserve(self, request_id: str, blocks: Mapping[str, int], prefix_hit: PrefixHit | None = None
                ) -> Allocation | None:
        """Grows the request's table of each named group to at least `blocks[group]` pages: how the batch
        engine allocates, from the slots its rows' layers and heads really hold (compressed, in a window or
        growing one token a step), not from token positions. A request's first call may pass the PrefixHit
        of `get_computed_prefix`: its positional groups then start with the hit's pages (shared and
        refcounted, counted in `blocks`), and the prefix's tokens count as computed.

        Returns the new pages per group, or None with nothing changed when the pool cannot hold them now
        (evicting cached prefixes first); raises RequestTooLargeError when even an empty pool could not."""
        unknown = set(blocks) - {s.name for s in self.specs}
        if unknown:
            raise KeyError(f"request {request_id!r}: unknown groups {sorted(unknown)}; groups are "
                           f"{[s.name for s in self.specs]}")
        request = self._requests.get(request_id)
        if request is not None and prefix_hit is not None:
            raise ValueError(f"request {request_id!r}: prefix_hit is only for a request's first reserve")
        hit = prefix_hit if (request is None and prefix_hit is not None and prefix_hit.num_tokens > 0) else None
        if hit is not None:
            self._check_hit_is_current(request_id, hit)
            if any(not s.is_positional and s.caches_prefix for s in self.specs):
                raise ValueError(f"request {request_id!r}: reserve takes hits on positional groups only")
        counts, live_after = [], []
        for group, spec in enumerate(self.specs):
            wanted = int(blocks.get(spec.name, 0))
            if wanted < 0:
                raise ValueError(f"request {request_id!r}: blocks[{spec.name!r}] must be >= 0, got {wanted}")
            if request is not None:
                have, dead = len(request.tables[group]), request.num_dead[group]
            elif hit is not None and spec.is_positional:
                have, dead = len(hit.pages[spec.name]), sum(1 for p in hit.pages[spec.name] if p < 0)
            else:
                have = dead = 0
            counts.append(max(0, wanted - have))
            live_after.append(max(wanted, have) - dead)
        self._check_fits(request_id, request, hit, 0, live_after)
        if request is not None and not any(counts):
            return Allocation({s.name: () for s in self.specs})
        journal = self._journal
        journal.begin()
        try:
            self._pool.clock += 1
            if request is None:
                request = self._create_request(request_id, hit)
            pages = self._take_pages(request, counts)
            if pages is None:
                journal.rollback()
                return None
            for group in range(len(self.specs)):
                self._extend_table(request, group, pages[group])
            journal.commit()
        except BaseException:
            if journal.is_open:
                journal.rollback()
            raise
        return Allocation({s.name: tuple(p) for s, p in zip(self.specs, pages)})

    def share(self, request_id: str, pages: Mapping[str, Sequence[int]]) -> None:
        """Starts request `request_id` with the table of each named group beginning with `pages`: small pages
        live requests hold (a saved document's read-only pages, `kvjax.serving.batch_engine`), referenced and
        not copied, freed when the last request holding them is. Its `reserve` then counts them in `blocks`."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} exists already: share starts a request")
        groups = [self.layout.group_index(name) for name in pages]
        for group, (name, shared) in zip(groups, pages.items()):
            dead = [p for p in shared if p < 0 or self._pool.refcount[group][p] <= 0]
            if dead:
                raise ValueError(f"request {request_id!r}: pages {dead} of group {name!r} are not held by a live "
                                 "request; only live pages are shared")
        journal = self._journal
        journal.begin()
        try:
            request = self._create_request(request_id, None)
            for group, shared in zip(groups, pages.values()):
                for page in shared:
                    self._pool.incref(group, page)
                self._extend_table(request, group, list(shared))
            journal.commit()
        except BaseException:
            if journal.is_open:
                journal.rollback()
            raise

    def register_prefix(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offers the request's pages of `token_ids` (the tokens its first pages hold, whole blocks of them)
        to the prefix cache, in every positional group that caches: once the request is freed they stay,
        evictable, for the next request with the same prefix (`get_computed_prefix`)."""
        request = self._request(request_id)
        token_ids = [int(t) for t in token_ids]
        if not self.enable_prefix_caching:
            return
        if token_ids[: len(request.token_ids)] != request.token_ids[: len(token_ids)]:
            raise ValueError(f"request {request_id!r}: token_ids disagree with the tokens it holds")
        if len(token_ids) > len(request.token_ids):
            request.token_ids = token_ids
        request.num_computed = request.num_scheduled = max(request.num_computed, len(token_ids))
        self._extend_hashes(request)
        for group, spec in enumerate(self.specs):
            if spec.is_positional and spec.caches_prefix:
                blocks = min(len(token_ids) // spec.tokens_per_page, len(request.tables[group]))
                self._register_blocks(request, group, spec, blocks)

    def _register_blocks(self, request: _Request, group: int, spec: GroupSpec, full_blocks: int) -> None:
        """Caches the request's pages of `group` for blocks not yet offered, up to `full_blocks`."""
        tpp, table = spec.tokens_per_page, request.tables[group]
        for block in range(request.num_registered[group], full_blocks):
            page = table[block]
            if page >= 0:
                end = (block + 1) * tpp
                self._cache.register(group, (page,), self._cache.hash_at(request.block_hashes, end), end)
        request.num_registered[group] = max(request.num_registered[group], full_blocks)

    def _pin_snapshot_sources(self, hit: PrefixHit | None) -> list[tuple[int, int]]:
        """References a snapshot hit's pages for the duration of allocate, so the eviction that makes
        room for the request's copy cannot reuse them."""
        pinned = []
        if hit is None:
            return pinned
        for group, spec in enumerate(self.specs):
            if not spec.is_positional:
                for page in hit.pages[spec.name]:
                    self._pool.incref(group, page)
                    pinned.append((group, page))
        return pinned

    def _extend_table(self, request: _Request, group: int, pages: list[int]) -> None:
        if not pages:
            return
        table = request.tables[group]
        table.extend(pages)
        self._journal.record(lambda: table.__delitem__(slice(len(table) - len(pages), None)))

    def _set_hint(self, hints: list[int], group: int, large: int) -> None:
        previous = hints[group]
        if previous != large:
            hints[group] = large
            self._journal.record(lambda: hints.__setitem__(group, previous))

    def _take_pages(self, request: _Request, counts: list[int], hints: list[int] | None = None) -> list[list[int]] | None:
        """Takes counts[g] small pages of every group g, or returns None (the caller rolls back).

        Order for each page (request-aware): a free slot in the large page the request last used for this
        group; a free slot in another large page of the group, then a fresh large page (swapped when
        fresh_large_page_first); evicting the group's least recently used cached entry; reclaiming a
        large page of another group that holds only cached pages. Groups whose free slots and evictable
        pages cannot cover their need reserve fresh large pages first, so that a group that could evict
        does not take the last free large page from one that cannot.
        """
        pool = self._pool
        hints = request.large_hint if hints is None else hints
        remaining = list(counts)
        taken: list[list[int]] = [[] for _ in counts]
        reserved: list[list[int]] = [[] for _ in counts]
        for group, need in enumerate(remaining):
            deficit = need - pool.num_free_slots[group] - pool.num_evictable[group]
            while deficit > 0:
                large = pool.take_free_large(group)
                if large is None:
                    # Not the group's own pages: their cached slots are already counted as capacity.
                    if not self._reclaim_large_page(remaining, exclude_group=group):
                        return None
                    large = pool.take_free_large(group)
                reserved[group].append(large)
                deficit -= self._per_large[group]
        for group in range(len(remaining)):
            while remaining[group] > 0:
                large = hints[group]
                if large < 0 or pool.large_group[large] != group or not pool.has_free_slot(large):
                    # A reserved page may already be in use: a stale hint can point at it.
                    while reserved[group] and not pool.has_free_slot(reserved[group][0]):
                        reserved[group].pop(0)
                    if reserved[group]:
                        large = reserved[group].pop(0)
                    elif self.fresh_large_page_first:
                        large = pool.take_free_large(group)
                        if large is None:
                            large = pool.first_partial(group)
                    else:
                        large = pool.first_partial(group)
                        if large is None:
                            large = pool.take_free_large(group)
                    if large is None:
                        # Evict the least recently used entry across groups: the group's own oldest
                        # page, or (when older) another group's, reclaiming its large page.
                        victim = pool.oldest_evictable(group)
                        own_key = None if victim is None else pool.lru_key(group, victim)
                        other_key = self._oldest_key_elsewhere(group)
                        if other_key is not None and (own_key is None or other_key < own_key):
                            if self._reclaim_large_page(remaining, exclude_group=group):
                                continue
                            victim = pool.oldest_evictable(group)  # the attempt may have cascaded here
                        if victim is None:
                            return None
                        self._cache.evict(group, victim)
                        continue
                    self._set_hint(hints, group, large)
                taken[group].append(pool.take_slot(group, large))
                remaining[group] -= 1
            for large in reserved[group]:  # evictions on the way freed room elsewhere: give it back
                pool.release_large_if_empty(large)
        return taken

    def _oldest_key_elsewhere(self, group: int):
        """Eviction key of the oldest evictable page outside `group`, or None."""
        pool = self._pool
        keys = [
            pool.lru_key(other, pool.oldest_evictable(other))
            for other in range(len(self.specs))
            if other != group and pool.num_evictable[other]
        ]
        return min(keys) if keys else None

    def _reclaim_large_page(self, remaining: list[int], exclude_group: int = -1) -> bool:
        """Frees a large page held only by cached pages of other groups; False if none can be freed.

        Evicts, across the other groups, the least recently used cached entry (preferring groups that
        need nothing more in this allocation) until a large page comes free: with one small page per
        large page that is one eviction, and pages a request released together sit together. After
        2 * pages_per_large evictions in a group without success it falls back to evicting a whole
        large page that holds no live page (a scan of the pool).
        """
        pool = self._pool
        free_before = pool.num_free_large()
        tries = [2 * per for per in self._per_large]
        while True:
            best = None
            for group in range(len(self.specs)):
                if group == exclude_group or tries[group] <= 0 or pool.num_evictable[group] == 0:
                    continue
                page = pool.oldest_evictable(group)
                key = (remaining[group] > 0, pool.lru_key(group, page), group)
                if best is None or key < best[0]:
                    best = (key, group, page)
            if best is None:
                break
            _, group, page = best
            self._cache.evict(group, page)
            tries[group] -= 1
            if pool.num_free_large() > free_before:
                return True
        if not any(n for group, n in enumerate(pool.num_evictable) if group != exclude_group):
            return False  # nothing cached outside the excluded group: skip the scan
        candidates = [large for large in pool.reclaimable_large_pages() if pool.large_group[large] != exclude_group]
        if not candidates:
            return False
        candidates.sort(key=lambda large: remaining[pool.large_group[large]] > 0)  # stable: keeps LRU order
        large = candidates[0]
        group = pool.large_group[large]
        first = large * self._per_large[group]
        for page in range(first, first + self._per_large[group]):
            if pool.cached[group][page] and pool.refcount[group][page] == 0:
                self._cache.evict(group, page)
        return True

    # =================================================================================================
    # Commit and free
    # =================================================================================================
    def commit(self, request_id: str, kept_slots: Mapping[str, int] | None = None) -> CommitResult:
        """Marks the tokens reserved by the last allocate as computed (their KV is written).

        Then: full blocks of positional groups enter the prefix cache; sliding-window blocks wholly
        before the last window - 1 tokens are released (early: they become the first to be evicted);
        budgeted groups shrink to their kept slots (`kept_slots[group]`, default min(held, budget), which
        the engine's compaction must match) and, at multiples of their `snapshot_every`, a copy of their
        state is cached (returned as copies to apply).
        """
        request = self._request(request_id)
        num_new = request.num_scheduled - request.num_computed
        if num_new == 0:
            raise ValueError(f"request {request_id!r}: nothing was allocated since the last commit")
        kept_slots = dict(kept_slots or {})
        unknown = set(kept_slots) - {s.name for s in self.specs if not s.is_positional}
        if unknown:
            raise ValueError(f"kept_slots names groups that are not budgeted: {sorted(unknown)}")
        kept_after = {}
        for group, spec in enumerate(self.specs):  # validate everything before changing anything
            if not spec.is_positional:
                held = request.kept[group] + num_new
                kept = kept_slots.get(spec.name, min(held, spec.budget))
                if not isinstance(kept, int) or not 0 <= kept <= held:
                    raise ValueError(
                        f"request {request_id!r}: kept_slots[{spec.name!r}] must be an int in 0..{held}, got {kept!r}"
                    )
                kept_after[group] = kept
        self._pool.clock += 1
        request.num_computed = request.num_scheduled
        num_tokens = request.num_computed
        if self.enable_prefix_caching:
            self._extend_hashes(request)
        copies: list[PageCopy] = []
        for group, spec in enumerate(self.specs):
            if spec.is_positional:
                self._commit_positional(request, group, spec, num_tokens)
            else:
                self._shrink_budgeted(request, group, spec, kept_after[group])
                copies += self._snapshot(request, group, spec, num_tokens)
        return CommitResult(tuple(copies))

    def _extend_hashes(self, request: _Request) -> None:
        base = self._cache.base_tokens
        done = len(request.block_hashes)
        parent = request.block_hashes[-1] if done else ROOT_HASH
        end = request.num_computed // base * base
        if end // base > done:
            request.block_hashes += chain_hashes(
                request.token_ids[done * base : end], base, parent_hash=parent
            )

    def _commit_positional(self, request: _Request, group: int, spec: GroupSpec, num_tokens: int) -> None:
        tpp = spec.tokens_per_page
        table = request.tables[group]
        full_blocks = num_tokens // tpp
        if self.enable_prefix_caching:
            self._register_blocks(request, group, spec, full_blocks)
        first_needed_block = spec.first_needed_token(num_tokens) // tpp
        align = self.align_early_released and self.enable_prefix_caching
        release_time = HELD_BY_RUNNING + self._pool.clock if align else None
        keep = request.keep_blocks[group]
        for block in range(first_needed_block - 1, request.next_release[group] - 1, -1):
            page = table[block]
            if page >= 0 and block not in keep:
                block_hash = self._cache.hash_of_page[group].get(page)
                self._pool.decref(group, page, release_time)
                if align and block_hash is not None:
                    request.released_early.append((group, page, block_hash))
                table[block] = -1
                request.num_dead[group] += 1
        request.next_release[group] = max(request.next_release[group], first_needed_block)
        first_live = request.first_live[group]
        while first_live < len(table) and table[first_live] < 0:
            first_live += 1
        request.first_live[group] = first_live

    def _shrink_budgeted(self, request: _Request, group: int, spec: GroupSpec, kept: int) -> None:
        table = request.tables[group]
        keep_pages = -(-kept // spec.tokens_per_page)
        while len(table) > keep_pages:
            self._pool.decref(group, table.pop())
        request.kept[group] = kept

    def _snapshot(self, request: _Request, group: int, spec: BudgetedSpec, num_tokens: int) -> list[PageCopy]:
        kept = request.kept[group]
        if (
            not self.enable_prefix_caching
            or spec.snapshot_every is None
            or kept == 0
            or num_tokens % spec.snapshot_every
            or num_tokens % self._cache.alignment
        ):
            return []
        block_hash = self._cache.hash_at(request.block_hashes, num_tokens)
        if self._cache.lookup(group, block_hash) is not None:
            return []
        source = request.tables[group]
        counts = [0] * len(self.specs)
        counts[group] = len(source)
        journal = self._journal
        journal.begin()
        try:
            pages = self._take_pages(request, counts, hints=[-1] * len(self.specs))
            if pages is None:  # no room: skip this snapshot, it is only an optimisation
                journal.rollback()
                return []
            self._cache.register(group, pages[group], block_hash, num_tokens)
            for page in pages[group]:
                self._pool.decref(group, page)  # owned by the cache alone: evictable from now on
            journal.commit()
        except BaseException:
            if journal.is_open:
                journal.rollback()
            raise
        self._snapshot_slots[(group, block_hash)] = kept
        return [PageCopy(spec.name, src, dst) for src, dst in zip(source, pages[group])]

    def free(self, request_id: str) -> None:
        """Drops the request's references: its registered pages become evictable (deepest first), the
        rest free. Unknown ids are ignored (a request aborted before its first allocate)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        pool = self._pool
        pool.clock += 1
        for group, table in enumerate(request.tables):
            for page in reversed(table):
                if page >= 0:
                    pool.decref(group, page)
        for group, page, block_hash in request.released_early:
            # Still the same evictable cache entry (not evicted and reused, not held by another
            # request): it now ages with the rest of the request's prefix.
            if (
                pool.refcount[group][page] == 0
                and self._cache.hash_of_page[group].get(page) == block_hash
                and pool.last_release[group][page] >= HELD_BY_RUNNING
            ):
                pool.retime(group, page, pool.clock)

    # =================================================================================================
    # Introspection
    # =================================================================================================
    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(self._requests)

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def block_tables(self, request_id: str) -> dict[str, tuple[int, ...]]:
        """Per group, the request's page ids: positional groups one per block of tokens (-1 for blocks
        released or skipped), budgeted groups one per page of kept slots."""
        request = self._request(request_id)
        return {spec.name: tuple(table) for spec, table in zip(self.specs, request.tables)}

    def num_computed_tokens(self, request_id: str) -> int:
        return self._request(request_id).num_computed

    def page_refcount(self, group: str, page: int) -> int:
        return self._pool.refcount[self.layout.group_index(group)][page]

    def page_state(self, group: str, page: int) -> str:
        """'free', 'live' (referenced by a request) or 'cached' (evictable prefix page)."""
        return self._pool.state(self.layout.group_index(group), page)

    def large_page_group(self, large_page: int) -> str | None:
        """Name of the group a large page is split into, None while it is free."""
        group = self._pool.large_group[large_page]
        return None if group < 0 else self.specs[group].name

    def num_free_large_pages(self) -> int:
        return self._pool.num_free_large()

    def num_live_pages(self) -> dict[str, int]:
        """Per group, small pages requests hold (refcount > 0): O(large pages), unlike `stats`."""
        live = [0] * len(self.specs)
        for large, group in enumerate(self._pool.large_group):
            if group >= 0:
                live[group] += self._pool.large_live[large]
        return {spec.name: n for spec, n in zip(self.specs, live)}

    def evictable_pages(self, group: str) -> list[int]:
        """Evictable pages of `group`, in the order they would be evicted."""
        return self._pool.evictable_in_order(self.layout.group_index(group))

    def cached_pages(self, group: str, block_hash: bytes) -> tuple[int, ...] | None:
        """Pages `group` caches for the prefix named by `block_hash` (see hashing.chain_hashes), or None."""
        return self._cache.lookup(self.layout.group_index(group), block_hash)

    def uncache(self, group: str, block_hash: bytes) -> bool:
        """Removes `group`'s cache entry for the prefix named by `block_hash` (no cascade). Evictable pages
        become free; pages in use stay with their requests. False if there was no entry."""
        index = self.layout.group_index(group)
        if self._cache.lookup(index, block_hash) is None:
            return False
        self._cache.unregister(index, block_hash)
        return True

    def reset_prefix_cache(self) -> int:
        """Evicts every evictable cache entry; returns how many pages were freed."""
        freed = 0
        for group in range(len(self.specs)):
            while (page := self._pool.oldest_evictable(group)) is not None:
                before = sum(self._pool.num_evictable)
                self._cache.evict(group, page)
                freed += before - sum(self._pool.num_evictable)
        return freed

    def stats(self) -> PoolStats:
        """Bytes held, needed, cached and wasted, per group. Walks every live page: O(live pages)."""
        pool = self._pool
        needed = [0.0] * len(self.specs)
        kept_pages: list[set[int]] = [set() for _ in self.specs]  # live only to serve a shared prefix
        window_pages: list[set[int]] = [set() for _ in self.specs]  # ... unless another request reads them
        # A shared page is a full block of a common prefix; its needed bytes never grow with the owner's
        # length, so it counts once, for the owner with the fewest tokens: page -> (block, tokens).
        neediest: list[dict[int, tuple[int, int]]] = [{} for _ in self.specs]
        for request in self._requests.values():
            num_tokens = request.num_scheduled
            in_flight = request.num_scheduled - request.num_computed
            for group, spec in enumerate(self.specs):
                table = request.tables[group]
                if not spec.is_positional:
                    needed[group] += (request.kept[group] + in_flight) * spec.page_bytes / spec.tokens_per_page
                    continue
                first = request.first_live[group]
                needed[group] += spec.needed_bytes_in_range(first, len(table), num_tokens)
                if not spec.requires_full_prefix:  # sliding: pages kept for reuse vs pages in a window
                    out_of_window = min(spec.first_needed_token(num_tokens) // spec.tokens_per_page, len(table))
                    for block in request.keep_blocks[group]:
                        if block < out_of_window and table[block] >= 0:
                            kept_pages[group].add(table[block])
                    window_pages[group].update(table[out_of_window:])
                refs, owners, run_start = pool.refcount[group], neediest[group], None
                for block in range(first, len(table) + 1):
                    page = table[block] if block < len(table) else -1
                    if page >= 0 and refs[page] > 1:
                        run_start = block if run_start is None else run_start
                        if page not in owners or num_tokens < owners[page][1]:
                            owners[page] = (block, num_tokens)
                    elif run_start is not None:  # take shared runs out; added back once per page below
                        needed[group] -= spec.needed_bytes_in_range(run_start, block, num_tokens)
                        run_start = None
        for group, pages in enumerate(window_pages):
            kept_pages[group] -= pages  # a kept page inside another request's window is needed there
        for group, owners in enumerate(neediest):
            spec = self.specs[group]
            needed[group] += sum(spec.needed_bytes_in_block(block, tokens) for block, tokens in owners.values())
        held_large = [0] * len(self.specs)
        free_small = [0] * len(self.specs)
        for large, group in enumerate(pool.large_group):
            if group >= 0:
                held_large[group] += 1
                free_small[group] += len(pool.large_free_slots[large])
        live = [0] * len(self.specs)
        for large, group in enumerate(pool.large_group):
            if group >= 0:
                live[group] += pool.large_live[large]
        groups = tuple(
            GroupStats(
                name=spec.name,
                page_bytes=spec.page_bytes,
                held_large_pages=held_large[g],
                live_pages=live[g],
                cached_pages=pool.num_evictable[g],
                kept_pages=len(kept_pages[g]),
                free_pages_in_held_large=free_small[g],
                needed_bytes=needed[g],
                slack_bytes=held_large[g] * self.layout.tail_slack_bytes(g),
            )
            for g, spec in enumerate(self.specs)
        )
        return PoolStats(
            pool_bytes=self.layout.pool_bytes,
            large_page_bytes=self.layout.large_page_bytes,
            num_large_pages=self.layout.num_large_pages,
            free_large_pages=pool.num_free_large(),
            groups=groups,
        )

    def check_invariants(self) -> None:
        """Recomputes the books from the request tables and cache maps and raises AssertionError on any
        mismatch. O(pool size); for tests and debugging."""
        pool, cache = self._pool, self._cache
        for group, spec in enumerate(self.specs):
            expected_refs: dict[int, int] = {}
            owners: dict[int, list[str]] = {}
            for request in self._requests.values():
                for page in request.tables[group]:
                    if page >= 0:
                        expected_refs[page] = expected_refs.get(page, 0) + 1
                        owners.setdefault(page, []).append(request.request_id)
            for page, refs in enumerate(pool.refcount[group]):
                if refs != expected_refs.get(page, 0):
                    raise AssertionError(f"group {spec.name}: page {page} refcount {refs} != {expected_refs.get(page, 0)} owners")
            for page, page_owners in owners.items():
                if len(page_owners) > 1 and page not in cache.hash_of_page[group]:
                    raise AssertionError(f"group {spec.name}: unregistered page {page} shared by {page_owners}")
                if len(page_owners) > 1 and not spec.is_positional:
                    raise AssertionError(f"group {spec.name}: budgeted page {page} shared by {page_owners}")
            for page, block_hash in cache.hash_of_page[group].items():
                if page not in cache.page_of_hash[group].get(block_hash, ()):
                    raise AssertionError(f"group {spec.name}: cache maps disagree on page {page}")
                if not pool.cached[group][page]:
                    raise AssertionError(f"group {spec.name}: registered page {page} not marked cached")
            marked = sum(pool.cached[group])
            if marked != len(cache.hash_of_page[group]):
                raise AssertionError(f"group {spec.name}: {marked} pages marked cached, {len(cache.hash_of_page[group])} registered")
            evictable = sum(1 for p in range(len(pool.refcount[group])) if pool.state(group, p) == CACHED)
            if evictable != pool.num_evictable[group]:
                raise AssertionError(f"group {spec.name}: num_evictable {pool.num_evictable[group]} != {evictable}")
            if pool.evictable_in_order(group).__len__() != evictable:
                raise AssertionError(f"group {spec.name}: LRU holds a different number of pages than {evictable}")
        free_slots = [0] * len(self.specs)
        for large, group in enumerate(pool.large_group):
            if group < 0:
                if large not in pool.free_large:
                    raise AssertionError(f"untyped large page {large} is not in the free list")
                continue
            per = self._per_large[group]
            pages = range(large * per, (large + 1) * per)
            states = [pool.state(group, p) for p in pages]
            slots = pool.large_free_slots[large]
            if sorted(slots) != [p - large * per for p, s in zip(pages, states) if s == FREE]:
                raise AssertionError(f"large page {large}: free-slot stack {sorted(slots)} disagrees with page states")
            if all(s == FREE for s in states):
                raise AssertionError(f"large page {large} is typed but all its small pages are free")
            if pool.large_live[large] != states.count(LIVE) or pool.large_cached[large] != states.count(CACHED):
                raise AssertionError(f"large page {large}: live/cached counters disagree with page states")
            if (large in pool.partial_set[group]) != bool(slots):
                raise AssertionError(f"large page {large}: partial-set membership wrong")
            free_slots[group] += len(slots)
            if large in pool.free_large:
                raise AssertionError(f"typed large page {large} is in the free list")
        if free_slots != pool.num_free_slots:
            raise AssertionError(f"free-slot counters {pool.num_free_slots} != {free_slots}")
        if len(set(pool.free_large)) != len(pool.free_large):
            raise AssertionError("free large-page list has duplicates")
