"""A Flax Linen decoder (Llama / Mistral / Qwen2 / Phi-3 / Gemma-3): the pieces of a layer for a caller's
layer loop, and a forward whose attention (`attend`) the caller supplies.

Notes: docs/modules.md (`kvjax/models/transformer.py`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig
from kvjax.models.rope import apply_rope, layer_rope


class AttentionInputs(NamedTuple):
    """What a layer hands to `attend`. Shapes: q `[B, T, Hq, D]`, k and v `[B, T, KVH, D]`.

    `q`/`k` are after RoPE; `q_pre`/`k_pre` before (Locret's retaining heads read those).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_pre: jax.Array
    k_pre: jax.Array
    positions: jax.Array  # int32[B, T]


# attend(layer, inputs, carry) -> (attention output [B, T, Hq, D], carry). `layer` is an int32 scalar,
# traced inside a scanned segment (a Python int in a one-layer segment): index arrays with it
# (`page_table[layer]`), do not branch on it. The carry keeps its structure and dtypes from layer to layer.
AttendFn = Callable[[Any, AttentionInputs, Any], tuple[jax.Array, Any]]


class Segment(NamedTuple):
    """Layers `start .. stop - 1`, scanned with one `attend`. A caller whose layers differ in something
    static (a shape, a Python branch) gives each run of alike layers its own segment and closes that
    run's static properties over its `attend`."""

    start: int
    stop: int
    attend: AttendFn


def unrolled(attend: AttendFn, num_layers: int) -> tuple[Segment, ...]:
    """One segment per layer: the forward runs them unscanned and `attend` gets each layer as a Python int
    (compile time grows with depth). For inspection: an `attend` that branches on the layer in
    Python, records into Python containers, or returns a carry whose structure changes."""
    return tuple(Segment(layer, layer + 1, attend) for layer in range(num_layers))


def layer_params(params: Any, layer) -> Any:
    """Layer `layer`'s parameters (what `DecoderLayer` applies) from a model's parameter tree: a plain int
    for the per-layer form (`unstack_layers`, what `Model` holds); a traced index slices stacked leaves."""
    layers = params["layers"]
    return layers[layer] if is_unstacked(layers) else jax.tree.map(lambda w: w[layer], layers)


def unstack_layers(params: Any) -> Any:
    """The parameter tree with `layers` taken apart: a tuple of L per-layer trees (leaves without the `[L]`
    axis) instead of stacked leaves, the one layout `Model` holds: every step reads each layer's weights in
    place. One `unstack` per leaf (no program over the whole tree); the stacked arrays are not kept."""
    layers = params["layers"]
    if is_unstacked(layers):
        return params
    leaves, treedef = jax.tree.flatten(layers)
    columns = [jnp.unstack(leaf) for leaf in leaves]
    per_layer = tuple(jax.tree.unflatten(treedef, [c[l] for c in columns]) for l in range(len(columns[0])))
    return {**params, "layers": per_layer}


def stack_layers(params: Any) -> Any:
    """The inverse of `unstack_layers`: leaves `[L, ...]` (for training code and benchmarks that scan)."""
    layers = params["layers"]
    if not is_unstacked(layers):
        return params
    return {**params, "layers": jax.tree.map(lambda *ws: jnp.stack(ws), *layers)}


def is_unstacked(layers: Any) -> bool:
    """Whether `params["layers"]` is the per-layer form of `unstack_layers` (a tuple of layer trees)."""
    return isinstance(layers, (tuple, list))


def first_layers(params: Any, num_layers: int) -> Any:
    """The parameter tree of the model's first `num_layers` layers (embeddings, final norm and head kept)."""
    layers = params["layers"]
    if is_unstacked(layers):
        return {**params, "layers": tuple(layers[:num_layers])}
    return {**params, "layers": jax.tree.map(lambda w: w[:num_layers], layers)}

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale. With `offset` (Gemma's, 1.0) the scale is
    `offset + weight`, applied in float32 before the cast, as Gemma's RMSNorm does."""

    eps: float
    dtype: Any = jnp.float32
    offset: float = 0.0

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * normed.astype(x.dtype)


def _norm(cfg: ModelConfig, dtype) -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_offset)


def _dense(features: int, use_bias: bool, name: str, dtype) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, name=name, dtype=dtype, param_dtype=dtype)


