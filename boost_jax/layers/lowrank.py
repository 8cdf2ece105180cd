"""The one linear layer of every arch (`boost_jax/archs.py`): dense `x @ W`, or a bottleneck pair
A: [d_in, r], B: [r, d_out] with the arch's latent function between them.

The checkpoint name LATENT tags x @ A (after its all-reduce under btp), before the latent function.
For an arch that carries latents (LaX), h_prev is the latent of the same projection in the previous
decoder layer (zero in the first), so shapes always match and the crossing rides along the layer
scan as carry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.archs import ARCHS, Arch
from boost_jax.config import ModelConfig
from boost_jax.parallel.blocks import btp_down, grouped_up
from boost_jax.parallel.plan import Plan
from boost_jax.remat import LATENT

LATENT_AXES = ("batch", "seq", "act_latent")


def cola_init_std(d_in: int, d_out: int, rank: int) -> float:
    """CoLA init: each factor ~ N(0, r^-1/2 (d_in + d_out)^-1/2); the product's variance ~ 1/(d_in + d_out)."""
    return rank**-0.25 * (d_in + d_out) ** -0.25


class Linear(nnx.Module):
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
    ):
        self.arch, self.dtype = ARCHS[arch], dtype
        if not self.arch.low_rank:
            w = init_std * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype)
            self.w = nnx.Param(w, logical_axes=axes)
            return
        std = cola_init_std(d_in, d_out, rank)
        a = std * jax.random.normal(rngs.params(), (d_in, rank), param_dtype)
        b = std * jax.random.normal(rngs.params(), (rank, d_out), param_dtype)
        self.a = nnx.Param(a, logical_axes=(axes[0], "rank"))
        self.b = nnx.Param(b, logical_axes=("rank", axes[1]))

    def latent(self, plan: Plan, x: jax.Array) -> jax.Array:
        """The rank-r latent h (low-rank archs only)."""
        return self.activate(plan, x.astype(self.dtype) @ self.a[...].astype(self.dtype))

    def activate(self, plan: Plan, h: jax.Array, tag: bool = True) -> jax.Array:
        """The latent from the down-projection's output x @ A, tagged LATENT for low-rank
        checkpointing (the fused btp path tags its all-reduce outputs itself: tag=False)."""
        h = plan.constrain(h, LATENT_AXES)
        if tag:
            h = checkpoint_name(h, LATENT)
        return self.arch.latent_fn(h)

    def project(self, h: jax.Array) -> jax.Array:
        """Up-projection B of a latent."""
        return h @ self.b[...].astype(self.dtype)

    def __call__(self, plan: Plan, x: jax.Array) -> jax.Array:
        if not self.arch.low_rank:
            return x.astype(self.dtype) @ self.w[...].astype(self.dtype)
        return self.project(self.latent(plan, x))


class Projector:
    """Applies a block's linears under a plan: threads carried latents (LaX), and for the low-rank
    archs under a scheme with fused blocks (btp) runs BOOST's fused path (parallel/blocks.py): norm +
    grouped down-projection in one all-reduce, grouped up-projections.

    `prev` holds the previous layer's latents by projection name (lax); `new` collects this layer's.
    """

    def __init__(self, cfg: ModelConfig, plan: Plan, prev: dict[str, jax.Array]):
        self.cfg, self.plan, self.prev, self.new = cfg, plan, prev, {}
        self.arch: Arch = ARCHS[cfg.arch]
        self.fused = self.arch.low_rank and plan.scheme.fused_btp

    def normed(self, x: jax.Array, norm, linears: dict[str, Linear], out_axes: dict[str, tuple[str, str]]):
        """{name: linear(norm(x))} for linears sharing the input x (the residual stream).
        out_axes: name -> (weight axis, activation axis) of each output, for the grouped GEMM."""
        if not self.arch.low_rank and self.cfg.grouping:
            return self._stacked_dense(norm(x), linears)
        if not self.fused:
            x = norm(x)
            return {name: self(name, lin, x) for name, lin in linears.items()}
        c = self.cfg
        pre = btp_down(self.plan, x, [lin.a[...] for lin in linears.values()], x_axis="act_embed", w_axis="embed",
                       gamma=norm.scale[...], norm=c.norm, grouping=c.grouping, kernels=c.kernels, eps=c.norm_eps)
        hs = {name: self._cross(name, lin.activate(self.plan, h, tag=False))
              for (name, lin), h in zip(linears.items(), pre)}
        return self._up(hs, linears, out_axes)

    def __call__(self, name: str, linear: Linear, x: jax.Array, x_axes: tuple[str, str] | None = None) -> jax.Array:
        """One linear. Under the fused path, x_axes (activation axis, weight axis) says how x is split."""
        if not self.arch.low_rank:
            return linear(self.plan, x)
        if self.fused and x_axes is not None:
            pre = btp_down(self.plan, x, [linear.a[...]], x_axis=x_axes[0], w_axis=x_axes[1],
                           kernels=self.cfg.kernels)[0]
            h = linear.activate(self.plan, pre, tag=False)
        else:
            h = linear.latent(self.plan, x)
        return linear.project(self._cross(name, h))

    def _stacked_dense(self, x: jax.Array, linears: dict[str, Linear]) -> dict[str, jax.Array]:
        """Dense projections of one input and equal width as one stacked GEMM (Megatron's fused QKV):
        under column parallelism the input's gradient is then ONE partial sum, all-reduced once,
        where separate GEMMs leave XLA one all-reduce per projection."""
        out = {}
        for names in _by_width(linears).values():
            w = jnp.stack([linears[n].w[...].astype(x.dtype) for n in names], axis=1)  # [d, c, n]
            y = jnp.einsum("bsd,dcn->bscn", x, w)
            out.update({n: y[:, :, i] for i, n in enumerate(names)})
        return out

    def _cross(self, name: str, h: jax.Array) -> jax.Array:
        if not self.arch.carries_latents:
            return h
        self.new[name] = h
        return h + self.prev[name].astype(h.dtype)

    def _up(self, hs: dict[str, jax.Array], linears: dict[str, Linear], out_axes) -> dict[str, jax.Array]:
        """Up-projections; with grouping, those of equal width as one batched GEMM (GQA: q alone)."""
        if not self.cfg.grouping:
            return {name: linears[name].project(h) for name, h in hs.items()}
        out = {}
        for names in _by_width({n: linears[n] for n in hs}).values():
            if len(names) == 1:
                out[names[0]] = linears[names[0]].project(hs[names[0]])
                continue
            w_axis, y_axis = out_axes[names[0]]
            ys = grouped_up(self.plan, [hs[n] for n in names], [linears[n].b[...] for n in names],
                            w_axis=w_axis, y_axis=y_axis, kernels=self.cfg.kernels)
            out.update(zip(names, ys))
        return out


def _by_width(linears: dict[str, Linear]) -> dict[int, list[str]]:
    """Projection names grouped by output width (GQA: q apart from k and v)."""
    groups: dict[int, list[str]] = {}
    for name, lin in linears.items():
        groups.setdefault((lin.b if lin.arch.low_rank else lin.w).shape[-1], []).append(name)
    return groups
