"""The one linear layer of every arch (`boost_jax/config/archs.py`): dense `x @ W`, or a bottleneck pair
A: [d_in, r], B: [r, d_out] with the arch's latent function between them.

The layer holds the weights and the math of its pieces (`down`, `activation`, `up`); how the
pieces run under a tensor-parallel scheme (grouping, collectives, LaX's crossing, the checkpoint
name of the latent) is the scheme's strategy (`parallel/projections.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.config.archs import ARCHS


def matmul(x: jax.Array, w: jax.Array, *, flat: bool) -> jax.Array:
    """x [..., k] @ w [k, n]; `flat`: as one 2-D GEMM over the tokens, so that autodiff's weight
    gradient x^T g contracts one [tokens] axis: from [B, S, k] it contracts (B, S), a layout XLA:CPU
    runs about 1.3x slower (docs/design.md, "Profile"). Callers pass `Plan.flat_tokens`: not where
    the sequence is split over devices, which merging would gather."""
    if not flat:
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def cola_init_std(d_in: int, d_out: int, rank: int) -> float:
    """CoLA init: each factor ~ N(0, r^-1/2 (d_in + d_out)^-1/2); the product's variance ~ 1/(d_in + d_out)."""
    return rank**-0.25 * (d_in + d_out) ** -0.25


def up_by_groups(h: jax.Array, b: jax.Array, groups: int, *, flat: bool) -> jax.Array:
    """h [..., r] @ the block-diagonal B of `groups` blocks [r / g, n] stacked in b [r, n], groups
    leading: [g, ..., n] (`flat`: the tokens as one axis, [g, N, n]). One batched matmul with the
    groups the batch axis on both sides, [g, N, r / g] x [g, r / g, n]: an einsum with the groups in
    the middle made XLA:CPU compute B^T h^T, which the next fusion read with a stride of N floats
    (llama-60m b32 decode, per layer and device: 30-67 ms against 3-13 ms this way)."""
    rows = h.reshape(-1, h.shape[-1]) if flat else h
    z = jnp.moveaxis(rows.reshape(*rows.shape[:-1], groups, -1), -2, 0)  # [g, ..., r / g]
    return jnp.einsum("j...k,jkn->j...n", z, b.reshape(groups, -1, b.shape[-1]))


def up_projection(h: jax.Array, b: jax.Array, groups: int, *, flat: bool) -> jax.Array:
    """h [..., r] @ B: b [r, n] itself (groups 1), or the block-diagonal B of `groups` blocks
    [r / g, n] stacked in b -> [..., g n], group j's r / g latent columns feeding only its own n
    outputs (latent heads, `up_by_groups`). `flat`: `matmul`'s."""
    if groups == 1:
        return matmul(h, b, flat=flat)
    y = up_by_groups(h, b, groups, flat=flat)  # [g, ..., n]
    return jnp.moveaxis(y, 0, -2).reshape(*h.shape[:-1], groups * b.shape[-1])


class Linear(nnx.Module):
    """A projection `x -> y` of one arch: `w` [d_in, d_out] (dense) or `a` [d_in, r], `b` [r, d_out],
    each carrying the logical axes its layout is derived from, and optionally a `bias` [d_out]. With `groups` > 1 (latent heads, k and
    v) B is block-diagonal: `b` [r, d_out / g] holds its g blocks [r / g, d_out / g] stacked, group j's
    latent columns mapping only to its share of the outputs."""

    rotary_key = False  # a projection with a B (RotaryKeys: the rotary keys of decoupled RoPE)

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        rank: int,
        arch: str,
        axes: tuple[str, str],
        init_std: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        groups: int = 1,
        bias: bool = False,
    ):
        self.arch, self.dtype, self.d_out, self.groups = ARCHS[arch], dtype, d_out, groups
        # Added to the output by `add_bias`, after the whole projection (after B in the low-rank archs):
        # dense and unfactored (docs/design/hf-models.md), laid out as the output.
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype), logical_axes=(axes[1],)) if bias else None
        if not self.arch.low_rank:
            w = init_std * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype)
            self.w = nnx.Param(w, logical_axes=axes)
            return
        # Each latent head is CoLA-initialised as a projection d_in -> d_out / g of rank r / g.
        std = cola_init_std(d_in, d_out // groups, rank // groups)
        a = std * jax.random.normal(rngs.params(), (d_in, rank), param_dtype)
        b = std * jax.random.normal(rngs.params(), (rank, d_out // groups), param_dtype)
        self.a = nnx.Param(a, logical_axes=(axes[0], "rank"))
        self.b = nnx.Param(b, logical_axes=("rank", axes[1]) if groups == 1 else ("latent_rows", "latent_cols"))

    def down(self, x: jax.Array, *, flat: bool) -> jax.Array:
        """x @ A, before the latent function (`flat`: `matmul`'s)."""
        return matmul(x.astype(self.dtype), self.a[...].astype(self.dtype), flat=flat)

    def activation(self, h: jax.Array) -> jax.Array:
        """The arch's latent function of x @ A (`jax.nn.<latent_activation>`, or the identity)."""
        name = self.arch.latent_activation
        return getattr(jax.nn, name)(h) if name else h

    def up(self, h: jax.Array, *, flat: bool) -> jax.Array:
        """h @ B (block-diagonal with latent heads)."""
        return up_projection(h, self.b[...].astype(self.dtype), self.groups, flat=flat)

    def up_with(self, h: jax.Array, b: jax.Array, *, flat: bool) -> jax.Array:
        """h @ b, where b is this projection's B or a device's rows of it (whole latent heads): what a
        strategy's own region does with the shard it holds."""
        blocks = b.shape[0] * self.groups // self.a.shape[1] if self.groups > 1 else 1
        return up_projection(h, b.astype(self.dtype), blocks, flat=flat)

    def add_bias(self, y: jax.Array) -> jax.Array:
        """y [..., d_out], this projection's output (its strategy's), plus its bias if it has one."""
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)

    def __call__(self, x: jax.Array, *, flat: bool) -> jax.Array:
        """The projection of x without its bias (`add_bias`) as written (one device's math; under a plan the model goes through its
        scheme's strategy instead)."""
        if not self.arch.low_rank:
            return matmul(x.astype(self.dtype), self.w[...].astype(self.dtype), flat=flat)
        return self.up(self.activation(self.down(x, flat=flat)), flat=flat)


class RotaryKeys(nnx.Module):
    """Decoupled RoPE's key projection (`model.attn_rope_dims`): a small dense `a` [d, g d_r], one
    d_r-wide rotary key per latent head (`groups` g), shared by that group's kv heads, rotated after
    it and never through B_k (docs/design/absorbed-attention.md). Strategies run it beside the low-rank
    A's of the same input (under btp in their GEMM and collective) and keep its output as it is: no
    latent function, no B, no LaX crossing."""

    rotary_key = True

    def __init__(self, d_in: int, d_out: int, *, groups: int, init_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.dtype, self.d_out, self.groups = dtype, d_out, groups
        self.a = nnx.Param(init_std * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype),
                           logical_axes=("embed", "rope_key"))

    def down(self, x: jax.Array, *, flat: bool) -> jax.Array:
        """x @ a: the rotary keys before RoPE, [..., g d_r]."""
        return matmul(x.astype(self.dtype), self.a[...].astype(self.dtype), flat=flat)

    def activation(self, h: jax.Array) -> jax.Array:
        """The identity: the keys are the projection's output."""
        return h
