"""The key/value cache of decoding: every layer's keys (after RoPE) and values, slot j of a row
holding the token at position j.

A forward with a cache writes its tokens' keys and values at their positions (each row's tokens
are consecutive: a prompt, one decode step, a chunk) and then attends to the whole cache; slots
past a query's position are masked by causality, so what a shorter row left in its padding slots
is never read before it is overwritten. The caller sizes the cache (`length`) to hold every
position it will write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from boost_jax.config import ModelConfig

# Logical axes of one layer's cache [B, T, Hkv, D] (the stacked cache has "layers" in front).
CACHE_AXES = ("batch", None, "act_kv_heads", None)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """k, v: [L, B, T, Hkv, D] for the model (the layer scan hands each layer its [B, T, Hkv, D])."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
        """Zeros for `batch` rows of `length` positions, at the compute dtype."""
        shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))

    @property
    def length(self) -> int:
        """Positions each row can hold."""
        return self.k.shape[-3]

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array) -> KVCache:
        """One layer's cache with k, v [B, S, Hkv, D] written at slots start[b] .. start[b] + S - 1."""
        put = jax.vmap(lambda cache, new, at: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), at, 0))
        return KVCache(put(self.k, k, start), put(self.v, v, start))

    def positions(self) -> jax.Array:
        """The position of every slot, [1, T] (the same in every row)."""
        return jnp.arange(self.length)[None]

    def constrain(self, constrain: Callable, stacked: bool = False) -> KVCache:
        """Laid out by the plan's `constrain` (the stacked cache with its layer axis in front)."""
        axes = ("layers", *CACHE_AXES) if stacked else CACHE_AXES
        return KVCache(constrain(self.k, axes), constrain(self.v, axes))
