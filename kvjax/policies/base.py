"""The policy interface and registry.

Notes: docs/modules.md (`kvjax/policies/base.py`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

POLICY_REGISTRY: dict[str, Any] = {}  # name -> a Policy subclass, or a `Preset` of one


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator registering a policy under `name` for `make_policy` (methods written outside kvjax too)."""

    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"register_policy({name!r}) expects a Policy subclass, got {cls!r}")
        cls.name = name
        POLICY_REGISTRY[name] = cls
        return cls

    return wrap


@dataclasses.dataclass(frozen=True)
class Preset:
    """A registered name for a registered policy with some options fixed: `ada_snapkv` is `ada` with
    `scorer="snapkv"`. `make_policy(name, **options)` builds the policy with the preset's options first."""

    policy: str
    options: tuple[tuple[str, Any], ...]

    def from_options(self, **options: Any) -> "Policy":
        return make_policy(self.policy, **dict(self.options), **options)

    def option_types(self, options: dict[str, str]) -> dict[str, Any]:
        fixed = dict(self.options)
        types = POLICY_REGISTRY[self.policy].option_types({**{k: str(v) for k, v in fixed.items()}, **options})
        return {name: kind for name, kind in types.items() if name not in fixed}


def register_preset(name: str, policy: str, **options: Any) -> None:
    """Register `name` as `make_policy(policy, **options, ...)`, e.g. `register_preset("ada_snapkv", "ada",
    scorer="snapkv")`."""
    if policy not in POLICY_REGISTRY:
        raise ValueError(f"register_preset({name!r}): no policy {policy!r} is registered")
    POLICY_REGISTRY[name] = Preset(policy, tuple(sorted(options.items())))


class ChunkSchedule(NamedTuple):
    """Compression after every prefill chunk (Locret), instead of once after prefill: the policy's
    `compress_layer` runs after each chunk (`LayerView.final_chunk` says which chunk is a sequence's
    last), the pool holds what a head keeps plus a chunk rather than the prompt, and the last `tail`
    prompt tokens are appended afterwards without eviction. Each prefill token's `slot_score` is
    `score(layer, inputs, params)`, `f32[B, C, H]` from the layer's `AttentionInputs`, where `params`
    (a pytree of arrays, e.g. retaining heads) reaches the jitted step as an argument, never baked in."""

    tail: int  # last prompt tokens appended without eviction (Locret's n_loc)
    score: Callable[[Any, Any, Any], jax.Array]
    params: Any = None


class ScoringPass(NamedTuple):
    """A pass over the prompt again after prefill, before compression (KVzip's context reconstruction,
    `kvjax.engine.reconstruction`): the prompt is fed again in chunks of `chunk` tokens, each after an
    instruction (`first` before the first chunk; `later` and the previous chunk's last `overlap` tokens
    before the others) and the chat template's turn end, and each prompt slot's score is the largest
    softmax attention a fed query of its kv head's group gives it, over the first `sinks` slots, the
    chunk's own slots and the fed tokens. The first `sinks` slots score +inf. `pool(scores f32[L, B, H, S])`
    (slot order, -inf where no prompt slot) returns the scores with -inf on every slot to evict."""

    chunk: int
    sinks: int
    first: str
    later: str
    overlap: int
    pool: Callable[[jax.Array], jax.Array]


