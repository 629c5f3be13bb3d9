"""Layer-group specs for heterogeneous KV memory: what one page of each type holds and how long it lives.

A *group* is a set of layers that advance in lockstep and share one page table per request; one page of a
group holds `tokens_per_page` tokens of every layer (and head) in the group. See docs/jenga.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, ClassVar

# Bytes per element of the dtypes a cache may use. Kept here (not jnp.dtype) so the allocator is pure host
# code that does not import jax.
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def _check_positive(owner: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {key} must be a positive int, got {value!r}")


class GroupSpec:
    """Base of all group specs. Subclasses are frozen dataclasses.

    Memory: `page_shape` and `dtype` describe one small page; `page_bytes` is its size in bytes.
    Lifetime: `is_positional` groups store token i of a request at block i // tokens_per_page (full
    attention, sliding windows, Quest metadata, an auxiliary model); a non-positional group (budgeted
    layers) stores its kept slots compacted into its first pages. `requires_full_prefix` groups need every
    block of a prefix to reuse it (full attention, Quest metadata, auxiliary model); a sliding window needs
    only the blocks of its last window.
    """

    name: str
    tokens_per_page: int
    is_positional: ClassVar[bool] = True
    requires_full_prefix: ClassVar[bool] = True
    caches_prefix: ClassVar[bool] = True  # False: the group's pages are a request's own, never cached or shared

    # --- memory ---------------------------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        raise NotImplementedError

    @property
    def page_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @cached_property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.itemsize

    @cached_property
    def bytes_per_token(self) -> float:
        """Average bytes per cached token (all layers of the group)."""
        return self.page_bytes / self.tokens_per_page

    @property
    def layer_token_bytes(self) -> float:
        """Bytes per token per layer, the unit uniform paging sizes every layer by."""
        return self.bytes_per_token / self.num_layers

    # --- lifetime (positional groups) -------------------------------------------------------------------
    def first_needed_token(self, num_tokens: int) -> int:
        """First position the next query (at position `num_tokens`) still reads. Full prefix: 0."""
        return 0

    def needed_bytes_in_block(self, block_index: int, num_tokens: int) -> float:
        """Bytes of block `block_index` holding tokens some layer of the group still needs, when the
        request has `num_tokens` tokens (computed plus in flight)."""
        return self.needed_bytes_in_range(block_index, block_index + 1, num_tokens)

    def needed_bytes_in_range(self, first_block: int, end_block: int, num_tokens: int) -> float:
        """needed_bytes_in_block summed over blocks first_block .. end_block - 1, in closed form."""
        start = max(self.first_needed_token(num_tokens), first_block * self.tokens_per_page)
        end = min(num_tokens, end_block * self.tokens_per_page)
        return max(0, end - start) * self.bytes_per_token

    # --- prefix hits ------------------------------------------------------------------------------------
    def largest_hit(self, limit: int, is_cached: Callable[[int], bool]) -> int:
        """Largest prefix length L <= `limit` (a multiple of tokens_per_page, or 0) this group can reuse.

        `is_cached(end)` says whether the cache holds this group's entry for the prefix ending at token
        `end` (a multiple of tokens_per_page): the page of the block [end - tokens_per_page, end).
        Full prefix: every block up to L must be cached.
        """
        num_blocks = limit // self.tokens_per_page
        for block in range(num_blocks):
            if not is_cached((block + 1) * self.tokens_per_page):
                return block * self.tokens_per_page
        return num_blocks * self.tokens_per_page

    def _validate_common(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{type(self).__name__}: name must be a non-empty string, got {self.name!r}")
        _check_positive(f"{type(self).__name__} {self.name!r}", tokens_per_page=self.tokens_per_page)


@dataclass(frozen=True, kw_only=True)
class _KVLayout(GroupSpec):
    """Fields shared by the attention-shaped groups: one page is [layers, 2 (k, v), tokens, heads, dim]."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    tokens_per_page: int = 16

    def __post_init__(self) -> None:
        self._validate_common()
        _check_positive(
            f"{type(self).__name__} {self.name!r}",
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: dtype must be one of {sorted(DTYPE_BYTES)}, "
                f"got {self.dtype!r}"
            )

    @property
    def page_shape(self) -> tuple[int, ...]:
        # [layers, k/v, tokens, kv_heads, head_dim]: one layer's keys of a page are contiguous, the order
        # the single-head pool of kvjax.cache.state reads them in.
        return (self.num_layers, 2, self.tokens_per_page, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(_KVLayout):
    """Full-attention layers: every token is kept for the request's whole life."""


@dataclass(frozen=True, kw_only=True)
class AuxiliaryModelSpec(_KVLayout):
    """The KV cache of an auxiliary model run over the same tokens (CacheClip's small model, a draft
    model): full attention with its own layer count, head count and head dim."""

    model: str = ""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(_KVLayout):
    """Sliding-window layers (Mistral, Gemma-2's local layers): the query at position p reads keys
    p - window + 1 .. p, so blocks wholly before the last `window - 1` tokens can be freed early."""

    window: int
    requires_full_prefix: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(f"SlidingWindowSpec {self.name!r}", window=self.window)

    def first_needed_token(self, num_tokens: int) -> int:
        return max(0, num_tokens - (self.window - 1))

    def largest_hit(self, limit: int, is_cached: Callable[[int], bool]) -> int:
        """Largest L <= limit whose last `window - 1` tokens lie in cached blocks (all blocks when
        L < window - 1); earlier blocks may have been evicted."""
        tpp = self.tokens_per_page
        num_blocks = limit // tpp
        blocks_needed = -(-(self.window - 1) // tpp)
        cached = [is_cached((b + 1) * tpp) for b in range(num_blocks)]
        run_ending_at = [0] * (num_blocks + 1)  # run_ending_at[k]: cached blocks ending just before k
        for k in range(1, num_blocks + 1):
            run_ending_at[k] = run_ending_at[k - 1] + 1 if cached[k - 1] else 0
        for k in range(num_blocks, 0, -1):
            if run_ending_at[k] >= min(blocks_needed, k):
                return k * tpp
        return 0


@dataclass(frozen=True, kw_only=True)
class QuestMetadataSpec(_KVLayout):
    """Quest's per-page key bounds: for each `quest_page_size` tokens, an elementwise kmin and kmax vector
    per layer and kv head. A slot is one Quest page, so one small page holds
    tokens_per_page // quest_page_size entries: [layers, 2 (min, max), entries, kv_heads, head_dim]."""

    quest_page_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(f"QuestMetadataSpec {self.name!r}", quest_page_size=self.quest_page_size)
        if self.tokens_per_page % self.quest_page_size:
            raise ValueError(
                f"QuestMetadataSpec {self.name!r}: tokens_per_page ({self.tokens_per_page}) must be a "
                f"multiple of quest_page_size ({self.quest_page_size})"
            )

    @property
    def page_shape(self) -> tuple[int, ...]:
        entries = self.tokens_per_page // self.quest_page_size
        return (self.num_layers, 2, entries, self.num_kv_heads, self.head_dim)

    def needed_bytes_in_range(self, first_block: int, end_block: int, num_tokens: int) -> float:
        # A partly filled Quest page still needs its whole entry.
        start = first_block * self.tokens_per_page
        tokens = max(0, min(num_tokens, end_block * self.tokens_per_page) - start)
        entry_bytes = self.page_bytes * self.quest_page_size // self.tokens_per_page
        return -(-tokens // self.quest_page_size) * entry_bytes


@dataclass(frozen=True, kw_only=True)
class BudgetedSpec(_KVLayout):
    """Layers under an eviction policy that keeps at most `budget` slots per kv-head (H2O, TOVA, Locret,
    StreamingLLM...). Kept slots are compacted into the group's first pages; the allocator holds
    ceil(kept / tokens_per_page) pages between steps and kept + new slots during a step.

    Prefix reuse: the kept set after a prefix depends on the whole prefix and on the policy (`policy` names
    it and its parameters), so a hit is only possible at a length where a snapshot of this group's state
    was stored. With `snapshot_every` set, the allocator stores one at every commit whose length is a
    multiple of it; the engine must then prefill in chunks whose boundaries fall on those multiples so the
    state there is a function of the prefix alone.
    """

    budget: int
    policy: str = ""
    snapshot_every: int | None = None
    is_positional: ClassVar[bool] = False
    requires_full_prefix: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(f"BudgetedSpec {self.name!r}", budget=self.budget)
        if self.snapshot_every is not None:
            _check_positive(f"BudgetedSpec {self.name!r}", snapshot_every=self.snapshot_every)
            if self.snapshot_every % self.tokens_per_page:
                raise ValueError(
                    f"BudgetedSpec {self.name!r}: snapshot_every ({self.snapshot_every}) must be a multiple "
                    f"of tokens_per_page ({self.tokens_per_page})"
                )

    def kept_slots(self, num_tokens: int) -> int:
        """Slots the policy keeps after processing `num_tokens` tokens."""
        return min(num_tokens, self.budget)

    def largest_hit(self, limit: int, is_cached: Callable[[int], bool]) -> int:
        """Largest L <= limit where a snapshot of this group's state is cached."""
        if self.snapshot_every is None:
            return 0
        length = limit // self.snapshot_every * self.snapshot_every
        while length > 0 and not is_cached(length):
            length -= self.snapshot_every
        return max(length, 0)


@dataclass(frozen=True, kw_only=True)
class RingWindowSpec(_KVLayout):
    """Sliding-window layers kept as a ring, as kvjax's batch engine runs them: each head holds at most its
    last `window` slots, and a new token fills the slot the oldest one left, so the group's pages stop
    growing at ceil(window / tokens_per_page) and are rewritten in place as the window moves. Those pages
    are the request's own (never cached or shared); a prefix hit needs nothing from them, since every
    request brings its window from its own prefill (or from a prefill carry that holds the window)."""

    window: int
    is_positional: ClassVar[bool] = False
    requires_full_prefix: ClassVar[bool] = False
    caches_prefix: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(f"RingWindowSpec {self.name!r}", window=self.window)

    def largest_hit(self, limit: int, is_cached: Callable[[int], bool]) -> int:
        return limit


@dataclass(frozen=True, kw_only=True)
class UniformPagingSpec(GroupSpec):
    """The baseline Jenga is measured against (vLLM v0's layout): every layer of every member group is
    stored like a full-attention layer with the largest per-token-per-layer size among the members, one
    page holding `tokens_per_page` tokens of all those layers, for the request's whole life.

    `needed_bytes_in_block` still counts what the members really need, so waste can be compared.
    """

    members: tuple[GroupSpec, ...]
    name: str = "uniform"
    tokens_per_page: int = 16

    def __post_init__(self) -> None:
        self._validate_common()
        if not self.members or not all(isinstance(m, GroupSpec) for m in self.members):
            raise ValueError(f"UniformPagingSpec: members must be a non-empty tuple of GroupSpec, got {self.members!r}")
        if any(isinstance(m, UniformPagingSpec) for m in self.members):
            raise ValueError("UniformPagingSpec: members cannot themselves be uniform specs")

    @property
    def dtype(self) -> str:
        return "uint8"

    @property
    def num_layers(self) -> int:
        return sum(m.num_layers for m in self.members)

    @cached_property
    def page_shape(self) -> tuple[int, ...]:
        widest = max(math.ceil(m.layer_token_bytes) for m in self.members)
        return (self.num_layers, self.tokens_per_page, widest)

    def needed_bytes_in_range(self, first_block: int, end_block: int, num_tokens: int) -> float:
        tpp = self.tokens_per_page
        start, end = first_block * tpp, min(num_tokens, end_block * tpp)
        total = 0.0
        for member in self.members:
            if member.is_positional:
                # Counted per token: a member with longer pages (Quest) is charged its average bytes.
                first = max(start, member.first_needed_token(num_tokens))
                total += max(0, end - first) * member.bytes_per_token
            else:
                # A budgeted member keeps min(n, budget) of n tokens; which ones is the policy's choice, so
                # charge every token the kept fraction.
                kept_fraction = member.kept_slots(num_tokens) / num_tokens if num_tokens else 0.0
                total += max(0, end - start) * kept_fraction * member.bytes_per_token
        return total


def hit_alignment(specs: tuple[GroupSpec, ...] | list[GroupSpec]) -> int:
    """Token granularity of a prefix hit valid for every group: the LCM of their page lengths."""
    return math.lcm(*(s.tokens_per_page for s in specs))


def base_hash_block_tokens(specs: tuple[GroupSpec, ...] | list[GroupSpec]) -> int:
    """Token count of the base hash block: the GCD of the page lengths, so every group's page ends on a
    base-block boundary and can be keyed by the chained hash there."""
    return math.gcd(*(s.tokens_per_page for s in specs))


def validate_group_specs(specs: tuple[GroupSpec, ...] | list[GroupSpec]) -> tuple[GroupSpec, ...]:
    """Checks a list of group specs for the allocator: non-empty, unique names."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("need at least one group spec, got none")
    for spec in specs:
        if not isinstance(spec, GroupSpec):
            raise TypeError(f"group specs must be GroupSpec instances, got {type(spec).__name__}: {spec!r}")
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"group names must be unique, repeated: {duplicates}")
    return specs
