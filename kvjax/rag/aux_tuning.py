"""Fine-tuning CacheClip's auxiliary model so that its last-layer attention matches the main model's.

Notes: docs/modules.md (`kvjax/rag/aux_tuning.py`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache.attention import masked_attention
from kvjax.models.config import ModelConfig
from kvjax.engine.api import dense_forward


def _rows_attention(params, tokens, first: int, stop: int, *, cfg: ModelConfig, dtype, last_layer_only: bool) -> jax.Array:
    """f32[B, T]: attention of rows `first .. stop - 1`, averaged over heads and rows, and over layers (or
    the last layer's alone), from the dense reference forward (`dense_forward`) of `tokens int32[B, T]`."""
    B, T = tokens.shape
    causal = jnp.arange(T)[None, :] <= jnp.arange(first, stop)[:, None]  # [rows, T]

    def rows(layer, inputs, total):
        k, v = jnp.swapaxes(inputs.k, 1, 2), jnp.swapaxes(inputs.v, 1, 2)  # [B, H, T, D]
        # the rows' probabilities alone (a [B, H, G, rows, T] tensor, not [.., T, T])
        _, probs = masked_attention(inputs.q[:, first:stop], k, v, causal, return_probs=True)
        mean = probs.mean(axis=(1, 2, 3))  # [B, T]
        return mean if last_layer_only else total + mean

    _, total = dense_forward(params, tokens, cfg, dtype, observe=rows, observed=jnp.zeros((B, T), jnp.float32))
    return total if last_layer_only else total / cfg.num_layers


def attention_target(params, tokens, query_len: int, answer_len: int = 0, *, cfg: ModelConfig, dtype=jnp.float32,
                     answer_rows: bool = True) -> jax.Array:
    """The main model's attention, `f32[B, T]` averaged over its layers, from the question and (with
    `answer_rows`) the answer: `tokens` end with `query_len` question tokens then `answer_len` answer tokens."""
    T = tokens.shape[1]
    stop = T if answer_rows else T - answer_len
    return _rows_attention(params, tokens, T - answer_len - query_len, stop, cfg=cfg, dtype=dtype, last_layer_only=False)


def aux_attention(params, tokens, query_len: int, answer_len: int = 0, *, cfg: ModelConfig,
                  dtype=jnp.float32) -> jax.Array:
    """The auxiliary model's last-layer attention from the question alone, `f32[B, T]` (`tokens` as for
    `attention_target`; causal, so answer tokens after the question change nothing)."""
    T = tokens.shape[1]
    return _rows_attention(params, tokens, T - answer_len - query_len, T - answer_len, cfg=cfg, dtype=dtype,
                           last_layer_only=True)


def _on_context(x: jax.Array, context_len: jax.Array) -> jax.Array:
    """`x f32[B, T]` restricted to positions < context_len[b] and renormalised there."""
    keep = jnp.arange(x.shape[1])[None, :] < context_len[:, None]
    x = jnp.where(keep, x, 0.0)
    return x / jnp.maximum(x.sum(axis=1, keepdims=True), 1e-20)


def aux_loss(aux_params, tokens, target, context_len, query_len: int, answer_len: int = 0, *, cfg: ModelConfig,
             dtype=jnp.float32):
    """Mean over prompts of KL(target || auxiliary) on the context positions (`context_len int32[B]`: the
    tokens before the question; padding is never among them). `target f32[B, T]` from `attention_target`."""
    p = _on_context(target, context_len)
    q = _on_context(aux_attention(aux_params, tokens, query_len, answer_len, cfg=cfg, dtype=dtype), context_len)
    kl = jnp.where(p > 0, p * (jnp.log(jnp.maximum(p, 1e-20)) - jnp.log(jnp.maximum(q, 1e-20))), 0.0)
    return kl.sum(axis=1).mean()


def make_optimizer(learning_rate: float = 1e-4, total_steps: int = 300, warmup_steps: int = 30,
                   weight_decay: float = 0.0, clip_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, linear warm-up then cosine decay to 0."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(warmup_steps, 1), max(total_steps, 2))
    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay))


def make_train_step(optimizer: optax.GradientTransformation, *, cfg: ModelConfig, query_len: int, answer_len: int = 0,
                    dtype=jnp.float32):
    """A jitted `step(aux_params, opt_state, tokens, target, context_len) -> (aux_params, opt_state, loss)`;
    `cfg` is the auxiliary model's. The parameters and optimizer state are donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(aux_params, opt_state, tokens, target, context_len):
        loss, grads = jax.value_and_grad(aux_loss)(aux_params, tokens, target, context_len, query_len, answer_len,
                                                   cfg=cfg, dtype=dtype)
        updates, opt_state = optimizer.update(grads, opt_state, aux_params)
        return optax.apply_updates(aux_params, updates), opt_state, loss

    return step


AUX_PARAMS_DIR, AUX_META = "params", "aux.json"


def save_aux(path: str, aux, extra: dict | None = None) -> str:
    """Save a tuned auxiliary model's parameters (orbax) into directory `path`, with its depth in aux.json."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(path, AUX_PARAMS_DIR), aux.params, force=True)
    checkpointer.wait_until_finished()
    with open(os.path.join(path, AUX_META), "w") as f:
        json.dump({"num_layers": aux.cfg.num_layers, **(extra or {})}, f, indent=2)
    return path


def load_aux(main, path: str):
    """The tuned auxiliary model saved by `save_aux` for `main` (the main model whose truncated copy was
    tuned: it gives the config, tokenizer and parameter structure)."""
    import orbax.checkpoint as ocp

    from kvjax.rag.recompute import truncated_model

    with open(os.path.join(path, AUX_META)) as f:
        meta = json.load(f)
    template = truncated_model(main, int(meta["num_layers"]))
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template.params)
    params = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(path), AUX_PARAMS_DIR), abstract)
    return dataclasses.replace(template, params=params)


def selection_recall(target: np.ndarray, scores: np.ndarray, context_len: int, ratio: float) -> float:
    """The share of the target's top `ratio` of the `context_len` context tokens that the top `ratio` by
    `scores` also holds (1.0: the auxiliary model selects what the main model attends to)."""
    k = max(1, int(round(ratio * context_len)))
    want = set(np.argsort(-np.asarray(target)[:context_len], kind="stable")[:k].tolist())
    got = set(np.argsort(-np.asarray(scores)[:context_len], kind="stable")[:k].tolist())
    return len(want & got) / k


__all__ = [
    "aux_attention", "aux_loss", "attention_target", "load_aux", "make_optimizer", "make_train_step", "save_aux",
    "selection_recall",
]
