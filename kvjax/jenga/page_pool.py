"""Host-side state of the two-level pool: which large pages are typed as which group, and the state of
every small page (free, live with a refcount, or cached and evictable in LRU order).

Notes: docs/modules.md (`kvjax/jenga/page_pool.py`)."""

from __future__ import annotations

import heapq
from typing import Callable

from kvjax.jenga.layout import PoolLayout

FREE, LIVE, CACHED = "free", "live", "cached"

# Release times at or above this rank after every ordinary release: pages a running request released
# early (sliding-window blocks out of the window), evictable but kept while finished requests' pages go.
HELD_BY_RUNNING = 1 << 62


class Journal:
    """Undo log: while open, every recorded closure is run in reverse order by `rollback`."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] | None = None

    @property
    def is_open(self) -> bool:
        return self._undo is not None

    def begin(self) -> None:
        if self._undo is not None:
            raise RuntimeError("a journal transaction is already open")
        self._undo = []

    def record(self, undo: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def commit(self) -> None:
        self._undo = None

    def rollback(self) -> None:
        undo, self._undo = self._undo, None
        for step in reversed(undo or []):
            step()


class TwoLevelPagePool:
    """Large pages (all `layout.large_page_bytes` long), each free or typed as one group and split into
    `layout.pages_per_large(group)` small pages.

    Small page states: FREE (in its large page's free-slot stack), LIVE (refcount > 0), CACHED (refcount 0
    but registered in the prefix cache; evictable, ordered by (last release time, deeper prefix first)).
    A large page is returned to the free list exactly when all its small pages are FREE.
    """

    def __init__(self, layout: PoolLayout, journal: Journal) -> None:
        self.layout = layout
        self.journal = journal
        groups = range(len(layout.specs))
        self.per_large = [layout.pages_per_large(g) for g in groups]
        num_large = layout.num_large_pages
        self.large_group = [-1] * num_large
        self.large_free_slots: list[list[int]] = [[] for _ in range(num_large)]
        self.large_live = [0] * num_large
        self.large_cached = [0] * num_large
        self.free_large = list(range(num_large))  # a heap: the lowest free large page is taken first
        self.partial_set: list[set[int]] = [set() for _ in groups]  # typed large pages with a free slot
        self.partial_heap: list[list[int]] = [[] for _ in groups]
        self.refcount = [[0] * layout.num_pages(g) for g in groups]
        self.cached = [[False] * layout.num_pages(g) for g in groups]
        self.page_end = [[0] * layout.num_pages(g) for g in groups]  # prefix end token of a cached page
        self.last_release = [[0] * layout.num_pages(g) for g in groups]
        self.lru_version = [[0] * layout.num_pages(g) for g in groups]
        self.lru: list[list[tuple[int, int, int, int]]] = [[] for _ in groups]
        self.num_evictable = [0] * len(layout.specs)
        self.num_free_slots = [0] * len(layout.specs)  # free small pages in large pages typed as the group
        self.clock = 0

    # --- queries --------------------------------------------------------------------------------------
    def state(self, group: int, page: int) -> str:
        if self.refcount[group][page] > 0:
            return LIVE
        return CACHED if self.cached[group][page] else FREE

    def large_of(self, group: int, page: int) -> int:
        return page // self.per_large[group]

    def num_free_large(self) -> int:
        return len(self.free_large)

    def free_slots_of(self, group: int) -> int:
        """Free small pages of `group` inside large pages already typed as `group`."""
        return self.num_free_slots[group]

    def has_free_slot(self, large: int) -> bool:
        return bool(self.large_free_slots[large])

    def first_partial(self, group: int) -> int | None:
        """The lowest large page typed as `group` that has a free slot."""
        heap, members = self.partial_heap[group], self.partial_set[group]
        while heap and heap[0] not in members:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def oldest_evictable(self, group: int) -> int | None:
        """The evictable page of `group` to evict first (oldest release, then deepest prefix)."""
        heap, versions = self.lru[group], self.lru_version[group]
        while heap:
            _, _, page, version = heap[0]
            if version == versions[page] and self.refcount[group][page] == 0 and self.cached[group][page]:
                return page
            heapq.heappop(heap)
        return None

    def lru_key(self, group: int, page: int) -> tuple[int, int, int]:
        """Eviction order key of a cached page: oldest release first, then the deeper prefix."""
        return (self.last_release[group][page], -self.page_end[group][page], page)

    def evictable_in_order(self, group: int) -> list[int]:
        """All evictable pages of `group`, first to be evicted first."""
        versions = self.lru_version[group]
        live = [
            entry
            for entry in self.lru[group]
            if entry[3] == versions[entry[2]] and self.refcount[group][entry[2]] == 0 and self.cached[group][entry[2]]
        ]
        return [entry[2] for entry in sorted(live)]

    def reclaimable_large_pages(self) -> list[int]:
        """Typed large pages with no live small page (only free and evictable ones), oldest first: the
        key is the newest release time among their cached pages."""
        candidates = []
        for large, group in enumerate(self.large_group):
            if group >= 0 and self.large_live[large] == 0 and self.large_cached[large] > 0:
                first = large * self.per_large[group]
                pages = range(first, first + self.per_large[group])
                newest = max(self.last_release[group][p] for p in pages if self.cached[group][p])
                candidates.append((newest, large))
        return [large for _, large in sorted(candidates)]

    # --- large pages ----------------------------------------------------------------------------------
    def take_free_large(self, group: int) -> int | None:
        """Types the lowest free large page as `group` (all its slots free). None when there is none."""
        if not self.free_large:
            return None
        large = heapq.heappop(self.free_large)
        self._type_large(large, group)
        self.journal.record(lambda: self._untype_large(large))
        return large

    def _type_large(self, large: int, group: int, slot_order: list[int] | None = None) -> None:
        self.large_group[large] = group
        # Stack of free slots, slot 0 on top, so a fresh large page fills from its start.
        slots = list(range(self.per_large[group] - 1, -1, -1)) if slot_order is None else list(slot_order)
        self.large_free_slots[large] = slots
        self.num_free_slots[group] += len(slots)
        self._add_partial(group, large)

    def _untype_large(self, large: int) -> None:
        group = self.large_group[large]
        self.partial_set[group].discard(large)
        self.num_free_slots[group] -= len(self.large_free_slots[large])
        self.large_group[large] = -1
        self.large_free_slots[large] = []
        heapq.heappush(self.free_large, large)

    def _pop_slot(self, group: int, large: int) -> int:
        slots = self.large_free_slots[large]
        slot = slots.pop()
        self.num_free_slots[group] -= 1
        if not slots:
            self.partial_set[group].discard(large)
        return slot

    def _push_slot(self, group: int, large: int, slot: int) -> None:
        self.large_free_slots[large].append(slot)
        self.num_free_slots[group] += 1
        self._add_partial(group, large)

    def release_large_if_empty(self, large: int) -> None:
        """Returns a typed large page whose small pages are all free to the free list."""
        self._release_large_if_empty(large)

    def _release_large_if_empty(self, large: int) -> None:
        group = self.large_group[large]
        if len(self.large_free_slots[large]) != self.per_large[group]:
            return
        slot_order = list(self.large_free_slots[large])
        self._untype_large(large)

        def undo() -> None:
            self.free_large.remove(large)
            heapq.heapify(self.free_large)
            self._type_large(large, group, slot_order)

        self.journal.record(undo)

    def _add_partial(self, group: int, large: int) -> None:
        if large not in self.partial_set[group]:
            self.partial_set[group].add(large)
            heapq.heappush(self.partial_heap[group], large)

    # --- small pages ----------------------------------------------------------------------------------
    def take_slot(self, group: int, large: int) -> int:
        """Makes the next free slot of `large` (typed as `group`) a LIVE page with refcount 1."""
        if self.large_group[large] != group:
            raise ValueError(f"large page {large} is typed {self.large_group[large]}, not group {group}")
        slot = self._pop_slot(group, large)
        page = large * self.per_large[group] + slot
        self.refcount[group][page] = 1
        self.large_live[large] += 1

        def undo() -> None:
            self.refcount[group][page] = 0
            self.large_live[large] -= 1
            self._push_slot(group, large, slot)

        self.journal.record(undo)
        return page

    def _free_slot(self, group: int, page: int) -> None:
        large, slot = divmod(page, self.per_large[group])
        self._push_slot(group, large, slot)

        def undo() -> None:
            popped = self._pop_slot(group, large)
            assert popped == slot, (popped, slot)

        self.journal.record(undo)
        self._release_large_if_empty(large)

    def incref(self, group: int, page: int) -> None:
        """Adds a reference; a CACHED page becomes LIVE (and leaves the LRU)."""
        refs = self.refcount[group]
        was_cached = refs[page] == 0
        if was_cached and not self.cached[group][page]:
            raise ValueError(f"cannot reference free page {page} of group {group}")
        large = page // self.per_large[group]
        refs[page] += 1
        if was_cached:
            self._leave_lru(group, page, large)
        if self.journal.is_open:
            self.journal.record(lambda: self._undo_incref(group, page, large, was_cached))

    def _undo_incref(self, group: int, page: int, large: int, was_cached: bool) -> None:
        self.refcount[group][page] -= 1
        if was_cached:
            self._enter_lru(group, page, large)

    def decref(self, group: int, page: int, release_time: int | None = None) -> None:
        """Drops a reference; at zero the page becomes CACHED (if registered) or FREE.

        A cached page's eviction order uses `release_time` (default: the clock)."""
        refs = self.refcount[group]
        if refs[page] <= 0:
            raise ValueError(f"page {page} of group {group} has no reference to drop")
        refs[page] -= 1
        if refs[page] > 0:
            self.journal.record(lambda: refs.__setitem__(page, refs[page] + 1))
            return
        large = self.large_of(group, page)
        if self.cached[group][page]:
            previous_release = self.last_release[group][page]
            self.last_release[group][page] = self.clock if release_time is None else release_time
            self._enter_lru(group, page, large)

            def undo_cached() -> None:
                self._leave_lru(group, page, large)
                self.last_release[group][page] = previous_release
                refs[page] = 1

            self.journal.record(undo_cached)
        else:
            self.large_live[large] -= 1

            def undo_live() -> None:
                self.large_live[large] += 1
                refs[page] = 1

            self.journal.record(undo_live)
            self._free_slot(group, page)

    def retime(self, group: int, page: int, release_time: int) -> None:
        """Moves an evictable page to `release_time` in the eviction order (not journaled)."""
        if self.refcount[group][page] != 0 or not self.cached[group][page]:
            raise ValueError(f"page {page} of group {group} is not evictable")
        self.last_release[group][page] = release_time
        self.lru_version[group][page] += 1
        key = (release_time, -self.page_end[group][page], page, self.lru_version[group][page])
        heapq.heappush(self.lru[group], key)

    def _enter_lru(self, group: int, page: int, large: int) -> None:
        """LIVE -> evictable bookkeeping (refcount already 0)."""
        self.large_live[large] -= 1
        self.large_cached[large] += 1
        self.num_evictable[group] += 1
        self.lru_version[group][page] += 1
        key = (self.last_release[group][page], -self.page_end[group][page], page, self.lru_version[group][page])
        heapq.heappush(self.lru[group], key)

    def _leave_lru(self, group: int, page: int, large: int) -> None:
        """Evictable -> LIVE bookkeeping."""
        self.large_live[large] += 1
        self.large_cached[large] -= 1
        self.num_evictable[group] -= 1
        self.lru_version[group][page] += 1  # the heap entry goes stale

    # --- cache registration ---------------------------------------------------------------------------
    def mark_cached(self, group: int, page: int, prefix_end: int) -> None:
        """Registers a LIVE page in the prefix cache: at refcount 0 it will be evictable, not free."""
        if self.refcount[group][page] <= 0 or self.cached[group][page]:
            raise ValueError(f"page {page} of group {group} must be live and unregistered to be cached")
        self.cached[group][page] = True
        previous_end = self.page_end[group][page]
        self.page_end[group][page] = prefix_end

        def undo() -> None:
            self.cached[group][page] = False
            self.page_end[group][page] = previous_end

        self.journal.record(undo)

    def unmark_cached(self, group: int, page: int) -> None:
        """Removes a registration. A LIVE page stays live; an evictable page becomes FREE (evicted)."""
        if not self.cached[group][page]:
            raise ValueError(f"page {page} of group {group} is not cached")
        large = self.large_of(group, page)
        evicted = self.refcount[group][page] == 0
        if evicted:
            self._leave_lru(group, page, large)
            self.large_live[large] -= 1
        self.cached[group][page] = False

        def undo() -> None:
            self.cached[group][page] = True
            if evicted:
                self.large_live[large] += 1
                self._enter_lru(group, page, large)

        self.journal.record(undo)
        if evicted:
            self._free_slot(group, page)
