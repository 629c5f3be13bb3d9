"""Chained block hashes naming token prefixes, shared by prefix caching (serving) and chunk stores (rag):
block i's hash covers its tokens and the hash of block i - 1, so one hash names a whole prefix (as vLLM's do)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

HASH_BYTES = 16
ROOT_HASH = hashlib.blake2b(b"kvjax.serving prefix root", digest_size=HASH_BYTES).digest()


def hash_block(parent_hash: bytes, block_token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Hash of one block given its parent's hash: blake2b(parent || int64 tokens || extra_key).

    `extra_key` separates caches that must not share entries for the same tokens (a LoRA adapter, a
    cache salt). Token ids must fit in int64.
    """
    digest = hashlib.blake2b(parent_hash, digest_size=HASH_BYTES)
    try:
        digest.update(array("q", block_token_ids).tobytes())
    except (OverflowError, TypeError) as error:
        raise ValueError(f"block token ids must be int64 integers, got {list(block_token_ids)[:8]}...") from error
    digest.update(extra_key)
    return digest.digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_tokens: int,
    start_block: int = 0,
    parent_hash: bytes = ROOT_HASH,
    extra_key: bytes = b"",
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on.

    `parent_hash` is the hash of block start_block - 1 (ROOT_HASH for block 0). Returns one hash per full
    block: entry k names the prefix token_ids[: (start_block + k + 1) * block_tokens]. A trailing partial
    block gets no hash.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    hashes = []
    parent = parent_hash
    for block in range(start_block, len(token_ids) // block_tokens):
        parent = hash_block(parent, token_ids[block * block_tokens : (block + 1) * block_tokens], extra_key)
        hashes.append(parent)
    return hashes