class LayerView(NamedTuple):
    """One layer's cache as a policy sees it. B sequences, H kv heads, Hq = H * G query heads, S = slots
    in the table, N = pages in the pool, P = logical pages read. A step fills what the hook reads:

    - compress: slots (`k` .. `slot_score`), `window_q`/`window_pos` (the last `window_size` prompt
      queries, post-RoPE), `final_chunk` with a chunk schedule;
    - select: the decode query `q` and the layer's page metadata (`page_table`, `kmin`, `kmax`, the key
      pool `k_pages` and the state's `key_sketch`);
    - evict while decoding: slots, and the step's attention as `q` with the kernel's row max and sum
      (`probs` rebuilds the probabilities from them) over the slots it `read`.
    """

    layer: Any  # int32 scalar, traced inside the steps' scan over layers
    num_layers: int
    lengths: jax.Array  # int32[B, H]
    next_position: Any = None  # int32[B] tokens seen so far (the prompt length at compress time)
    k: Any = None  # [B, H, S, D] keys after RoPE, in slot order
    slot_pos: Any = None  # int32[B, H, S] original positions, -1 when empty
    valid: Any = None  # bool[B, H, S] slot < length
    slot_score: Any = None  # f32[B, H, S]
    window_q: Any = None  # [B, w, Hq, D]
    window_pos: Any = None  # int32[B, w], -1 for rows before the prompt start
    final_chunk: Any = None  # bool[B] per-chunk compression: this is each sequence's last prefill chunk
    pool_threshold: Any = None  # f32[B] with `Policy.pooled_budget`: the score of the pooled budget's last slot
    q: Any = None  # [B, Hq, D] the decode step's query (post-RoPE)
    row_max: Any = None  # f32[B, Hq] the decode attention's row max of the scaled logits
    row_sum: Any = None  # f32[B, Hq] and its row sum: p = exp(q.k / sqrt(D) - row_max) / row_sum
    read: Any = None  # bool[B, H, G, S] slots the decode attention read (None: every valid slot)
    page_table: Any = None  # int32[B, H, P] physical page of each logical page read, -1 unallocated
    kmin: Any = None  # [N, D] per-page elementwise key min (+inf when empty)
    kmax: Any = None  # [N, D] and max (-inf when empty)
    page_size: int = 0
    k_pages: Any = None  # [N, ps, D] the key pool (an evaluation oracle scores every key)
    key_sketch: Any = None  # `KeySketch` the per-slot key sketch a selector attached (kvjax.policies.key_sketch)

    @property
    def probs(self) -> jax.Array:
        """f32[B, H, G, S]: the decode step's attention probabilities over the slots it read (0 elsewhere),
        rebuilt from the kernel's row statistics with one pass over the keys: exp(q.k / sqrt(D) - m) / l."""
        B, H, S, D = self.k.shape
        q = (self.q.astype(jnp.float32) * D**-0.5).reshape(B, H, -1, D)  # scaled as the kernels scale it
        logits = jnp.einsum("bhgd,bhsd->bhgs", q, self.k.astype(jnp.float32))
        m, l = (x.reshape(B, H, -1)[..., None] for x in (self.row_max, self.row_sum))
        read = self.valid[:, :, None] if self.read is None else self.read & self.valid[:, :, None]
        return jnp.where(read, jnp.exp(jnp.minimum(logits - m, 0.0)) / l, 0.0)


