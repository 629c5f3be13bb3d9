"""Selectors beyond Quest's bound: pages scored from a per-slot sketch of the keys, kept as page metadata.

Notes: docs/modules.md (`kvjax/policies/key_sketch.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.state import KeySketch, KVState, gather_layer
from kvjax.policies.base import PageView
from kvjax.policies.quest import Quest


def per_head(x: jax.Array, heads: int) -> jax.Array:
    """`[B, Hq, ...]` -> `[B, H, G, ...]` (query heads grouped by kv head)."""
    return x.reshape(x.shape[0], heads, x.shape[1] // heads, *x.shape[2:])


@dataclasses.dataclass(frozen=True)
class SketchSelect(Quest):
    codes_kind: ClassVar[str] = "float"  # how `sketch_page_scores` decodes the codes
    keeps_key_sketch: ClassVar[bool] = True

    # ---- what a subclass defines
    def fit(self, keys: jax.Array, valid: jax.Array) -> Any:
        """The sketch's parameters for one layer from its prefilled keys `[B, H, S, D]` (`valid bool[B, H, S]`):
        a pytree of `[B, H, ...]` arrays."""
        raise NotImplementedError

    def codes(self, params: Any, keys: jax.Array) -> jax.Array:
        """Sketch rows `[B, H, S, R]` (the stored dtype) of keys `[B, H, S, D]` with one layer's `params`."""
        raise NotImplementedError

    def query(self, params: Any, q: jax.Array) -> jax.Array:
        """The query `[B, H, G, D]` in the sketch's space, `f32[B, H, G, R']`, with one layer's `params`."""
        raise NotImplementedError

    # ---- the hooks the steps call
    def attach_sketch(self, state: KVState) -> KVState:
        """The state with a sketch fitted to its prefilled keys and written for every slot (after prefill)."""
        # one compile for every layer and budget: the layer is traced, the fields the sketch does not read reset
        spec = dataclasses.replace(self, token_budget=Quest.token_budget, dense_layers=0, per_kv_head=False)
        layers = [_fit_layer(spec, state, jnp.int32(layer)) for layer in range(state.page_table.shape[0])]
        params = jax.tree.map(lambda *xs: jnp.stack(xs), *(p for p, _ in layers))
        N, ps = state.k_pages.shape[:2]
        first = layers[0][1]
        codes = jnp.zeros((N + 1, ps, first.shape[-1]), first.dtype)  # row N: slots of no page (dropped)
        for layer, (_, rows) in enumerate(layers):
            pages = state.page_table[layer, :, :, : state.layer_read_pages(layer)]
            codes = codes.at[jnp.where(pages >= 0, pages, N)].set(rows.reshape(*pages.shape, ps, -1))
        return state.replace(key_sketch=KeySketch(codes=codes[:N], params=params))

    def sketch_keys(self, sketch: KeySketch, layer, k: jax.Array) -> jax.Array:
        """Rows `[B, C, H, R]` of new keys `k [B, C, H, D]` in `layer` (traced), for the append to write."""
        params = jax.tree.map(lambda x: x[layer], sketch.params)
        return jnp.swapaxes(self.codes(params, jnp.swapaxes(k, 1, 2)), 1, 2)

    def page_bounds(self, view: PageView, backend: str | None = None) -> jax.Array:
        """Each page's best sketched score, `f32[B, Hq or H, P]`; -inf for the current page and past the used.
        `backend` as `sketch_page_scores`' (None: the platform's)."""
        from kvjax.pallas_kernels.sketch_scores import sketch_page_scores

        sketch = view.key_sketch
        if sketch is None:
            raise ValueError(f"policy {self.name!r} needs the state's key sketch: prefill with this policy "
                             "(or derive it from a shared prefill), which attaches it")
        params = jax.tree.map(lambda x: x[view.layer], sketch.params)
        heads = view.page_table.shape[1]
        q = self.query(params, per_head(view.q, heads)).reshape(view.q.shape[0], view.q.shape[1], -1)
        return sketch_page_scores(q, sketch.codes, view.page_table, view.lengths, page_size=view.page_size,
                                  codes_kind=self.codes_kind, per_kv_head=self.per_kv_head, backend=backend)


@functools.partial(jax.jit, static_argnames=("policy",))
def _fit_layer(policy: SketchSelect, state: KVState, layer):
    keys, _, _, valid = gather_layer(state, layer)  # [B, H, S, D]
    keys = jnp.where(valid[..., None], keys.astype(jnp.float32), 0.0)
    params = policy.fit(keys, valid)
    return params, policy.codes(params, keys)
