"""Next-token cross-entropy over fp32 logits [..., V] with one pass over them each way.

Autodiff of `optax.softmax_cross_entropy_with_integer_labels` (logsumexp minus the target's logit)
builds the gradient from a zero-filled [T, V] scatter of the targets plus a softmax recomputed from
the logits: three passes over the largest tensor of a small model's step. Here the backward is one
fused elementwise pass, softmax(logits) * (1 + 2 z log Z) - onehot(targets), from the logits and the
[T] normalisers the forward keeps.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, z_loss: float = 0.0,
                      weights: jax.Array | None = None) -> jax.Array:
    """Sum over tokens of -log softmax(logits)[target], plus z_loss * (log Z)^2 per token (PaLM's
    z-loss), each token's term times its weight when `weights` are given (a loss mask: instruction
    data's targets). logits: [..., V] fp32; targets: int [...]; weights: float [...]."""
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    return _weighted_sum(logits, targets, weights, z_loss)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _weighted_sum(logits, targets, weights, z_loss):
    return _forward(logits, targets, weights, z_loss)[0]


def _log_normaliser(logits: jax.Array) -> jax.Array:
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    return (top + jnp.log(jnp.exp(logits - top).sum(axis=-1, keepdims=True)))[..., 0]


def _forward(logits, targets, weights, z_loss):
    log_z = _log_normaliser(logits)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    total = (weights * (log_z - picked)).sum() + z_loss * (weights * jnp.square(log_z)).sum()
    return total, (logits, targets, weights, log_z)


def _backward(z_loss, saved, g):
    logits, targets, weights, log_z = saved
    gw = (g * weights)[..., None]
    scale = gw * (1.0 + 2.0 * z_loss * log_z)[..., None]
    hit = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1) == targets[..., None]
    grad = jnp.exp(logits - log_z[..., None]) * scale - jnp.where(hit, gw, 0.0)
    return grad.astype(logits.dtype), None, jnp.zeros_like(weights)


_weighted_sum.defvjp(_forward, _backward)