class Attention(nn.Module):
    """Projections around `attend`: `inputs` (q, k, v with RoPE) and `output` (o_proj); `__call__` is both
    with `attend` between them."""

    cfg: ModelConfig
    dtype: Any

    def setup(self):
        cfg = self.cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if cfg.fused_qkv:
            self.qkv_proj = _dense(q_size + 2 * kv_size, cfg.attention_bias, None, self.dtype)
        else:
            self.q_proj = _dense(q_size, cfg.attention_bias, None, self.dtype)
            self.k_proj = _dense(kv_size, cfg.attention_bias, None, self.dtype)
            self.v_proj = _dense(kv_size, cfg.attention_bias, None, self.dtype)
        self.o_proj = _dense(cfg.hidden_size, cfg.o_proj_bias, None, self.dtype)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _norm(cfg, self.dtype), _norm(cfg, self.dtype)

    def inputs(self, x, positions, rope: tuple[np.ndarray, float]) -> AttentionInputs:
        """`x [B, T, E]` (normed) -> what `attend` takes; `rope` is this layer's (`layer_rope`). With
        `cfg.query_scale`, q carries `query_scale * sqrt(D)`, so attention's own `D ** -0.5` gives the model's
        scale on every path (dense, paged, kernels) and policies score the logits the model attends with."""
        cfg = self.cfg
        B, T, _ = x.shape
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if cfg.fused_qkv:
            qkv = self.qkv_proj(x)
            q, k, v = qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_pre = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k_pre = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q_pre, k_pre = self.q_norm(q_pre), self.k_norm(k_pre)
        inv_freq, attention_factor = rope
        q = apply_rope(q_pre, positions, inv_freq, attention_factor)
        k = apply_rope(k_pre, positions, inv_freq, attention_factor)
        if cfg.query_scale is not None and cfg.query_scale * cfg.head_dim**0.5 != 1.0:
            q = (q * (cfg.query_scale * cfg.head_dim**0.5)).astype(q.dtype)
        return AttentionInputs(q, k, v, q_pre, k_pre, positions)

    def output(self, out):
        """Attention output `[B, T, Hq, D]` -> `[B, T, E]`."""
        B, T = out.shape[:2]
        return self.o_proj(out.reshape(B, T, self.cfg.num_heads * self.cfg.head_dim).astype(self.dtype))

    def __call__(self, x, layer, positions, rope: tuple[np.ndarray, float], attend: AttendFn, carry):
        out, carry = attend(layer, self.inputs(x, positions, rope), carry)
        return self.output(out), carry


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        act = _ACTIVATIONS.get(cfg.hidden_act)
        if act is None:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")
        if cfg.fused_gate_up:
            gate_up = _dense(2 * cfg.intermediate_size, cfg.mlp_bias, "gate_up_proj", self.dtype)(x)
            gate, up = gate_up[..., : cfg.intermediate_size], gate_up[..., cfg.intermediate_size :]
        else:
            gate = _dense(cfg.intermediate_size, cfg.mlp_bias, "gate_proj", self.dtype)(x)
            up = _dense(cfg.intermediate_size, cfg.mlp_bias, "up_proj", self.dtype)(x)
        return _dense(cfg.hidden_size, cfg.mlp_bias, "down_proj", self.dtype)(act(gate) * up)


class DecoderLayer(nn.Module):
    """One decoder layer, `(x [B, T, E], layer, positions, rope, attend, carry) -> (x, carry)`; `layer` is
    only handed to `attend`. Applied with one layer's parameters (`layer_params`). Its two halves around
    `attend` are methods of their own (`attention_inputs`, `after_attention`), so a caller can run the
    weights of a layer apart from the attention (`apply_layers`' per-layer form)."""

    cfg: ModelConfig
    dtype: Any

    def setup(self):
        cfg = self.cfg
        self.input_layernorm = _norm(cfg, self.dtype)
        self.self_attn = Attention(cfg, self.dtype)
        self.post_attention_layernorm = _norm(cfg, self.dtype)
        self.mlp = MLP(cfg, self.dtype)
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output instead
            self.pre_feedforward_layernorm = _norm(cfg, self.dtype)
            self.post_feedforward_layernorm = _norm(cfg, self.dtype)

    def attention_inputs(self, x, positions, rope, layer=None) -> AttentionInputs:
        """`rope` as `rope_frequencies` gave it; `layer` picks its row where layers differ (`layer_rope`)."""
        return self.self_attn.inputs(self.input_layernorm(x), positions, layer_rope(rope, layer))

    def after_attention(self, x, out):
        """The residual stream `x [B, T, E]` after the layer, given the attention output `out [B, T, Hq, D]`."""
        if not self.cfg.sandwich_norms:
            x = x + self.self_attn.output(out)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn.output(out))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def __call__(self, x, layer, positions, rope, attend: AttendFn, carry):
        out, carry = attend(layer, self.attention_inputs(x, positions, rope, layer), carry)
        return self.after_attention(x, out), carry


