"""Causal self-attention with RoPE and grouped-query heads; q/k/v/o are arch-generic linears."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.config import ModelConfig
from boost_jax.layers.lowrank import Linear, Projector


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the rotate-half layout (as Hugging Face LLaMA): x: [B, S, H, D]."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [B, S, 1, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def query_rows(seq: int, query_block: int) -> int:
    """Queries per block of XLA's attention: `model.attention_query_block` when it divides a longer
    sequence, else the whole sequence (the work analysis needs the same number)."""
    return query_block if seq > query_block and seq % query_block == 0 else seq


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, query_block: int) -> jax.Array:
    """Softmax attention over [B, S, heads, head_dim]. On GPU, cuDNN's fused (flash) kernel when it
    applies. Elsewhere XLA's, which materialises the scores: a loop over blocks of `query_rows`
    queries (each against every key, masked: the same FLOPs as one block), so one block's
    [B, H, rows, S] scores are live at a time instead of [B, H, S, S] (llama-7b, s=4096, tp=4: 2 GiB
    each), and each block's scores are recomputed in the backward pass instead of being kept for
    every layer (what a flash kernel does too)."""
    with jax.named_scope("attention"):  # the ops' name: `bench profile` and analysis/work.py find them by it
        if jax.default_backend() == "gpu":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        recompute = partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        b, s, h, d = q.shape
        rows, keys = query_rows(s, query_block), jnp.arange(s)
        if rows == s:
            return recompute(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v)

        @recompute
        def block(q_rows, first):
            mask = (first + jnp.arange(rows))[:, None] >= keys[None, :]
            return jax.nn.dot_product_attention(q_rows, k, v, mask=mask[None, None])

        blocks = jnp.moveaxis(q.reshape(b, s // rows, rows, h, d), 1, 0)
        out = jax.lax.map(lambda xs: block(*xs), (blocks, jnp.arange(0, s, rows)))
        return jnp.moveaxis(out, 0, 1).reshape(b, s, h, d)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, linear_kwargs: dict, rngs: nnx.Rngs):
        d, dh = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.rope_theta, self.query_block = cfg.rope_theta, cfg.attention_query_block
        lin = lambda i, o, axes: Linear(i, o, rank=cfg.attn_rank, axes=axes, rngs=rngs, **linear_kwargs)
        self.q = lin(d, cfg.n_heads * dh, ("embed", "heads"))
        self.k = lin(d, cfg.n_kv_heads * dh, ("embed", "kv_heads"))
        self.v = lin(d, cfg.n_kv_heads * dh, ("embed", "kv_heads"))
        self.o = lin(cfg.n_heads * dh, d, ("heads", "embed"))

    def __call__(self, x: jax.Array, norm, positions: jax.Array, apply: Projector) -> jax.Array:
        """x: the residual stream; `norm` is applied to it first (fused into q/k/v under btp)."""
        b, s, _ = x.shape
        kv = ("kv_heads", "act_kv_heads")
        qkv = apply.normed(x, norm, {"q": self.q, "k": self.k, "v": self.v},
                           {"q": ("heads", "act_heads"), "k": kv, "v": kv})
        q = qkv["q"].reshape(b, s, self.n_heads, self.head_dim)
        k = qkv["k"].reshape(b, s, self.n_kv_heads, self.head_dim)
        v = qkv["v"].reshape(b, s, self.n_kv_heads, self.head_dim)
        constrain = apply.plan.constrain
        q = constrain(rope(q, positions, self.rope_theta), ("batch", "seq", "act_heads", None))
        k = constrain(rope(k, positions, self.rope_theta), ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        out = causal_attention(q, k, v, self.query_block)
        out = constrain(out.reshape(b, s, self.n_heads * self.head_dim), ("batch", "seq", "act_heads"))
        return apply("o", self.o, out, ("act_heads", "heads"))
