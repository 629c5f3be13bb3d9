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
    `compress_layer` runs after each chunk (`PromptView.final_chunk` says which chunk is a sequence's
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


class PromptView(NamedTuple):
    """One layer's cache as a compressor's `compress_layer` sees it, after prefill (or after a prefill chunk
    with a chunk schedule). B sequences, H kv heads, Hq = H * G query heads, S slots in logical order, w the
    compressor's `window_size`. Optional fields (`OPTIONAL`) are None exactly where their comment says."""

    layer: Any  # int32 scalar, traced inside the steps' scan over layers
    num_layers: int
    lengths: jax.Array  # int32[B, H] slots each head holds
    next_position: jax.Array  # int32[B] tokens seen so far (the prompt's length after prefill)
    k: jax.Array  # [B, H, S, D] keys after RoPE
    slot_pos: jax.Array  # int32[B, H, S] original positions, -1 when empty
    valid: jax.Array  # bool[B, H, S] slot < length
    slot_score: jax.Array  # f32[B, H, S] scores stored per slot (accumulated attention, a chunk schedule's, a pass's)
    final_chunk: jax.Array  # bool[B] this is each sequence's last prefill chunk (True when compressing once)
    window_q: Any = None  # [B, w, Hq, D] the last w prompt queries, post-RoPE; None when window_size is 0
    window_pos: Any = None  # int32[B, w] their positions, -1 for rows before the prompt start; None as window_q
    pool_threshold: Any = None  # f32[B] the score of the pooled budget's last slot; None without `pooled_budget`

    OPTIONAL = ("window_q", "window_pos", "pool_threshold")


class PageView(NamedTuple):
    """One layer's page metadata as a selector's `select_pages` sees it at a decode step: the query and the
    pages, no slot gathered. B, H, Hq as `PromptView`; P logical pages read, N pages in the pool, ps the page
    size, D the head dim."""

    layer: Any  # int32 scalar (traced)
    num_layers: int
    lengths: jax.Array  # int32[B, H] slots each head holds (its current page is (length - 1) // ps)
    q: jax.Array  # [B, Hq, D] the decode step's query, post-RoPE
    page_table: jax.Array  # int32[B, H, P] physical page of each logical page read, -1 unallocated
    page_size: int
    kmin: jax.Array  # [N, D] per-page elementwise key min (+inf when empty)
    kmax: jax.Array  # [N, D] and max (-inf when empty)
    k_pages: jax.Array  # [N, ps, D] the key pool (an evaluation oracle scores every key)
    key_sketch: Any = None  # the state's `KeySketch`, attached by a selector that keeps one, else None

    OPTIONAL = ("key_sketch",)


class DecodeView(NamedTuple):
    """One layer's cache as a decode-time evictor's `decode_scores` sees it, after a decode step's attention:
    the slots (as `PromptView`'s) and the step's attention row statistics, from which `probs` rebuilds the
    probabilities. Shapes as `PromptView`."""

    layer: Any  # int32 scalar (traced)
    num_layers: int
    lengths: jax.Array  # int32[B, H]
    next_position: jax.Array  # int32[B] tokens seen, the step's token included
    k: jax.Array  # [B, H, S, D]
    slot_pos: jax.Array  # int32[B, H, S], -1 when empty
    valid: jax.Array  # bool[B, H, S]
    slot_score: jax.Array  # f32[B, H, S] (H2O: the step's attention already added)
    q: jax.Array  # [B, Hq, D] the step's query (post-RoPE)
    row_max: jax.Array  # f32[B, Hq] the decode attention's row max of the scaled logits
    row_sum: jax.Array  # f32[B, Hq] and its row sum: p = exp(q.k / sqrt(D) - row_max) / row_sum
    read: Any = None  # bool[B, H, G, S] slots the attention read under a selector; None: every valid slot

    OPTIONAL = ("read",)

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


# ---- roles: a policy class declares each role it plays by subclassing it (docs/design.md, "Policies")


class Compressor:
    """Role: after prefill (or after every prefill chunk, with `chunks`), choose the slots each (sequence,
    kv head) of a compressed layer keeps; the rest are evicted and their pages freed."""

    accumulates_attention: ClassVar[bool] = False  # every query's attention is added to slot_score (H2O)

    def compresses_layer(self, layer: int) -> bool:
        """Whether this compressor (and the policy's decode-time evictor) acts in `layer` (static)."""
        return layer >= self.dense_layers

    @property
    def window_size(self) -> int:
        """Trailing prompt queries `compress_layer` reads (`PromptView.window_q`; 0: none)."""
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
        pool's last kept slot (`PromptView.pool_threshold`). None: each layer decides alone."""
        return None

    def kept_bound(self, prompt_len: int, num_kv_heads: int) -> int:
        """Most slots one head keeps after `compress_layer` for a prompt of `prompt_len` (static)."""
        return prompt_len

    def compress_layer(self, view: PromptView, keep_bound: int) -> tuple[jax.Array, jax.Array]:
        """(keep_slots int32[B, H, keep_bound] in slot order, -1 padded; keep_count int32[B, H]) for one layer."""
        raise NotImplementedError


class Selector:
    """Role: before each decode attention, choose what each head reads (the current page is read besides)."""

    unit: ClassVar[str] = "page"  # what `select_pages` lists: logical pages, or "slot": single slots (an oracle)
    keeps_key_sketch: ClassVar[bool] = False  # a per-slot key sketch besides Quest's min/max (key_sketch.py)

    def selects_pages(self, layer: int) -> bool:
        """Whether this selector acts in `layer` (static); the dense layers read every page."""
        return layer >= self.dense_layers

    def select_pages(self, view: PageView) -> Any:
        """Logical pages (or slots, `unit`) each head reads, `int32[B, Hq or H, K]` (-1 = none), or None for all."""
        raise NotImplementedError

    def attach_sketch(self, state: Any) -> Any:
        """The `KVState` with the key sketch fitted and written for every slot, after prefill (and its
        compression); unchanged for a selector that keeps none."""
        return state

    def sketch_keys(self, sketch: Any, layer: Any, k: jax.Array) -> Any:
        """The sketch rows `[B, C, H, R]` of new keys `k [B, C, H, D]` that the append writes, or None."""
        return None


class DecodeEvictor:
    """Role: after each decode step, a head of a compressed layer holding more than `decode_budget` slots
    drops its lowest-scoring one. Only a `Compressor` plays it: it acts in the layers the compressor does."""

    @property
    def decode_budget(self) -> int:
        """Slots a compressed head holds while decoding."""
        return self.token_budget

    def decode_scores(self, view: DecodeView) -> jax.Array:
        """f32[B, H, S], higher = keep."""
        raise NotImplementedError


ROLES = (Compressor, Selector, DecodeEvictor)


def _role_members(role: type) -> set[str]:
    return {name for name in vars(role) if not name.startswith("_")}


class LayerRoles(NamedTuple):
    """The roles a policy plays in one layer (static): what the steps' per-segment plans derive from."""

    compress: bool  # its compressor keeps a subset of the layer's slots
    select: bool  # its selector chooses the pages each decode step reads
    evict: bool  # its decode-time evictor drops a slot of each head over budget after each decode step


def layer_roles(policy: "Policy", layer: int) -> LayerRoles:
    """The roles `policy` plays in `layer` (a plain int), from its declared `compressor`, `selector`, `evictor`."""
    compressor, selector = policy.compressor, policy.selector
    compress = compressor is not None and compressor.compresses_layer(layer)
    return LayerRoles(compress, selector is not None and selector.selects_pages(layer),
                      compress and policy.evictor is not None)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Keep every slot; read every page. A method is a subclass that also subclasses the roles it plays
    (`Compressor`, `Selector`, `DecodeEvictor`) and defines their hooks; a wrapper names the part playing
    each role (`compressor`, `selector`, `evictor`). Defining a role's member without the role is refused."""

    name: ClassVar[str] = "full"
    dense_layers: int = 0  # the first N layers stay uncompressed (and, for a selector, read whole)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for role in ROLES:
            stray = sorted(_role_members(role) & set(vars(cls)))
            if stray and not issubclass(cls, role):
                raise TypeError(f"policy class {cls.__name__} defines {', '.join(stray)} of the {role.__name__} "
                                f"role without declaring it: subclass {role.__name__}")
        if issubclass(cls, DecodeEvictor) and not issubclass(cls, Compressor):
            raise TypeError(f"policy class {cls.__name__} evicts while decoding but does not compress: a "
                            "DecodeEvictor acts in the layers its Compressor compresses, so subclass both")

    # ---- the roles it plays: itself where its class declares the role, else None; a wrapper names its parts
    @property
    def compressor(self) -> Compressor | None:
        return self if isinstance(self, Compressor) else None

    @property
    def selector(self) -> Selector | None:
        return self if isinstance(self, Selector) else None

    @property
    def evictor(self) -> DecodeEvictor | None:
        return self if isinstance(self, DecodeEvictor) else None

    @property
    def compresses(self) -> bool:
        return self.compressor is not None

    @property
    def evicts_while_decoding(self) -> bool:
        return self.evictor is not None

    # ---- every policy (host side, static)
    def validate(self, page_size: int) -> None:
        """Raise ValueError naming a bad field. Called before any work."""
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")

    def slots_needed(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> int:
        """Most slots one (layer, head) holds at once during a request (sizes the cache before work)."""
        return prompt_len + max_new_tokens

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