def _defines(policy: "Policy", hook: str) -> bool:
    return getattr(type(policy), hook) is not getattr(Policy, hook)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Keep every slot; read every page. A method defines the hooks of its roles (module docstring)."""

    name: ClassVar[str] = "full"
    dense_layers: int = 0  # the first N layers stay uncompressed

    # ---- every policy (host side, static)
    def validate(self, page_size: int) -> None:
        """Raise ValueError naming a bad field. Called before any work."""
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        """Most slots one (layer, head) holds at once during a request (sizes the cache before work)."""
        return prompt_len + max_new_tokens

    def compresses_layer(self, layer: int) -> bool:
        """Whether compression and decode-time eviction apply to `layer` (static)."""
        return layer >= self.dense_layers

    @classmethod
    def from_options(cls, **options: Any) -> "Policy":
        """The policy `make_policy(name, **options)` builds: the dataclass's fields by default; a wrapper
        may build its parts from the options (`AdaKV`)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(
                f"policy {cls.name!r} has no option(s) {', '.join(unknown)}; options: {', '.join(sorted(fields))}"
            )
        return cls(**options)

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        """Option name -> type, for reading `options` given as text (the command line's KEY=VALUE)."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}

    # ---- compress (after prefill, or after every chunk with a `chunks` schedule)
    accumulates_attention: ClassVar[bool] = False  # every query's attention is added to slot_score (H2O)

    @property
    def compresses(self) -> bool:
        return _defines(self, "compress_layer")

    @property
    def window_size(self) -> int:
        """Trailing prompt queries `compress_layer` reads (0: none)."""
        return 0

    @property
    def chunks(self) -> ChunkSchedule | None:
        """Compress after every prefill chunk (Locret), or None: once, after prefill."""
        return None

    @property
    def scoring_pass(self) -> ScoringPass | None:
        """A pass over the prompt after prefill that scores its slots before `compress_layer` (KVzip), or None."""
        return None

    @property
    def pooled_budget(self) -> int | None:
        """Slots per kv head and compressed layer, on average, when the budget is pooled over all compressed
        layers and heads at each compression: `compress_step` then gives `compress_layer` the score of the
        pool's last kept slot (`LayerView.pool_threshold`). None: each layer decides alone."""
        return None

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        """Most slots one head keeps after `compress_layer` for a prompt of `prompt_len` (static)."""
        return prompt_len

    def compress_layer(self, view: LayerView, keep_bound: int) -> tuple[jax.Array, jax.Array]:
        """(keep_slots int32[B, H, keep_bound], keep_count int32[B, H]) for one layer."""
        raise NotImplementedError

    # ---- select pages at decode
    def selects_pages(self, layer: int) -> bool:
        """Whether `select_pages` runs in `layer` at decode (static): where the class defines it."""
        return _defines(self, "select_pages")

    def select_pages(self, view: LayerView) -> Any:
        """Logical pages each head reads at a decode step, `int32[B, Hq or H, K]` (-1 = none; the current
        page is always read besides), or None for all. Reads `view.q` and the page metadata."""
        raise NotImplementedError

    keeps_key_sketch: ClassVar[bool] = False  # a per-slot key sketch besides Quest's min/max (key_sketch.py)
    selects_slots: ClassVar[bool] = False  # `select_pages` lists single slots, not pages (the token oracle)

    def attach_sketch(self, state: Any) -> Any:
        """The `KVState` with the selector's key sketch fitted and written for every slot, after prefill
        (and its compression); the state unchanged for a policy that keeps no sketch."""
        return state

    def sketch_keys(self, sketch: Any, layer: Any, k: jax.Array) -> Any:
        """The sketch rows `[B, C, H, R]` of new keys `k [B, C, H, D]` that the append writes, or None."""
        return None

    # ---- evict while decoding
    @property
    def evicts_while_decoding(self) -> bool:
        return _defines(self, "decode_scores")

    @property
    def decode_budget(self) -> int:
        """Slots a compressed head holds while decoding: past it, `decode_scores` picks the slot to drop."""
        return getattr(self, "token_budget")

    def decode_scores(self, view: LayerView) -> jax.Array:
        """f32[B, H, S]: after a decode step, a head over budget drops its lowest-scoring valid slot."""
        raise NotImplementedError


# Each role's members: its hook and what the steps ask of a policy playing it (inputs, sizes, where it acts).
ROLE_MEMBERS: dict[str, tuple[str, ...]] = {
    "compress": ("compresses", "accumulates_attention", "window_size", "chunks", "scoring_pass", "kept_bound",
                 "pooled_budget", "compresses_layer", "compress_layer", "slots_needed"),
    "select": ("selects_pages", "select_pages", "selects_slots", "keeps_key_sketch", "attach_sketch", "sketch_keys"),
    "evict": ("evicts_while_decoding", "decode_budget", "decode_scores"),
}


def take_roles(**parts: tuple[str, ...]) -> Callable[[type], type]:
    """Class decorator for a wrapper policy: `@take_roles(evict=("compress", "evict"), select=("select",))`
    makes every member of those roles read the named field's policy (`self.evict.compress_layer`, ...), so
    a wrapper states which part plays which role instead of forwarding member by member."""

    def forward(part: str, member: str):
        if not callable(getattr(Policy, member)) or isinstance(getattr(Policy, member), property):
            return property(lambda self: getattr(getattr(self, part), member))  # a property or a class constant
        return lambda self, *args, **kwargs: getattr(getattr(self, part), member)(*args, **kwargs)

    def wrap(cls: type) -> type:
        for part, roles in parts.items():
            for role in roles:
                for member in ROLE_MEMBERS[role]:
                    if member not in cls.__dict__:  # a wrapper may still define a member itself
                        setattr(cls, member, forward(part, member))
        return cls

    return wrap


@register_policy("full")
@dataclasses.dataclass(frozen=True)
class FullPolicy(Policy):
    """The uncompressed cache (the reference every method is compared against)."""


def make_policy(name: str = "full", **options: Any) -> Policy:
    """Build a registered policy by name, e.g. `make_policy("quest", token_budget=64)`."""
    cls = POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICY_REGISTRY))}")
    return cls.from_options(**options)
