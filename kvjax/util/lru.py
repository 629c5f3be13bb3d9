"""Entries under a byte budget, least recently used out first: the serving engine's prefix carries
(`kvjax.serving.prefix_states`) and RAG chunk caches (`kvjax.rag.store`) live in one of these, or share one,
so a server bounds both with one budget and the coldest entry goes whichever kind it is (to a `DiskTier`, if any)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterator

from kvjax.util.disk_tier import DiskTier


class BytesLRU:
    """`key -> value` with each entry's size in bytes; inserting past `max_bytes` drops least recently used
    entries (a `get` or a repeated `put` counts as a use). An entry alone larger than the budget is not
    kept. Keys of different users sharing one LRU must not collide (prefix them). With a `disk` tier, entries
    evicted from memory are written there and a `get` that misses memory reads them back. A `pin`ned entry
    stays in memory until unpinned (the bytes may then exceed the budget, until the next unpin or put)."""

    def __init__(self, max_bytes: int, disk: DiskTier | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self._pins: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries or (self.disk is not None and key in self.disk)

    def keys(self) -> Iterator[Hashable]:
        return iter(list(self._entries))

    def size_of(self, key: Hashable) -> int:
        return self._entries[key][1]

    def get(self, key: Hashable, default=None):
        """The value (now the most recently used; read back from the disk tier if it was spilled), or `default`."""
        entry = self._entries.get(key)
        if entry is None:
            found = None if self.disk is None else self.disk.pop(key)
            if found is None:
                return default
            self.put(key, *found)
            return found[0]
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value, size: int) -> bool:
        """Insert or replace; returns whether the entry is kept (in memory, or on the disk tier)."""
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        if self.disk is not None:
            self.disk.discard(key)
        if size > self.max_bytes:  # alone past the memory budget: straight to the disk tier, if any
            return self.disk is not None and self.disk.put(key, value, size)
        self._entries[key] = (value, size)
        self.bytes += size
        self._evict()
        return True

    def _evict(self) -> None:
        """Drop least recently used unpinned entries (to the disk tier, if any) until within the budget."""
        while self.bytes > self.max_bytes:
            dropped_key = next((k for k in self._entries if k not in self._pins), None)
            if dropped_key is None:
                return
            dropped_value, dropped = self._entries.pop(dropped_key)
            self.bytes -= dropped
            self.evicted += 1
            if self.disk is not None:
                self.disk.put(dropped_key, dropped_value, dropped)

    def pin(self, key: Hashable) -> bool:
        """Keep `key`'s entry in memory, not evicted, until as many `unpin`s (a saved document while requests
        read it). False, and nothing pinned, when the entry is not in memory."""
        if key not in self._entries:
            return False
        self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, key: Hashable) -> None:
        """Undo one `pin`; the last one lets the entry be evicted again (at once when over the budget)."""
        if self._pins.get(key, 0) <= 1:
            self._pins.pop(key, None)
            self._evict()
        else:
            self._pins[key] -= 1

    def remove_if(self, predicate) -> None:
        """Drop every entry whose key satisfies `predicate`."""
        for key in [k for k in self._entries if predicate(k)]:
            self.bytes -= self._entries.pop(key)[1]
        for key in [] if self.disk is None else [k for k in self.disk.keys() if predicate(k)]:
            self.disk.discard(key)
