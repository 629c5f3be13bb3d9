"""Chunk KV cache store: each chunk's K/V computed once by the main model, held as a one-row paged
`KVState` and keyed by a content hash.

Notes: docs/modules.md (`kvjax/rag/store.py`)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.state import KVState
from kvjax.engine.api import as_token_row
from kvjax.models.loading import Model
from kvjax.rag.cache_state import kv_from_state, state_from_kv
from kvjax.rag.encode import encode_kv
from kvjax.util.hashing import ROOT_HASH, hash_block
from kvjax.util.disk_tier import DiskTier
from kvjax.util.lru import BytesLRU

FORMS = ("pre_rope", "rotated")
_NAMESPACE = "rag-chunk"  # keys in a shared BytesLRU


class ChunkMismatchError(ValueError):
    """A chunk cache was made by another model or tokenizer than the one using it."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a chunk cache depends on besides its tokens: the model's weights and config, the tokenizer."""

    model: str
    tokenizer: str


def model_fingerprint(model: Model) -> Fingerprint:
    """Hash of the config, dtype and parameters (every leaf's shape, first 64K values and sum), and of the
    tokenizer (its serialized vocabulary and rules; the vocabulary size when there is none). Cached on the
    model object for its current parameters and tokenizer."""
    cached = getattr(model, "_rag_fingerprint", None)
    if cached is not None and cached[0] is model.params and cached[1] is model.tokenizer:
        return cached[2]
    fingerprint = _compute_fingerprint(model)
    model._rag_fingerprint = (model.params, model.tokenizer, fingerprint)
    return fingerprint


