"""The one linear layer of every arch: dense `x @ W`, or a bottleneck pair A: [d_in, r], B: [r, d_out].

| arch  | output                        | latent h (checkpoint name "latent") |
|-------|-------------------------------|-------------------------------------|
| dense | x @ W                         | -                                   |
| svd   | (x @ A) @ B                   | x @ A                               |
| cola  | silu(x @ A) @ B               | silu(x @ A)                         |
| lax   | (h + h_prev) @ B, h as cola   | silu(x @ A)                         |

For lax, h_prev is the latent of the same projection in the previous decoder layer (zero in the
first), so shapes always match and the crossing rides along the layer scan as carry.
Adding an arch means adding a row here (and its parameter count in flops.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.sharding import constrain

LATENT = ("batch", "seq", "act_latent")


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
        self.arch, self.dtype = arch, dtype
        if arch == "dense":
            w = init_std * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype)
            self.w = nnx.Param(w, logical_axes=axes)
            return
        std = cola_init_std(d_in, d_out, rank)
        a = std * jax.random.normal(rngs.params(), (d_in, rank), param_dtype)
        b = std * jax.random.normal(rngs.params(), (rank, d_out), param_dtype)
        self.a = nnx.Param(a, logical_axes=(axes[0], "rank"))
        self.b = nnx.Param(b, logical_axes=("rank", axes[1]))

    def latent(self, x: jax.Array) -> jax.Array:
        """The rank-r latent h (low-rank archs only)."""
        h = x.astype(self.dtype) @ self.a[...].astype(self.dtype)
        if self.arch in ("cola", "lax"):
            h = jax.nn.silu(h)
        return checkpoint_name(constrain(h, LATENT), "latent")

    def project(self, h: jax.Array) -> jax.Array:
        """Up-projection B of a latent."""
        return h @ self.b[...].astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.arch == "dense":
            return x.astype(self.dtype) @ self.w[...].astype(self.dtype)
        return self.project(self.latent(x))


class Crossing:
    """Applies a block's linears, threading LaX latents (a no-op wrapper for the other archs).

    `prev` holds the previous layer's latents by projection name; `new` collects this layer's.
    """

    def __init__(self, arch: str, prev: dict[str, jax.Array]):
        self.arch, self.prev, self.new = arch, prev, {}

    def __call__(self, name: str, linear: Linear, x: jax.Array) -> jax.Array:
        if self.arch != "lax":
            return linear(x)
        h = linear.latent(x)
        self.new[name] = h
        return linear.project(h + self.prev[name].astype(h.dtype))
