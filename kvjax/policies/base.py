"""The policy interface and registry.

A policy is a frozen, hashable dataclass (static under `jit`). The generation step calls its hooks:

- `compress_layer` once after prefill (for methods with `compresses`; after every prefill chunk for
  methods that also have `compresses_each_chunk`, Locret): choose which slots each (sequence, kv-head)
  keeps; the cache is compacted and the freed pages return to the pool.
- `append_scores` as a chunk is appended: a per-token score stored in `slot_score` (Locret's heads),
  computed with the arrays `device_params` returns (passed to the jitted step as an argument).
- `select_pages` before each decode attention (Quest): which logical pages each head reads.
- `decode_scores` after each decode step (methods with `evicts_while_decoding`): a head over its
  decode budget drops its lowest-scoring slot.

What a policy may read is a `LayerView`. The base class keeps everything, so it is the full cache.

The steps scan over layers, so the hooks get the layer index as a traced int32 scalar: index arrays with
it, compute with it (PyramidKV's budget), but do not branch on it in Python. What differs per layer at
trace time is said by the static predicates `compresses_layer` and `selects_pages`, called with plain
ints; the steps group alike layers into segments by them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple

import jax

POLICY_REGISTRY: dict[str, type["Policy"]] = {}


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator registering a policy under `name` for `make_policy` (methods written outside kvjax too)."""

    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"register_policy({name!r}) expects a Policy subclass, got {cls!r}")
        cls.name = name
        POLICY_REGISTRY[name] = cls
        return cls

    return wrap


class LayerView(NamedTuple):
    """One layer's cache as a policy sees it. B sequences, H kv heads, S = slots in the table, G = group.

    At compress time `window_q`/`window_pos` hold the last `window_size` prompt queries (post-RoPE) of
    each sequence; at decode time `probs` holds the step's attention probabilities.
    """

    layer: Any  # int32 scalar, traced inside the steps' scan over layers
    num_layers: int
    k: jax.Array  # [B, H, S, D] keys after RoPE, in slot order
    slot_pos: jax.Array  # int32[B, H, S] original positions, -1 when empty
    valid: jax.Array  # bool[B, H, S] slot < length
    slot_score: jax.Array  # f32[B, H, S]
    lengths: jax.Array  # int32[B, H]
    next_position: jax.Array  # int32[B] tokens seen so far (the prompt length at compress time)
    window_q: Any = None  # [B, w, Hq, D]
    window_pos: Any = None  # int32[B, w], -1 for rows before the prompt start
    probs: Any = None  # f32[B, H, G, S] decode attention of the step's query
    final_chunk: Any = None  # bool[B] per-chunk compression: this is each sequence's last prefill chunk


@dataclasses.dataclass(frozen=True)
class Policy:
    """Keep every slot; read every page. Subclasses override hooks and capabilities."""

    name: ClassVar[str] = "full"
    dense_layers: int = 0  # the first N layers stay uncompressed

    # ---- capabilities (static)
    compresses: ClassVar[bool] = False  # compress_layer after prefill
    evicts_while_decoding: ClassVar[bool] = False  # decode_scores after each decode step
    accumulates_attention: ClassVar[bool] = False  # add attention probabilities into slot_score (H2O)
    compresses_each_chunk: ClassVar[bool] = False  # compress after every prefill chunk (Locret): the pool
    #   is sized from `slots_needed`, so memory stays O(budget + chunk)

    @property
    def window_size(self) -> int:
        """Trailing prompt queries `compress_layer` needs (0: none)."""
        return 0

    def validate(self, page_size: int) -> None:
        """Raise ValueError naming a bad field. Called before any work."""
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        """Most slots one (layer, head) holds at once during a request (sizes the cache before work)."""
        return prompt_len + max_new_tokens

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        """Most slots one head keeps after `compress_layer` for a prompt of `prompt_len` (static)."""
        return prompt_len

    def decode_budget(self, prompt_len: int) -> int:
        """Slots a head may hold while decoding before `decode_scores` evicts (evicting policies)."""
        return prompt_len

    def compresses_layer(self, layer: int) -> bool:
        """Whether `compress_layer` (and `append_scores`, decode-time eviction) applies to `layer` (static)."""
        return layer >= self.dense_layers

    def selects_pages(self, layer: int) -> bool:
        """Whether `select_pages` runs in `layer` at decode (static). By default: in every layer, when the
        class defines `select_pages` (a None from it still means "read every page")."""
        return type(self).select_pages is not Policy.select_pages

    def prefill_tail(self, prompt_len: int) -> int:
        """Last prompt tokens appended after the per-chunk compressions, without eviction (Locret's n_loc)."""
        return 0

    def device_params(self) -> Any:
        """Arrays the hooks need (a pytree, or None), passed to the jitted step as an argument."""
        return None

    # ---- hooks (called under jit)
    def compress_layer(self, view: LayerView, keep_bound: int) -> tuple[jax.Array, jax.Array]:
        """(keep_slots int32[B, H, keep_bound], keep_count int32[B, H]) for one layer."""
        raise NotImplementedError

    def append_scores(self, layer, inputs: Any, params: Any) -> Any:
        """f32[B, C, H] scores of the chunk's tokens, stored in `slot_score` as they are appended (or None).
        `inputs` is the layer's `AttentionInputs`, `params` what `device_params` returned; `layer` traced."""
        return None

    def select_pages(self, layer, q: jax.Array, state: Any) -> Any:
        """Logical pages each head reads at a decode step, `int32[B, Hq or H, K]` (-1 = none), or None for all.
        Called only in layers where `selects_pages(layer)`; `layer` traced."""
        return None

    def decode_scores(self, view: LayerView) -> jax.Array:
        """f32[B, H, S]: after a decode step, a head over budget drops its lowest-scoring valid slot."""
        raise NotImplementedError


@register_policy("full")
@dataclasses.dataclass(frozen=True)
class FullPolicy(Policy):
    """The uncompressed cache (the reference every method is compared against)."""


def make_policy(name: str = "full", **options: Any) -> Policy:
    """Build a registered policy by name, e.g. `make_policy("quest", token_budget=64)`."""
    cls = POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICY_REGISTRY))}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"policy {name!r} has no option(s) {', '.join(unknown)}; options: {', '.join(sorted(fields))}")
    return cls(**options)
