"""The paged cache: every layer's cache of a kind (kv_cache.cache_type: full, latent_v, latent, absorbed where RoPE is decoupled) kept as
a pool of pages, each a kv_cache row of `page_tokens` slots, [N, H_kv, page_tokens, d_h] or
[N, page_tokens, r]: the kind's own dataclass with pages where it has rows. A sequence's page table
(int32 [P], serving/pages.py) lists its pages in order, position j in page table[j // page_tokens]
at slot j % page_tokens.

A forward over the pool (`view` then `store`) gathers each row's pages into the contiguous cache
the layers already read ([B, H_kv, P page_tokens, d_h] or [B, P page_tokens, r]), runs the cached
attention of layers/attention.py on it unchanged (so paged decoding computes what a contiguous
cache does), and scatters back only the positions the step wrote, each to its own page; a position
a row does not own (a padded token, an idle slot) goes to page N and is dropped. Exactness first:
the gather copies each row's whole table per step, where a paged-attention kernel would read the
pages in place.

Each field keeps its kv_cache.AXES past the rows: under tp a full pool is split over the kv heads,
and a latent pool with latent heads over its groups (each device holds 1/tp of the latents), as a
contiguous cache is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from boost_jax.config import ModelConfig
from boost_jax.layers.kv_cache import Cache, cache_type


def empty_pool(kind: str, cfg: ModelConfig, n_pages: int, page_tokens: int) -> Cache:
    """The model's empty pool of a kind: one per layer, `n_pages` pages of `page_tokens` positions."""
    return tuple(cache_type(kind, cfg).empty(cfg, n_pages, page_tokens) for _ in range(cfg.n_layers))


def constrain_pool(pool: Cache, constrain: Callable) -> Cache:
    """A pool laid out by the plan's `constrain`: pages on no mesh axis, the rest as the kind's AXES."""
    def layer(c):
        return type(c)(*(constrain(getattr(c, f), (None, *axes[1:])) for f, axes in c.AXES.items()))
    return tuple(map(layer, pool))


def _gather(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """pages [N, ..., page_tokens, w] at tables [B, P] -> [B, ..., P page_tokens, w]."""
    g = pages[tables]  # [B, P, ..., page_tokens, w]
    g = jnp.moveaxis(g, 1, -3)  # [B, ..., P, page_tokens, w]
    return g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def view(pool: Cache, tables: jax.Array) -> Cache:
    """Each row's contiguous cache [B, ..., P page_tokens, w] gathered from its pages (tables [B, P])."""
    return tuple(type(c)(*(_gather(getattr(c, f), tables) for f in c.AXES)) for c in pool)


def _scatter(pages: jax.Array, rows: jax.Array, tables: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """pages [N, ..., page_tokens, w] with rows [B, ..., T, w] at positions [B, S] written to their pages
    (tables [B, P]); a position not `valid` [B, S] is dropped."""
    n, page_tokens = pages.shape[0], pages.shape[-2]
    b = rows.shape[0]
    index = lambda first, second: (first, *[slice(None)] * (rows.ndim - 3), second)
    written = rows[index(jnp.arange(b)[:, None], positions)]  # [B, S, ..., w]
    page = jnp.take_along_axis(tables, jnp.clip(positions // page_tokens, 0, tables.shape[1] - 1), axis=1)
    page = jnp.where(valid & (positions < tables.shape[1] * page_tokens), page, n)  # n: out of range, dropped
    return pages.at[index(page, positions % page_tokens)].set(written, mode="drop")


def store(pool: Cache, rows: Cache, tables: jax.Array, positions: jax.Array, valid: jax.Array) -> Cache:
    """The pool with what a forward wrote into the gathered `rows` (at `positions` [B, S], where `valid`)
    put back into each row's pages."""
    return tuple(type(p)(*(_scatter(getattr(p, f), getattr(r, f), tables, positions, valid) for f in p.AXES))
                 for p, r in zip(pool, rows, strict=True))


def page_bytes(kind: str, cfg: ModelConfig, page_tokens: int, per_device: Callable[[jax.ShapeDtypeStruct, tuple], int]) -> int:
    """Bytes one page takes on one device, all layers: `per_device(array, axes)` says what a device
    holds of an array laid out by `axes` (a plan's sharding)."""
    layer = jax.eval_shape(lambda: cache_type(kind, cfg).empty(cfg, 1, page_tokens))
    return cfg.n_layers * sum(per_device(getattr(layer, f), (None, *axes[1:])) for f, axes in layer.AXES.items())
