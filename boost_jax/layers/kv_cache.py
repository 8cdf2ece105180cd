"""The caches of decoding: what each layer keeps of the tokens already seen, slot j of a row holding
the token at position j. A table of kinds (`CACHES`, chosen by name):

- `full` (`KVCache`): every layer's keys (after RoPE) and values, [B, H_kv, T, d_h] each: what
  every decoder keeps. Heads-first (as Hugging Face keeps them): attention reads each head's slots
  as one contiguous matrix, where a token-major cache is transposed, whole, at every step.
- `latent_v` (`ValueLatentCache`, low-rank archs only): the keys after RoPE, and the rank-r latent of
  v (the input of v's up-projection B_v: `silu(x A_v)` for cola and lax, crossed with the previous
  layer's for lax; `x A_v` for svd), [B, T, r]. v's up-projection is applied after attention, to the
  attention-weighted latents, once per query. It holds (H_kv d_h + r) / (2 H_kv d_h) of a full cache
  (62.5% for an MHA model at r = d / 4) and computes nothing more per cached token: smaller and, where
  a step is memory-bound, faster.
- `latent` (`LatentCache`, low-rank archs only): the rank-r latents of k and v, [B, T, r] each. Each
  step also rebuilds every cached token's key from its latent (RoPE follows k's up-projection, so it
  cannot be folded away: 2 r H_kv d_h FLOPs per cached token per layer). It holds r / (H_kv d_h) of a
  full cache (25% for an MHA model at r = d / 4); smaller still, but the rebuild costs more than the
  bytes it saves unless the machine computes ~r H_kv d_h / (H_kv d_h - r) FLOPs per value it reads
  (docs/design.md section 11). Neither latent kind saves anything where GQA already makes
  H_kv d_h <= r.

With decoupled RoPE (`model.attn_rope_dims` = d_r) the `latent` kind is `AbsorbedCache`: the latents
of k and v and each token's rotary keys (one per latent head, after RoPE), [B, g, T, d_r]; a step
absorbs B_k into the queries and B_v after the attention-weighted latents, rebuilding no key
(docs/design/absorbed-attention.md). It holds (2 r + g d_r) / (2 H_kv d_h) of a full cache.

With latent heads (`model.attn_latent_heads` = g) the latents are the same [B, T, r], in g groups of
r / g columns, each feeding only its H_kv / g heads: rebuilding a key costs 1/g of the FLOPs, and
under btp each tp rank holds only its own groups (1/tp of a latent cache) where one latent is
replicated on every rank.

The model's cache is one per layer (`empty`): decoding runs the layers one by one, so each layer's
cache (and weights) is its own buffer, never a slice copied out of a stack.

A forward with a cache writes its tokens at their positions (each row's tokens are consecutive: a
prompt, one decode step, a chunk) and then attends to the whole cache; slots past a query's position
are masked by causality, so what a shorter row left in its padding slots is never read before it is
overwritten. The caller sizes the cache (`length`) to hold every position it will write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from boost_jax.config import ModelConfig
from boost_jax.config.archs import ARCHS, CACHE_KINDS


def _write(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [B, T, r] or [B, H, T, d_h] (slots on the second-last axis) with new [B, S, r] or
    [B, S, H, d_h] at slots start[b] .. start[b] + S - 1 of each row: one scatter into the cache's
    buffer (slots past its end are dropped)."""
    b, s = new.shape[:2]
    slots = start[:, None] + jnp.arange(s)[None]  # [B, S]
    # Row and slot indices around the heads' slice: numpy puts their [B, S] first, new's layout.
    index = (jnp.arange(b)[:, None], *[slice(None)] * (cache.ndim - 3), slots)
    return cache.at[index].set(new.astype(cache.dtype), mode="drop")


KV_AXES = ("batch", "act_kv_heads", None, None)  # logical axes of a layer's keys or values [B, H_kv, T, d_h]
# Of a cached latent of k or v [B, T, r], its r as the scheme lays these latents out: with latent heads
# under btp split over tp (each rank caches its own groups, 1/tp of the latents), else as every latent.
CACHED_LATENT_AXES = ("batch", None, "act_kv_latent")
# Of cached rotary keys [B, g, T, d_r] (decoupled RoPE): their latent heads as k's latents are split.
CACHED_ROTARY_AXES = ("batch", "act_kv_rope", None, None)


