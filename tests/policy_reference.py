"""Plain numpy statements of each method's definition, for cross-checking the policies (one sequence)."""

from __future__ import annotations

import numpy as np

from kvjax.cache.attention import dense_causal_attention
from kvjax.models import CausalLM, unrolled
from kvjax.models.rope import rope_frequencies


def capture_qk(model, tokens: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Post-RoPE q `[T, Hq, D]` and k `[T, H, D]` of every layer for `tokens [1, T]` (dense forward)."""
    import jax.numpy as jnp

    store = {}

    def attend(layer, inputs, carry):
        store[layer] = (np.asarray(inputs.q[0], np.float64), np.asarray(inputs.k[0], np.float64))
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), carry

    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    CausalLM(model.cfg, model.dtype).apply(
        {"params": model.params}, jnp.asarray(tokens), positions, rope_frequencies(model.cfg),
        unrolled(attend, model.cfg.num_layers), None,
    )
    return store


def attention_rows(q: np.ndarray, k: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Causal softmax attention of query rows `rows` over all keys: `[Hq, len(rows), T]`."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    kk = np.repeat(k, G, axis=1)  # [T, Hq, D]
    s = np.einsum("whd,thd->hwt", q[rows], kk) / np.sqrt(D)
    s = np.where(np.arange(T)[None, None, :] <= rows[None, :, None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def group_mean(x: np.ndarray, H: int) -> np.ndarray:
    """`[Hq, ...]` -> `[H, ...]` mean over each kv head's query group."""
    return x.reshape(H, x.shape[0] // H, *x.shape[1:]).mean(1)


def pool1d(x: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    """'same' 1-D pooling along the last axis (max pads -inf; avg pads 0 and divides by the kernel)."""
    pad = kernel // 2
    fill = -np.inf if pooling == "max" else 0.0
    xp = np.concatenate([np.full(x.shape[:-1] + (pad,), fill), x, np.full(x.shape[:-1] + (pad,), fill)], -1)
    windows = np.stack([xp[..., i : i + x.shape[-1]] for i in range(kernel)], -1)
    return windows.max(-1) if pooling == "max" else windows.sum(-1) / kernel


def snapkv_scores(q, k, window: int, kernel: int, pooling: str) -> np.ndarray:
    """SnapKV prefix scores `[H, T - window]`."""
    T = q.shape[0]
    attn = attention_rows(q, k, np.arange(T - window, T))  # [Hq, w, T]
    votes = group_mean(attn[:, :, : T - window].mean(1), k.shape[1])
    return pool1d(votes, kernel, pooling)


def h2o_scores(q, k) -> np.ndarray:
    """Accumulated attention `[H, T]`: column sums over every query, summed over the group."""
    T = q.shape[0]
    attn = attention_rows(q, k, np.arange(T)).sum(1)  # [Hq, T]
    return attn.reshape(k.shape[1], -1, T).sum(1)


def tova_scores(q, k) -> np.ndarray:
    """Last query's attention averaged over all query heads `[T]`."""
    T = q.shape[0]
    return attention_rows(q, k, np.array([T - 1]))[:, 0].mean(0)


def ada_budgets(prefix_scores: np.ndarray, base: int, alpha: float, window: int) -> np.ndarray:
    """Ada-KV paper form: shares of the layer's top H * base prefix scores, with the alpha floor."""
    H, S = prefix_scores.shape
    order = np.argsort(-prefix_scores.reshape(-1), kind="stable")[: H * base]
    counts = np.bincount(order // S, minlength=H)
    return np.round(counts * (1 - alpha) + alpha * base).astype(int) + window


def assert_top_set(kept: np.ndarray, scores: np.ndarray, candidates: np.ndarray, count: int, tol: float = 1e-5):
    """`kept ∩ candidates` is *a* top-`count` subset of `candidates` by `scores` (ties within tol allowed).
    Returns how many kept candidates tie with an excluded one."""
    chosen = np.intersect1d(kept, candidates)
    assert len(chosen) == count, f"kept {len(chosen)} of the candidates, expected {count}"
    excluded = np.setdiff1d(candidates, chosen)
    if len(excluded) and len(chosen):
        worst_kept, best_excluded = scores[chosen].min(), scores[excluded].max()
        assert worst_kept >= best_excluded - tol, f"kept score {worst_kept} < excluded score {best_excluded}"
        return int(np.sum(np.abs(scores[chosen] - best_excluded) <= tol))
    return 0
