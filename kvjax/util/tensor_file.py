"""A safetensors file read in one pass: each tensor straight into the caller's array (a pool's first rows) while
its checksum (xxh3-64; CRC-32 and BLAKE2b for older files) is taken block by block, so a large saved state is
copied once, from the page cache, and only once checked; host arrays aligned so that XLA:CPU takes them as is."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from typing import Callable, NamedTuple

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}
BLOCK = 1 << 22  # bytes read (and checksummed while in cache) at a time
CHECKSUMS = ("xxh3_64", "crc32", "blake2b")  # the kind written first; the others are read in older files


class Checksum:
    """A running checksum of `kind` (one of CHECKSUMS): `update(block)`, then `value()` (xxh3-64 and BLAKE2b
    as hex strings, CRC-32 as an int, as headers hold them). xxh3 (the `xxhash` package) runs several times
    faster than zlib's CRC-32 and BLAKE2b."""

    def __init__(self, kind: str):
        if kind not in CHECKSUMS:
            raise ValueError(f"unknown checksum {kind!r} (known: {', '.join(CHECKSUMS)})")
        self.kind, self.crc = kind, 0
        if kind == "xxh3_64":
            import xxhash

            self.digest = xxhash.xxh3_64()
        elif kind == "blake2b":
            self.digest = hashlib.blake2b(digest_size=16)

    def update(self, block) -> None:
        if self.kind == "crc32":
            self.crc = zlib.crc32(block, self.crc)
        else:
            self.digest.update(block)

    def value(self) -> int | str:
        return self.crc if self.kind == "crc32" else self.digest.hexdigest()


class TensorFileError(ValueError):
    """A tensor file that is not a readable safetensors file (its header or its offsets are damaged)."""


class Entry(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


def tensor_index(file: str) -> tuple[int, dict[str, Entry]]:
    """`(header bytes, {name: Entry})` of safetensors `file`, its entries in file order."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= size - 8:
            raise TensorFileError(f"{file}: corrupt (no safetensors header: length {length} in a {size}-byte file)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise TensorFileError(f"{file}: corrupt (safetensors header: {error})") from None
    start, entries = 8 + length, {}
    for name, spec in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda item: item[1]["data_offsets"][0]):
        dtype = DTYPES.get(spec.get("dtype"))
        begin, end = (start + int(x) for x in spec["data_offsets"])
        shape = tuple(int(x) for x in spec["shape"])
        if dtype is None or not start <= begin <= end <= size or end - begin != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise TensorFileError(f"{file}: corrupt (tensor {name!r} has a damaged entry {spec})")
        entries[name] = Entry(np.dtype(dtype), shape, begin, end)
    return start, entries


def read_small(file: str, entries: dict[str, Entry], names) -> dict[str, np.ndarray]:
    """The tensors `names` of the file (seeked to, not checksummed: read again by `read_all`)."""
    out = {}
    with open(file, "rb") as f:
        for name in names:
            entry = entries[name]
            f.seek(entry.begin)
            out[name] = np.frombuffer(f.read(entry.end - entry.begin), entry.dtype).reshape(entry.shape).copy()
    return out


def read_all(file: str, entries: dict[str, Entry], into: Callable[[str, Entry], np.ndarray | None] = lambda *_: None,
             checksum: str = CHECKSUMS[0]) -> tuple[dict[str, np.ndarray], int | str]:
    """Every tensor of the file, in file order, read into `into(name, entry)` (a C-contiguous array of the
    entry's dtype and shape, e.g. a view of a pool's first rows) or, where that gives None, a new array; with
    the `checksum` of all the file's bytes, taken block by block as they are read. Returns `(arrays, value)`."""
    arrays, digest, position = {}, Checksum(checksum), 0
    with open(file, "rb", buffering=0) as f:
        def read(view: memoryview) -> None:
            nonlocal position
            for at in range(0, len(view), BLOCK):
                block, filled = view[at : at + BLOCK], 0
                while filled < len(block):  # a raw read may return less than asked before the end
                    count = f.readinto(block[filled:])
                    if not count:
                        raise TensorFileError(f"{file}: truncated (ends inside its data, at byte {position + filled})")
                    filled += count
                digest.update(block)
                position += len(block)

        for name, entry in entries.items():
            if entry.begin > position:  # the header, or a gap between tensors
                read(memoryview(bytearray(entry.begin - position)))
            array = into(name, entry)
            array = np.empty(entry.shape, entry.dtype) if array is None else array
            if array.shape != entry.shape or array.dtype.itemsize != entry.dtype.itemsize or not array.flags.c_contiguous:
                raise ValueError(f"cannot read tensor {name!r} ({entry.dtype}{list(entry.shape)}) into "
                                 f"{array.dtype}{list(array.shape)} (contiguous: {array.flags.c_contiguous})")
            read(memoryview(array.reshape(-1).view(np.uint8)))
            arrays[name] = array
        rest = os.fstat(f.fileno()).st_size - position
        if rest:
            read(memoryview(bytearray(rest)))
    return arrays, digest.value()


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `alignment`-byte boundary: XLA:CPU takes such host
    memory as a device buffer without copying it (`jax.device_put`), numpy's default 16-byte start it copies."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def file_checksum(file: str, checksum: str = CHECKSUMS[0]) -> int | str:
    """The `checksum` of a whole file, as `read_all` takes it."""
    digest = Checksum(checksum)
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.value()


__all__ = ["CHECKSUMS", "Checksum", "Entry", "TensorFileError", "aligned_empty", "file_checksum", "read_all",
           "read_small", "tensor_index"]
