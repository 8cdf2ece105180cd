"""The attention layer: its weights (q, k, v, o: arch-generic linears run by the plan's projection
strategy) around the attention op (ops/attention.py: RoPE, causal, cached and latent-value
attention).

The layer knows no scheme: without a cache it hands its q, k, v projections and its op to the
plan's projections (`Projections.attention`, `parallel/projections.py`), which attend where the plan
keeps the tokens, inside a shard_map region under context parallelism (`parallel/context.py`).
With a cache (`layers/kv_cache.py`) the queries attend to every key the cache holds (a prompt's
prefill, one decode step, a chunk of a long sequence) after writing their own keys into it; a
latent cache keeps rank-r latents, and the keys it keeps as latents are rebuilt here
(`keys_from_latents`). Where the tokens sit is the caller's (`ops.attention.Positions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.config import ModelConfig
from boost_jax.layers.kv_cache import KV_AXES, AbsorbedCache, KVCache, LatentCache, ValueLatentCache
from boost_jax.layers.lowrank import Linear, RotaryKeys, up_by_groups
from boost_jax.ops.attention import (
    AttentionOp,
    Positions,
    absorbed_attention,
    cached_attention,
    latent_value_attention,
    rope_at_slots,
)


def keys_from_latents(h: jax.Array, b: jax.Array, groups: int, head_dim: int) -> jax.Array:
    """Keys before RoPE, heads-first [B, H_kv, T, d_h], rebuilt from a cache's latents h [B, T, r]
    and k's up-projection b [r, H_kv d_h / g] (with latent heads the stacked blocks of a block-diagonal
    B; g = 1: B itself): the training forward's grouped up-projection (`lowrank.up_by_groups`, groups
    leading), then one transpose to heads-first."""
    batch, length, _ = h.shape
    y = up_by_groups(h, b.astype(h.dtype), groups, flat=True)  # [g, B T, H_kv d_h / g]
    y = y.reshape(groups, batch, length, -1, head_dim)  # [g, B, T, H_kv / g, d_h]
    return jnp.transpose(y, (1, 0, 3, 2, 4)).reshape(batch, -1, length, head_dim)


class Attention(nnx.Module):
    """q, k, v from the normed residual (RoPE on q and k), causal attention (`op`), o back to the
    residual. `proj` is the plan's projections (parallel/projections.py) in every method that takes it."""

    def __init__(self, cfg: ModelConfig, linear_kwargs: dict, rngs: nnx.Rngs):
        d, dh, dr = cfg.d_model, cfg.head_dim, cfg.attn_rope_dims
        self.op = AttentionOp(cfg.n_heads, dh, cfg.rope_theta, cfg.attention_query_block,
                              rope_scaling=cfg.rope_scaling, rope_dims=dr)
        lin = lambda i, o, axes, groups=1, bias=False: Linear(i, o, rank=cfg.attn_rank, axes=axes, rngs=rngs,
                                                              groups=groups, bias=bias, **linear_kwargs)
        # Latent heads split k's and v's latents only: q is not cached, and each query head keeps the
        # whole rank-r latent of its token (docs/design.md, latent heads).
        self.q = lin(d, cfg.n_heads * dh, ("embed", "heads"), bias=cfg.qkv_bias)
        # Decoupled RoPE (`model.attn_rope_dims` d_r): B_k makes each key's position-free part, a small
        # projection of its own one rotary key per latent head (docs/design/absorbed-attention.md).
        self.k = lin(d, cfg.n_kv_heads * (dh - dr), ("embed", "kv_heads"), cfg.attn_latent_heads, cfg.qkv_bias)
        self.v = lin(d, cfg.n_kv_heads * dh, ("embed", "kv_heads"), cfg.attn_latent_heads, cfg.qkv_bias)
        self.o = lin(cfg.n_heads * dh, d, ("heads", "embed"))
        self.k_rope = (RotaryKeys(d, cfg.attn_latent_heads * dr, groups=cfg.attn_latent_heads,
                                  init_std=linear_kwargs["init_std"], dtype=linear_kwargs["dtype"],
                                  param_dtype=linear_kwargs["param_dtype"], rngs=rngs) if dr else None)

    def __call__(self, x: jax.Array, norm, proj, where: Positions,
                 cache: KVCache | ValueLatentCache | LatentCache | AbsorbedCache | None = None):
        """x: the residual stream; `norm` is applied to it first (fused into q/k/v under btp). With a
        cache, this forward's keys and values (or their latents) are written into it at their
        positions first, and the queries attend to all it holds; returns the output and the updated
        cache."""
        heads, cache = self.heads(x, norm, proj, where, cache)
        return proj("o", self.o, heads, ("act_heads", "heads")), cache

    def heads(self, x: jax.Array, norm, proj, where: Positions,
              cache: KVCache | ValueLatentCache | LatentCache | AbsorbedCache | None = None):
        """The attention heads' output [B, S, H * d_h] before o (what o reads), and the cache. Without
        a cache the projections attend where the plan keeps the tokens (`Projections.attention`);
        with one (decoding, on one sequence chunk), over what the cache holds."""
        b, s, _ = x.shape
        if cache is None:
            out = proj.attention(x, norm, self.linears, self.op, where)
        elif where.segments is not None:
            raise ValueError("attention: a cache holds one document per row; segment ids do not apply")
        elif isinstance(cache, KVCache):
            out, cache = self._over_cache(x, norm, proj, where.of(b, s), cache)
        else:
            out, cache = self._over_latents(x, norm, proj, where.of(b, s), cache)
        out = out.reshape(b, s, self.op.n_heads * self.op.head_dim)
        return proj.plan.constrain(out, ("batch", "seq", "act_heads")), cache

    @property
    def linears(self) -> dict[str, Linear | RotaryKeys]:
        """The projections of the normed residual, by name (decoupled RoPE: its rotary keys', `k_rope`)."""
        return {"q": self.q, "k": self.k, "v": self.v, **({"k_rope": self.k_rope} if self.k_rope else {})}

    def _over_cache(self, x, norm, proj, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """This chunk's keys and values written into a full cache, its queries over all it holds."""
        q, k, v = proj.queries_keys_values(x, norm, self.linears, self.op, positions)
        cache = cache.write(k, v, positions[:, 0]).constrain(proj.plan.constrain)
        values = lambda p: jnp.einsum("bkgst,bktd->bskgd", p.astype(cache.v.dtype), cache.v)
        return cached_attention(q, cache.k, positions, values, query_block=self.op.query_block), cache

    def _over_latents(self, x, norm, proj, positions: jax.Array,
                      cache: LatentCache | ValueLatentCache | AbsorbedCache):
        """Attention over a cache of latents (layers/kv_cache.py): v stays a rank-r latent, its
        up-projection B_v (the projections' `up_weight`) applied after attention
        (`latent_value_attention`). Keys are cached after RoPE (latent_v), or as latents too
        (latent), every cached key then rebuilt from its latent and rotated at its slot's position;
        with decoupled RoPE (`AbsorbedCache`) B_k is absorbed into the queries instead
        (`absorbed_attention`): no key is rebuilt."""
        b, s, op = *x.shape[:2], self.op
        constrain = proj.plan.constrain
        kv = ("kv_heads", "act_kv_heads")
        hs = proj.latents(x, norm, self.linears)
        rotary = hs.pop("k_rope", None)
        rotary = None if rotary is None else rotary.reshape(b, s, -1, op.rope_dims)
        # latent_v's keys up-projected with q's (one batched GEMM where their widths are equal)
        up = {"q": hs["q"], **({"k": hs["k"]} if isinstance(cache, ValueLatentCache) else {})}
        qk = proj.up(up, self.linears, {"q": ("heads", "act_heads"), "k": kv})
        q = constrain(op.rotate(self.q.add_bias(qk["q"]).reshape(b, s, -1, op.head_dim), positions),
                      ("batch", "seq", "act_heads", None))
        if isinstance(cache, AbsorbedCache):
            cache = cache.write(hs["k"], hs["v"], positions[:, 0], op.rotate_keys(rotary, positions))
            cache = cache.constrain(constrain)
            out = absorbed_attention(q, cache.k, cache.r, cache.v, proj.up_weight(self.k), proj.up_weight(self.v),
                                     positions, groups=self.k.groups, query_block=op.query_block)
            # k's bias adds q . b_k to every score of a query alike, which softmax cancels
            return self._plus_value_bias(out), cache
        if isinstance(cache, ValueLatentCache):  # this chunk's keys, rotated once and cached
            k = self.k.add_bias(qk["k"]).reshape(b, s, -1, op.head_dim - op.rope_dims)
            k = op.keys(k, rotary, positions)
            cache = cache.write(constrain(k, ("batch", "seq", "act_kv_heads", None)), hs["v"], positions[:, 0])
            cache = cache.constrain(constrain)
            k = cache.k
        else:  # every cached key rebuilt from its latent
            cache = cache.write(hs["k"], hs["v"], positions[:, 0]).constrain(constrain)
            k = keys_from_latents(cache.k, proj.up_weight(self.k), self.k.groups, op.head_dim)
            if self.k.bias is not None:  # each kv head's bias [H_kv, 1, d_h], heads-first as the keys
                k = k + self.k.bias[...].astype(k.dtype).reshape(-1, 1, op.head_dim)
            k = constrain(rope_at_slots(k, op.rope_theta, op.rope_scaling), KV_AXES)  # slot j at position j
        out = latent_value_attention(q, k, positions, cache.v, proj.up_weight(self.v), query_block=op.query_block,
                                     groups=self.v.groups)
        return self._plus_value_bias(out), cache

    def _plus_value_bias(self, out: jax.Array) -> jax.Array:
        """Attention's output [B, S, H d_h] over values without their bias, plus it: each query's weights
        sum to 1, so v's bias passes through attention unchanged, each kv head's to its query heads."""
        if self.v.bias is None:
            return out
        op = self.op
        bias = self.v.bias[...].astype(out.dtype).reshape(-1, 1, op.head_dim)  # [H_kv, 1, d_h]
        return out + jnp.broadcast_to(bias, (bias.shape[0], op.n_heads // bias.shape[0], op.head_dim)).reshape(-1)
