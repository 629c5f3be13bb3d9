"""Locret's training objective and optimizer, as pure functions (the program is `train/locret.py`).

Notes: docs/modules.md (`kvjax/locret/training.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from kvjax.models.config import ModelConfig
from kvjax.policies.locret_heads import retaining_scores
from kvjax.locret.labels import Batch, Targets, compute_targets

DEFAULT_ALPHA = 0.0025


def _layer_terms(layer_params: dict, q_pre, k_pre, v, labels, valid, pairs) -> tuple[jax.Array, jax.Array]:
    """One layer's (Smooth-L1 mean, smoothness mean) over `valid f32[B, Tp, 1]` tokens and `pairs f32[B, Tp-1, 1]`."""
    H = labels.shape[-1]
    pred = retaining_scores(layer_params, q_pre, k_pre, v)
    fit = jnp.sum(optax.huber_loss(pred, labels, delta=1.0) * valid) / (jnp.sum(valid) * H)
    smooth = jnp.sum(jnp.square(pred[:, 1:] - pred[:, :-1]) * pairs) / jnp.maximum(jnp.sum(pairs) * H, 1.0)
    return fit, smooth


# Rematerialised in the backward pass: a layer keeps no activations (its head's [B, Tp, hidden] hidden
# layer) between the forward and backward passes, so the step's memory does not grow as L * Tp * hidden.
_layer_terms_remat = jax.checkpoint(_layer_terms)


def head_loss(head_params: dict, targets: Targets, alpha: float = DEFAULT_ALPHA) -> jax.Array:
    """Smooth-L1 + alpha * smoothness of the heads' predictions on `targets` (scalar f32)."""
    L = targets.labels.shape[0]
    valid = targets.valid.astype(jnp.float32)[..., None]  # [B, Tp, 1]
    pairs = (targets.valid[:, 1:] & targets.valid[:, :-1]).astype(jnp.float32)[..., None]
    fit, smooth = 0.0, 0.0
    for l in range(L):
        f, s = _layer_terms_remat(
            head_params[f"layer_{l}"], targets.q_pre[l], targets.k_pre[l], targets.v[l], targets.labels[l], valid, pairs
        )
        fit, smooth = fit + f, smooth + s
    return fit / L + alpha * smooth


def loss_fn(
    head_params: dict,
    model_params,
    batch: Batch,
    *,
    cfg: ModelConfig,
    dtype=jnp.float32,
    chunk_size: int = 1024,
    alpha: float = DEFAULT_ALPHA,
    page_size: int = 16,
) -> jax.Array:
    """The training loss of `head_params` on `batch` (see the module docstring); jit with the keyword
    arguments static. Labels and features come from `compute_targets` on the frozen `model_params`."""
    targets = compute_targets(
        jax.lax.stop_gradient(model_params), batch, cfg=cfg, dtype=dtype, chunk_size=chunk_size, page_size=page_size
    )
    return head_loss(head_params, jax.tree_util.tree_map(jax.lax.stop_gradient, targets), alpha)


def make_optimizer(
    learning_rate: float = 5e-4,
    total_steps: int = 3000,
    warmup_steps: int = 2000,
    b1: float = 0.9,
    b2: float = 0.95,
    weight_decay: float = 0.01,
    clip_value: float = 0.5,
) -> optax.GradientTransformation:
    """AdamW after clipping each gradient entry to [-clip_value, clip_value]; the learning rate rises
    linearly from 0 over `warmup_steps`, then falls linearly to 0 at `total_steps` (DESIGN.md's settings;
    weight decay 0.01 is PyTorch AdamW's default)."""
    schedule = lr_schedule(learning_rate, total_steps, warmup_steps)
    return optax.chain(
        optax.clip(clip_value), optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    )