def _compute_fingerprint(model: Model) -> Fingerprint:
    digest = hashlib.blake2b(repr((model.cfg, jnp.dtype(model.dtype).name)).encode(), digest_size=16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(model.params):
        flat = jnp.ravel(leaf)
        digest.update(jax.tree_util.keystr(path).encode() + repr(leaf.shape).encode())
        digest.update(np.asarray(flat[:65536], np.float32).tobytes())
        digest.update(np.float64(jnp.sum(flat.astype(jnp.float32))).tobytes())
    return Fingerprint(model=digest.hexdigest(), tokenizer=tokenizer_fingerprint(model.tokenizer, model.cfg.vocab_size))


def tokenizer_fingerprint(tokenizer, vocab_size: int) -> str:
    if tokenizer is None:
        text = f"no tokenizer, vocab {vocab_size}"
    elif getattr(tokenizer, "backend_tokenizer", None) is not None:
        text = tokenizer.backend_tokenizer.to_str()
    else:
        text = repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def check_fingerprint(have: Fingerprint, want: Fingerprint, what: str) -> None:
    """Raise `ChunkMismatchError` naming what differs (tokenizer, model weights or both)."""
    if have == want:
        return
    parts = []
    if have.tokenizer != want.tokenizer:
        parts.append(f"another tokenizer (tokenizer fingerprint {have.tokenizer[:12]}, expected {want.tokenizer[:12]})")
    if have.model != want.model:
        parts.append(f"another model (model fingerprint {have.model[:12]}, expected {want.model[:12]})")
    raise ChunkMismatchError(f"{what} was encoded by {' and by '.join(parts)}; re-encode it with this model")


@dataclasses.dataclass(frozen=True)
class ChunkKV:
    """One cached sequence: slots 0..T-1 of every layer and kv head of a one-row `state`, on a pool of exactly
    the pages they fill, at positions start..start+T-1. With form "rotated" the state is what a prefill of the
    prefix and the chunk holds at the chunk's slots; with "pre_rope" its keys are those before rotation."""

    key: bytes  # content hash (prefix, tokens, form, factor set, fingerprint)
    tokens: np.ndarray  # int32[T]
    state: KVState
    start: int  # encoding position of tokens[0]
    form: str  # "pre_rope" or "rotated"
    long_rope: bool  # LongRoPE factor set used when encoding
    fingerprint: Fingerprint

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        """Device and host bytes the entry holds (its state's arrays and the tokens)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.state)) + self.tokens.nbytes

    def kv(self):
        """`(k, v)`, each `[L, T, H, D]`, in slot order (L = layers, T = tokens, H = kv heads, D = head dim)."""
        return tuple(x[:, 0] for x in kv_from_state(self.state, self.num_tokens))


class ChunkStore:
    """Content-hash keyed chunk caches of one model. `form` is "pre_rope" or "rotated"; `long_rope` is the
    LongRoPE factor set chunks are encoded with (match it to the assembled length; ignored by other types);
    `page_size` the pages' size of each entry's state."""

    def __init__(self, model: Model, form: str = "pre_rope", long_rope: bool = False, *, max_bytes: int | None = None,
                 lru: BytesLRU | None = None, page_size: int = 16, disk: DiskTier | None = None):
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {page_size}")
        if lru is not None and (max_bytes is not None or disk is not None):
            raise ValueError("pass max_bytes (and a disk tier) or a shared lru, not both")
        self.model, self.form, self.long_rope, self.page_size = model, form, bool(long_rope), page_size
        self.fingerprint = model_fingerprint(model)
        # entries live in a byte-bounded LRU: unbounded by default, or shared with the batch engine's prefix
        # carries (`BatchEngine.cache`) so one budget bounds both; past it, entries spill to `disk` if given
        self.lru = lru if lru is not None else BytesLRU(max_bytes if max_bytes is not None else 1 << 62, disk=disk)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return sum(1 for k in self.lru.keys() if k[0] == _NAMESPACE)

    def get(self, key: bytes) -> ChunkKV | None:
        """The entry of content hash `key` (now the most recently used), or None."""
        return self.lru.get((_NAMESPACE, key))

    def _keep(self, entry: ChunkKV) -> ChunkKV:
        self.lru.put((_NAMESPACE, entry.key), entry, entry.nbytes)
        return entry

    def key(self, prefix_tokens, tokens) -> bytes:
        """Content hash of `tokens` encoded after `prefix_tokens` (`None` for the prefix entry itself)."""
        extra = f"{self.form}|{self.long_rope}|{self.fingerprint.model}|{self.fingerprint.tokenizer}".encode()
        parent = hash_block(ROOT_HASH, [int(t) for t in prefix_tokens], extra)
        return parent if tokens is None else hash_block(parent, [int(t) for t in tokens], extra)

    def put(self, entry: ChunkKV) -> None:
        """Insert an entry made elsewhere; it must come from this model, tokenizer, form and factor set."""
        check_fingerprint(entry.fingerprint, self.fingerprint, f"chunk {entry.key.hex()[:12]}")
        if (entry.form, entry.long_rope) != (self.form, self.long_rope):
            raise ValueError(
                f"chunk {entry.key.hex()[:12]} is stored as {entry.form} with long_rope={entry.long_rope}; this "
                f"store holds {self.form} with long_rope={self.long_rope}"
            )
        self._keep(entry)

    def prefix(self, prefix_tokens) -> ChunkKV:
        """The shared prefix's entry (encoded on first use), at positions 0..P-1."""
        prefix_tokens = as_token_row(prefix_tokens, self.model.cfg.vocab_size, "prefix_tokens")
        key = self.key(prefix_tokens, None)
        entry = self.get(key)
        if entry is None:
            self.misses += 1
            k_pre, k, v = self._encode(prefix_tokens[None, :])
            entry = self._keep(self._entry(key, prefix_tokens, k_pre[:, 0], k[:, 0], v[:, 0], 0))
        else:
            self.hits += 1
        return entry

    def chunks(self, prefix_tokens, chunk_token_lists: Sequence) -> list[ChunkKV]:
        """Entries of each chunk encoded after `prefix_tokens`, encoding the missing ones (chunks of equal
        length in one batched forward)."""
        vocab = self.model.cfg.vocab_size
        prefix_tokens = as_token_row(prefix_tokens, vocab, "prefix_tokens")
        chunks = [as_token_row(c, vocab, f"chunk {i}") for i, c in enumerate(chunk_token_lists)]
        keys = [self.key(prefix_tokens, c) for c in chunks]
        found = {}  # held here: a later insertion may evict an entry this call returns
        missing: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            if key in found or any(keys[j] == key for group in missing.values() for j in group):
                continue
            entry = self.get(key)
            if entry is not None:
                found[key] = entry
                continue
            missing.setdefault(len(chunks[i]), []).append(i)
        self.misses += sum(len(g) for g in missing.values())
        self.hits += len(chunks) - sum(len(g) for g in missing.values())
        P = len(prefix_tokens)
        for group in missing.values():
            batch = np.stack([np.concatenate([prefix_tokens, chunks[i]]) for i in group])
            k_pre, k, v = self._encode(batch)
            for row, i in enumerate(group):
                found[keys[i]] = self._keep(
                    self._entry(keys[i], chunks[i], k_pre[:, row, P:], k[:, row, P:], v[:, row, P:], P))
        return [found[key] for key in keys]

    def _encode(self, tokens: np.ndarray):
        m = self.model
        return encode_kv(m.params, jnp.asarray(tokens), cfg=m.cfg, dtype=m.dtype, long_rope=self.long_rope)

    def _entry(self, key, tokens, k_pre, k, v, start) -> ChunkKV:
        """An entry of `k_pre, k, v [L, T, H, D]` (keys before and after RoPE, values) at positions start.."""
        keys = k_pre if self.form == "pre_rope" else k
        T = len(tokens)
        state = state_from_kv(self.model.cfg, keys[:, None], v[:, None], start + np.arange(T, dtype=np.int32)[None],
                              capacity=T, page_size=self.page_size, long_rope=self.long_rope)
        return ChunkKV(key, tokens, state, start, self.form, self.long_rope, self.fingerprint)
