"""Typed jnp views of the flat pool: the device side of the PoolLayout.

Notes: docs/modules.md (`kvjax/jenga/views.py`)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.jenga.layout import PoolLayout


def make_pool(layout: PoolLayout) -> jax.Array:
    """A zeroed pool: uint8[layout.pool_bytes]."""
    return jnp.zeros((layout.pool_bytes,), jnp.uint8)


def _page_bytes_2d(pool: jax.Array, layout: PoolLayout, group: str | int) -> jax.Array:
    """uint8[num_pages(group), page_bytes]: row p is the bytes of small page p of `group`."""
    if pool.dtype != jnp.uint8 or pool.shape != (layout.pool_bytes,):
        raise ValueError(f"pool must be uint8[{layout.pool_bytes}], got {pool.dtype}{list(pool.shape)}")
    spec = layout.spec(group)
    per_large = layout.pages_per_large(group)
    large_pages = pool.reshape(layout.num_large_pages, layout.large_page_bytes)
    used = large_pages[:, : per_large * spec.page_bytes]  # drops tail slack; a no-op when slack is 0
    return used.reshape(layout.num_large_pages * per_large, spec.page_bytes)


def typed_view(pool: jax.Array, layout: PoolLayout, group: str | int) -> jax.Array:
    """The pool read as pages of one group.

    pool: uint8[pool_bytes]. Returns dtype[num_pages(group), *page_shape] (for a KV group
    [pages, layers, 2, tokens_per_page, kv_heads, head_dim]); index it with the allocator's page ids.
    """
    spec = layout.spec(group)
    return reinterpret_pages(pool, layout, group, spec.dtype, spec.page_shape)


def reinterpret_pages(pool: jax.Array, layout: PoolLayout, group: str | int, dtype, page_shape) -> jax.Array:
    """The pages of `group` read as dtype[num_pages(group), *page_shape], a shape of the same byte size as
    the group's page. typed_view uses the spec's own dtype and shape; the serving engine reads a uniform
    paging group's uint8 pages [layers, tokens, bytes] as KV pages [layers, 2, tokens, kv_heads, head_dim].
    """
    spec = layout.spec(group)
    dtype = jnp.dtype(dtype)
    page_shape = tuple(int(d) for d in page_shape)
    if int(np.prod(page_shape)) * dtype.itemsize != spec.page_bytes:
        raise ValueError(
            f"group {spec.name!r}: pages of {spec.page_bytes} bytes cannot be read as {dtype}{list(page_shape)}"
        )
    rows = _page_bytes_2d(pool, layout, group)
    if dtype.itemsize > 1:
        rows = rows.reshape(rows.shape[0], -1, dtype.itemsize)
    values = jax.lax.bitcast_convert_type(rows, dtype)
    return values.reshape((rows.shape[0], *page_shape))


def read_typed_pages(pool: jax.Array, layout: PoolLayout, group: str | int, page_ids: jax.Array) -> jax.Array:
    """Gathers pages: page_ids int32[k] -> dtype[k, *page_shape]."""
    return typed_view(pool, layout, group)[jnp.asarray(page_ids, jnp.int32)]


def _flat_byte_indices(layout: PoolLayout, group: str | int, page_ids: jax.Array) -> jax.Array:
    """int[k, page_bytes]: pool offsets of every byte of each page."""
    spec = layout.spec(group)
    per_large = layout.pages_per_large(group)
    page_ids = jnp.asarray(page_ids, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    starts = (page_ids // per_large) * layout.large_page_bytes + (page_ids % per_large) * spec.page_bytes
    return starts[:, None] + jnp.arange(spec.page_bytes, dtype=starts.dtype)[None, :]


def write_typed_pages(
    pool: jax.Array, layout: PoolLayout, group: str | int, page_ids: jax.Array, pages: jax.Array
) -> jax.Array:
    """Returns the pool with pages `page_ids` of `group` replaced by `pages`.

    page_ids: int[k] (distinct); pages: [k, *page_shape] of the group's dtype. Only the bytes of those
    pages change (the pool's other groups and slack are untouched).
    """
    spec = layout.spec(group)
    dtype = jnp.dtype(spec.dtype)
    pages = jnp.asarray(pages)
    if pages.dtype != dtype or pages.shape[1:] != spec.page_shape:
        raise ValueError(
            f"pages for group {spec.name!r} must be {dtype}[k, {', '.join(map(str, spec.page_shape))}], "
            f"got {pages.dtype}{list(pages.shape)}"
        )
    as_bytes = jax.lax.bitcast_convert_type(pages.reshape(pages.shape[0], -1), jnp.uint8)
    as_bytes = as_bytes.reshape(pages.shape[0], spec.page_bytes)
    return pool.at[_flat_byte_indices(layout, group, page_ids)].set(as_bytes)


def apply_page_copies(pool: jax.Array, layout: PoolLayout, copies: Sequence) -> jax.Array:
    """Applies allocator PageCopy records (group, src, dst) to the pool, group by group."""
    by_group: dict[str, tuple[list[int], list[int]]] = {}
    for copy in copies:
        sources, destinations = by_group.setdefault(copy.group, ([], []))
        sources.append(copy.src)
        destinations.append(copy.dst)
    for group, (sources, destinations) in by_group.items():
        source_bytes = pool[_flat_byte_indices(layout, group, np.asarray(sources))]
        pool = pool.at[_flat_byte_indices(layout, group, np.asarray(destinations))].set(source_bytes)
    return pool
