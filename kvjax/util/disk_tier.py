"""A disk tier under a `BytesLRU`: entries the memory budget evicts are written to a directory (their arrays;
the rest stays in an in-memory index), within a disk budget, and come back to memory on a hit."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np


@dataclass
class DiskStats:
    hits: int = 0  # lookups the disk answered (the entry came back to memory)
    misses: int = 0  # lookups that found the entry in neither tier
    spilled: int = 0  # entries written
    spilled_bytes: int = 0
    read_bytes: int = 0
    dropped: int = 0  # entries the disk budget pushed out (or too large for it)

    @property
    def hit_rate(self) -> float:
        """Share of lookups that missed memory and were answered from disk."""
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


@dataclass(frozen=True)
class _Array:
    """A placeholder for an array written to disk: where it is in the entry's file and how to read it."""

    offset: int
    dtype: str
    shape: tuple
    device: bool  # a jax array (put back on the default device) or a numpy one


def _map(value: Any, is_leaf, fn) -> Any:
    """`value` with `fn` applied to each part where `is_leaf` holds, through tuples, named tuples, lists, dicts
    and dataclasses (KVState, PrefillCarry, ChunkKV); every other part kept as it is."""
    if is_leaf(value):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(v, is_leaf, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, is_leaf, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, is_leaf, fn) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _map(getattr(value, f.name), is_leaf, fn) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    return value


def _split(value: Any, arrays: list) -> Any:
    """`value` with every array replaced by an `_Array` placeholder, the arrays appended to `arrays`."""
    import jax

    def put(x):
        array = np.asarray(x)
        offset = sum(a.nbytes for a in arrays)
        arrays.append(array)
        return _Array(offset, array.dtype.name, array.shape, isinstance(x, jax.Array))

    return _map(value, lambda x: isinstance(x, (np.ndarray, jax.Array)), put)


def _join(skeleton: Any, data: bytes) -> Any:
    """The value `_split` took apart, its arrays read from the entry's bytes."""
    import jax.numpy as jnp

    def read(slot: _Array):
        dtype = jnp.dtype(slot.dtype)  # bfloat16 included (ml_dtypes)
        array = np.frombuffer(data, dtype, int(np.prod(slot.shape)), slot.offset).reshape(slot.shape)
        return jnp.asarray(array) if slot.device else array.copy()

    return _map(skeleton, lambda x: isinstance(x, _Array), read)


class DiskTier:
    """Entries spilled from memory, one file each under `directory` (default: a fresh temporary one, removed
    by `close`), at most `max_bytes` on disk, least recently spilled or read out first. Its index lives in
    memory: the tier extends one process's cache, it does not persist across processes."""

    def __init__(self, max_bytes: int, directory: str | os.PathLike | None = None):
        if max_bytes < 0:
            raise ValueError(f"disk max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._owned = directory is None
        self.directory = tempfile.mkdtemp(prefix="kvjax-disk-tier-") if directory is None else os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._entries: OrderedDict[Hashable, tuple[str, Any, int, int]] = OrderedDict()  # file, skeleton, bytes, size
        self._names = itertools.count()
        self.bytes = 0
        self.stats = DiskStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def put(self, key: Hashable, value: Any, size: int) -> bool:
        """Write `value` (whose memory size is `size`) unless alone larger than the budget; pushes out the
        oldest entries past the budget. Returns whether it was written."""
        self.discard(key)
        arrays: list = []
        skeleton = _split(value, arrays)
        written = sum(a.nbytes for a in arrays)
        if written > self.max_bytes:
            self.stats.dropped += 1
            return False
        while self.bytes + written > self.max_bytes:
            self.discard(next(iter(self._entries)))
            self.stats.dropped += 1
        file = os.path.join(self.directory, f"{next(self._names)}.bin")
        with open(file, "wb") as f:
            for array in arrays:
                f.write(np.ascontiguousarray(array).tobytes())
        self._entries[key] = (file, skeleton, written, size)
        self.bytes += written
        self.stats.spilled += 1
        self.stats.spilled_bytes += written
        return True

    def pop(self, key: Hashable) -> tuple[Any, int] | None:
        """`(value, its memory size)` read back and removed from disk, or None (counted as a miss)."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        file, skeleton, written, size = entry
        with open(file, "rb") as f:
            data = f.read()
        self.discard(key)
        self.stats.hits += 1
        self.stats.read_bytes += written
        return _join(skeleton, data), size

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[2]
            try:
                os.remove(entry[0])
            except FileNotFoundError:
                pass

    def keys(self) -> list:
        return list(self._entries)

    def close(self) -> None:
        """Remove every entry's file (and the directory, when the tier made it)."""
        for key in self.keys():
            self.discard(key)
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["DiskStats", "DiskTier"]
