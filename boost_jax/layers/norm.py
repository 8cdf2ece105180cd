"""RMSNorm, computed in fp32 whatever the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in fp32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last dimension, in fp32, cast back to the compute dtype."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype, axis: str = "norm"):
        self.eps, self.dtype = eps, dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalize(x, self.eps) * self.scale[...].astype(jnp.float32)).astype(self.dtype)