def lr_schedule(learning_rate: float, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate` over `warmup_steps`, then linear decay to 0 at `total_steps`."""
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
            optax.linear_schedule(learning_rate, 0.0, max(total_steps - warmup_steps, 1)),
        ],
        [warmup_steps],
    )


def make_train_step(optimizer: optax.GradientTransformation, *, cfg: ModelConfig, dtype, chunk_size: int, alpha: float = DEFAULT_ALPHA):
    """A jitted `step(head_params, opt_state, model_params, batch) -> (head_params, opt_state, loss)`.

    The gradient is `loss_fn`'s with respect to the heads (the model's forward sits behind stop_gradient,
    so it runs once, undifferentiated); the heads and optimizer state are donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(head_params, opt_state, model_params, batch: Batch):
        loss, grads = jax.value_and_grad(loss_fn)(
            head_params, model_params, batch, cfg=cfg, dtype=dtype, chunk_size=chunk_size, alpha=alpha
        )
        updates, opt_state = optimizer.update(grads, opt_state, head_params)
        return optax.apply_updates(head_params, updates), opt_state, loss

    return step


# ------------------------------------------------------------- KVzip's label: ranked, pooled, from cached inputs

NORM_SCOPES = ("sequence", "head")


def normalise_labels(labels: jax.Array, valid: jax.Array, scope: str = "sequence") -> jax.Array:
    """`labels f32[L, T, H]` (log scores) as z-scores over the real tokens (`valid bool[T]`) of the whole
    sequence (`scope="sequence"`: every layer and head together, the order a budget pooled over them
    compares) or of each layer and kv head (`"head"`). Unreal tokens get 0."""
    if scope not in NORM_SCOPES:
        raise ValueError(f"label normalisation scope must be one of {', '.join(NORM_SCOPES)}, got {scope!r}")
    axes = (0, 1, 2) if scope == "sequence" else (1,)
    w = jnp.broadcast_to(valid[None, :, None], labels.shape).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w, axis=axes, keepdims=True), 1.0)
    mean = jnp.sum(labels * w, axis=axes, keepdims=True) / n
    std = jnp.sqrt(jnp.sum(jnp.square(labels - mean) * w, axis=axes, keepdims=True) / n)
    return jnp.where(w > 0, (labels - mean) / jnp.maximum(std, 1e-6), 0.0)


def cached_predictions(head_params: dict, x: jax.Array) -> jax.Array:
    """f32[L, T, H]: every layer's head on cached inputs `x [L, T, (Hq + 2H) * D]` (q, k, v before RoPE)."""
    stacked = jax.tree.map(lambda *w: jnp.stack(w), *[head_params[f"layer_{l}"] for l in range(x.shape[0])])

    def one(w, xl):
        h = jax.nn.silu(jnp.einsum("tf,fk->tk", xl.astype(jnp.float32), w["w1"].astype(jnp.float32)))
        return jnp.einsum("tk,kh->th", h, w["w2"].astype(jnp.float32))

    return jax.vmap(one)(stacked, x)


def ranked_loss(head_params: dict, x: jax.Array, labels: jax.Array, valid: jax.Array, *, alpha: float = DEFAULT_ALPHA,
                rank_weight: float = 1.0, temperature: float = 1.0, scope: str = "sequence") -> jax.Array:
    """Smooth-L1 to the normalised labels (`normalise_labels`) + alpha * smoothness + rank_weight * the
    listwise cross-entropy of softmax(prediction / temperature) against softmax(label / temperature), over
    the tokens of the whole sequence (scope "sequence": what a pooled budget ranks) or of each layer and
    head. `x [L, T, F]`, `labels f32[L, T, H]`, `valid bool[T]`: one cached sequence. Scalar f32."""
    target = normalise_labels(labels, valid, scope)
    pred = cached_predictions(head_params, x)
    w = jnp.broadcast_to(valid[None, :, None], pred.shape).astype(jnp.float32)
    fit = jnp.sum(optax.huber_loss(pred, target, delta=1.0) * w) / jnp.sum(w)
    pairs = w[:, 1:] * w[:, :-1]
    smooth = jnp.sum(jnp.square(pred[:, 1:] - pred[:, :-1]) * pairs) / jnp.maximum(jnp.sum(pairs), 1.0)
    axes = (0, 1, 2) if scope == "sequence" else (1,)
    masked = lambda z: jnp.where(w > 0, z / temperature, -jnp.inf)  # noqa: E731
    p = jax.nn.softmax(masked(target), axis=axes)
    logp = jax.nn.log_softmax(masked(pred), axis=axes)
    rank = -jnp.sum(jnp.where(w > 0, p * logp, 0.0)) / (1 if scope == "sequence" else pred.shape[0] * pred.shape[2])
    return fit + alpha * smooth + rank_weight * rank


def make_cached_step(optimizer: optax.GradientTransformation, **loss_options):
    """A jitted `step(head_params, opt_state, x, labels, valid) -> (head_params, opt_state, loss)` of
    `ranked_loss` (its keyword options fixed here) on one cached sequence; heads and optimizer state donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(head_params, opt_state, x, labels, valid):
        loss, grads = jax.value_and_grad(ranked_loss)(head_params, x, labels, valid, **loss_options)
        updates, opt_state = optimizer.update(grads, opt_state, head_params)
        return optax.apply_updates(head_params, updates), opt_state, loss

    return step


def top_share_recall(pred, labels, valid, share: float, pooled: bool = True) -> float:
    """Share of the label's top `share` of the real tokens that the prediction's top `share` holds, pooled
    over all layers and heads (`pooled`) or per layer and head (then averaged). `pred`, `labels [L, T, H]`
    (numpy or arrays), `valid bool[T]`."""
    import numpy as np

    pred, labels, valid = np.asarray(pred, np.float32), np.asarray(labels, np.float32), np.asarray(valid, bool)
    pred, labels = pred[:, valid], labels[:, valid]  # [L, n, H]
    if pooled:
        pred, labels = pred.reshape(1, -1, 1), labels.reshape(1, -1, 1)
    b = max(1, int(round(share * pred.shape[1])))
    top = lambda a: np.argsort(-a, axis=1)[:, :b]  # noqa: E731
    hits = [len(np.intersect1d(tp[:, h], tl[:, h])) / b for tp, tl in zip(top(pred), top(labels))
            for h in range(pred.shape[2])]
    return float(np.mean(hits))