class CausalLM(nn.Module):
    """Decoder-only LM. `__call__(tokens [B, T], positions [B, T], rope, attend, carry)`.

    `attend` is one `AttendFn` for every layer, or a sequence of `Segment`s covering the layers in order.
    Returns the final normed hidden states `[B, T, H]` and the carry; `logits(h)` maps hidden states to
    vocabulary logits (kept apart so prefill computes logits only where they are needed).
    """

    cfg: ModelConfig
    dtype: Any = jnp.float32

    def setup(self):
        cfg = self.cfg
        # Attribute names become parameter names: embed_tokens, layers (stacked), norm, lm_head.
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        if self.has_variable("params", "layers") and is_unstacked(self.get_variable("params", "layers")):
            self.layers = tuple(self.get_variable("params", "layers"))  # `unstack_layers`' per-layer form
        else:
            self.layers = self.param("layers", self._init_layers)
        self.norm = _norm(cfg, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)

    def _init_layers(self, rng):
        """`DecoderLayer`'s parameters for every layer, stacked `[L, ...]` (initialised once, not per call)."""
        cfg = self.cfg
        x = jnp.zeros((1, 1, cfg.hidden_size), self.dtype)
        positions = jnp.zeros((1, 1), jnp.int32)
        rope = (np.ones(cfg.rotary_dim // 2, np.float32), 1.0)

        def attend(layer, inputs, carry):  # shapes only: the output a real attention would have
            return jnp.repeat(inputs.v, cfg.group_size, axis=2), carry

        def one(key):
            return DecoderLayer(cfg, self.dtype, parent=None).init(key, x, 0, positions, rope, attend, None)["params"]

        return jax.vmap(one)(jax.random.split(rng, cfg.num_layers))

    def embed(self, tokens):
        """`int32[B, T] -> [B, T, H]`, scaled by `cfg.embedding_scale` (Gemma's sqrt(H), at the model's dtype)."""
        x = self.embed_tokens(tokens)
        if self.cfg.embedding_scale is not None:
            x = x * jnp.asarray(self.cfg.embedding_scale, self.dtype)
        return x

    def __call__(self, tokens, positions, rope, attend: AttendFn | Sequence[Segment], carry):
        x = self.embed(tokens)
        x, carry = apply_layers(self.layers, self.cfg, self.dtype, x, positions, rope, attend, carry)
        return self.norm(x), carry

    def hidden_and_logits(self, tokens, positions, rope, attend, carry):
        """Hidden states, f32 logits `[B, T, V]` and the carry (also what `init` traces)."""
        hidden, carry = self(tokens, positions, rope, attend, carry)
        return self.logits(hidden), carry

    def logits(self, hidden):
        """`[..., H] -> f32[..., V]`."""
        if self.cfg.tie_word_embeddings:
            # contract the embedding's hidden axis in place: flax's `Embed.attend` (`hidden @ embedding.T`)
            # made XLA:CPU copy the transposed [H, V] table at every decode step (113 MB for SmolLM2)
            embedding = self.embed_tokens.embedding.astype(self.dtype)
            out = jnp.einsum("...h,vh->...v", hidden.astype(self.dtype), embedding)
        else:
            out = self.lm_head(hidden)
        out = out.astype(jnp.float32)
        if self.cfg.final_logit_softcap is not None:  # Gemma-2's cap * tanh(logits / cap)
            out = self.cfg.final_logit_softcap * jnp.tanh(out / self.cfg.final_logit_softcap)
        return out


def apply_layers(layers, cfg: ModelConfig, dtype, x, positions, rope, attend: AttendFn | Sequence[Segment], carry):
    """The decoder layers over hidden states `x [B, T, E]`. Returns `(x, carry)`.

    With `layers` the stacked parameters (`params["layers"]`, leaves `[L, ...]`), `jax.lax.scan` over each
    segment's layers, slicing each layer's weights inside the body (a dynamic slice per layer, as scanning
    over the weights themselves would do; XLA:CPU copies each slice). A segment of one layer runs without a
    scan and hands `attend` the layer as a Python int (see `unrolled`). With `layers` per-layer trees
    (`unstack_layers`), each segment still scans its layers, but each layer's weights are read in place,
    picked by a `lax.switch` (`_per_layer_segment`); `attend` gets the layer as there."""
    segments = (Segment(0, cfg.num_layers, attend),) if callable(attend) else tuple(attend)
    covered = [layer for seg in segments for layer in range(seg.start, seg.stop)]
    if covered != list(range(cfg.num_layers)):
        raise ValueError(f"segments must cover layers 0..{cfg.num_layers - 1} in order, got {[s[:2] for s in segments]}")
    module = DecoderLayer(cfg, dtype, parent=None)  # unbound: applied with each layer's parameters
    if is_unstacked(layers):
        if len(layers) != cfg.num_layers:
            raise ValueError(f"got parameters for {len(layers)} layers, the config has {cfg.num_layers}")
        for seg in segments:
            x, carry = _per_layer_segment(module, layers, seg, x, positions, rope, carry)
        return x, carry
    for seg in segments:

        def body(xc, layer, seg=seg):
            h, c = xc
            p = jax.tree.map(lambda w: w[layer], layers)
            return module.apply({"params": p}, h, layer, positions, rope, seg.attend, c), None

        if seg.stop - seg.start == 1:
            (x, carry), _ = body((x, carry), seg.start)
        else:
            (x, carry), _ = jax.lax.scan(body, (x, carry), jnp.arange(seg.start, seg.stop, dtype=jnp.int32))
    return x, carry


def _per_layer_segment(module: DecoderLayer, layers: Sequence[Any], seg: Segment, x, positions, rope, carry):
    """One segment over per-layer parameter trees, no weight sliced or copied: a scan over the segment's
    layers whose body runs `attend` once (the traced layer index) between the layer's two halves
    (`layer_inputs`, `layer_output`). The attention, the large part of a step's program, is compiled once
    per segment as with stacked parameters; only the projections and the MLP are compiled per layer."""
    if seg.stop - seg.start == 1:
        return module.apply({"params": layers[seg.start]}, x, seg.start, positions, rope, seg.attend, carry)
    cfg, dtype = module.cfg, module.dtype

    def body(xc, layer):
        h, c = xc
        inputs = layer_inputs(layers, layer, cfg, dtype, h, positions, rope, first=seg.start, stop=seg.stop)
        out, c = seg.attend(layer, inputs, c)
        return (layer_output(layers, layer, cfg, dtype, h, out, first=seg.start, stop=seg.stop), c), None

    (x, carry), _ = jax.lax.scan(body, (x, carry), jnp.arange(seg.start, seg.stop, dtype=jnp.int32))
    return x, carry


# ------------------------------------------------------------------ the model's pieces, for a caller's loop


def embed(params, cfg: ModelConfig, dtype, tokens):
    """Token embeddings `[B, T, E]` of `tokens int32[B, T]`."""
    return CausalLM(cfg, dtype).apply({"params": params}, tokens, method=CausalLM.embed)


def final_logits(params, cfg: ModelConfig, dtype, hidden):
    """Final norm and vocabulary logits `f32[..., V]` of hidden states `[..., E]`."""
    return CausalLM(cfg, dtype).apply({"params": params}, hidden, method=lambda m, h: m.logits(m.norm(h)))


def layer_inputs(layers, layer, cfg: ModelConfig, dtype, x, positions, rope, *, first: int = 0,
                 stop: int | None = None) -> AttentionInputs:
    """Layer `layer`'s first half over hidden states `x [B, T, E]` at `positions int32[B, T]`: input norm,
    q/k/v projections and RoPE (`AttentionInputs`). `layers` is `params["layers"]`; `layer` a Python int,
    or traced within `first .. stop - 1` (per-layer trees: a `lax.switch` whose branches read each layer's
    weights in place)."""
    rope = layer_rope(rope, layer)  # this layer's row where layers differ (Gemma-3), else the shared pair

    def inputs(module, x, positions):  # the RoPE stays closed over (static where layers share it)
        return module.attention_inputs(x, positions, rope)

    return _at_layer(layers, layer, first, stop, cfg, dtype, inputs, x, positions)


def layer_output(layers, layer, cfg: ModelConfig, dtype, x, out, *, first: int = 0, stop: int | None = None):
    """Layer `layer`'s second half: the residual stream `x [B, T, E]` after the layer, given the attention
    output `out [B, T, Hq, D]` (o_proj, residual, MLP). `layer` as in `layer_inputs`."""
    return _at_layer(layers, layer, first, stop, cfg, dtype, DecoderLayer.after_attention, x, out)


def _at_layer(layers, layer, first, stop, cfg, dtype, method, *args):
    module = DecoderLayer(cfg, dtype, parent=None)
    if not is_unstacked(layers):
        return module.apply({"params": jax.tree.map(lambda w: w[layer], layers)}, *args, method=method)
    if isinstance(layer, int):
        return module.apply({"params": layers[layer]}, *args, method=method)
    stop = len(layers) if stop is None else stop
    # one jitted half, called by every branch: traced once, not once per layer (XLA inlines it)
    half = jax.jit(lambda p, *a: module.apply({"params": p}, *a, method=method))
    branches = [functools.partial(half, p) for p in layers[first:stop]]
    return jax.lax.switch(layer - first, branches, *args)