class _LayerCache:
    """What every kind shares: one layer's `k` and `v`, each [B, T, r] or [B, H_kv, T, d_h]: slot j
    (position j) on the second-last axis."""

    AXES: dict[str, tuple]  # each field's logical axes

    @property
    def length(self) -> int:
        """Positions each row can hold."""
        return self.k.shape[-2]

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array):
        """This layer's cache with k, v [B, S, ...] (token-major, as projected) written at slots
        start[b] .. start[b] + S - 1."""
        return type(self)(_write(self.k, k, start), _write(self.v, v, start))

    def constrain(self, constrain: Callable):
        """This layer's cache laid out by the plan's `constrain`."""
        return type(self)(constrain(self.k, self.AXES["k"]), constrain(self.v, self.AXES["v"]))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache(_LayerCache):
    """One layer's keys (after RoPE) and values: k, v [B, H_kv, T, d_h]."""

    k: jax.Array
    v: jax.Array

    AXES = {"k": KV_AXES, "v": KV_AXES}

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
        """One layer's zeros for `batch` rows of `length` positions, at the compute dtype."""
        shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
        return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
        """Bytes one cached token takes, all layers."""
        return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LatentCache(_LayerCache):
    """One layer's latents of k's and v's up-projections: k, v [B, T, r]."""

    k: jax.Array
    v: jax.Array

    AXES = {"k": CACHED_LATENT_AXES, "v": CACHED_LATENT_AXES}

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int) -> LatentCache:
        """One layer's zeros for `batch` rows of `length` positions, at the compute dtype."""
        if not ARCHS[cfg.arch].low_rank:
            raise ValueError(f"a latent cache needs a low-rank arch (svd, cola, lax); {cfg.arch} has no latents")
        shape = (batch, length, cfg.attn_rank)
        return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
        """Bytes one cached token takes, all layers."""
        return 2 * cfg.n_layers * cfg.attn_rank * itemsize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ValueLatentCache(_LayerCache):
    """One layer's keys after RoPE, k [B, H_kv, T, d_h], and the latent of v's up-projection, v [B, T, r]."""

    k: jax.Array
    v: jax.Array

    AXES = {"k": KV_AXES, "v": CACHED_LATENT_AXES}

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int) -> ValueLatentCache:
        """One layer's zeros for `batch` rows of `length` positions, at the compute dtype."""
        return cls(KVCache.empty(cfg, batch, length).k, LatentCache.empty(cfg, batch, length).v)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
        """Bytes one cached token takes, all layers."""
        return cfg.n_layers * (cfg.n_kv_heads * cfg.head_dim + cfg.attn_rank) * itemsize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AbsorbedCache(_LayerCache):
    """`latent` with decoupled RoPE (`model.attn_rope_dims`): one layer's latents of k's and v's
    up-projections, k, v [B, T, r], and the rotary keys after RoPE, r [B, g, T, d_r] (one per latent
    head, heads-first as a full cache keeps keys)."""

    k: jax.Array
    v: jax.Array
    r: jax.Array

    AXES = {"k": CACHED_LATENT_AXES, "v": CACHED_LATENT_AXES, "r": CACHED_ROTARY_AXES}

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array, r: jax.Array) -> AbsorbedCache:
        """`_LayerCache.write`, with the rotary keys r [B, S, g, d_r] at the same slots."""
        return AbsorbedCache(_write(self.k, k, start), _write(self.v, v, start), _write(self.r, r, start))

    def constrain(self, constrain: Callable) -> AbsorbedCache:
        return AbsorbedCache(*(constrain(getattr(self, n), axes) for n, axes in self.AXES.items()))

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int) -> AbsorbedCache:
        """One layer's zeros for `batch` rows of `length` positions, at the compute dtype."""
        latents = LatentCache.empty(cfg, batch, length)
        rotary = jnp.zeros((batch, cfg.attn_latent_heads, length, cfg.attn_rope_dims), cfg.dtype)
        return cls(latents.k, latents.v, rotary)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
        """Bytes one cached token takes, all layers."""
        return cfg.n_layers * (2 * cfg.attn_rank + cfg.attn_latent_heads * cfg.attn_rope_dims) * itemsize


# `--cache` name (config/archs.py's CACHE_KINDS) -> its kind.
CACHES: dict[str, type[KVCache] | type[ValueLatentCache] | type[LatentCache]] = dict(
    zip(CACHE_KINDS, (KVCache, ValueLatentCache, LatentCache), strict=True))

LayerCache = KVCache | ValueLatentCache | LatentCache | AbsorbedCache
Cache = tuple[LayerCache, ...]  # the model's: one per layer


def cache_type(kind: str, cfg: ModelConfig) -> type[LayerCache]:
    """The class a `--cache` kind (CACHES) keeps for a model: `latent` is `AbsorbedCache` where the
    model's RoPE is decoupled (`model.attn_rope_dims`), its keys' latents then absorbed, not rebuilt."""
    return AbsorbedCache if kind == "latent" and cfg.attn_rope_dims else CACHES[kind]


def empty(kind: str, cfg: ModelConfig, batch: int, length: int) -> Cache:
    """The model's empty cache of a kind (CACHES): one per layer."""
    return tuple(cache_type(kind, cfg).empty(cfg, batch, length) for _ in range(cfg.n_layers))
