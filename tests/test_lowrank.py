"""The grouped up-projection of latent heads (`lowrank.up_by_groups`): one batched matmul, groups
leading, that training's up-projection and the latent cache's key rebuild both run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import block_diag

from boost_jax.layers.attention import keys_from_latents
from boost_jax.layers.lowrank import up_projection

B, S, R, N, HEAD_DIM = 3, 5, 24, 12, 4  # odd token counts; B's blocks [R / g, N]


def dense_block_diagonal(b: jax.Array, groups: int) -> jax.Array:
    """The [r, g n] matrix the stacked blocks b [r, n] stand for: zeros off the blocks."""
    return block_diag(*jnp.split(b, groups, axis=0))


@pytest.mark.parametrize("groups", [4, pytest.param(2, marks=pytest.mark.slow), pytest.param(6, marks=pytest.mark.slow)])
def test_grouped_up_projection_equals_the_dense_block_diagonal_b_values_and_gradients(groups):
    kh, kb, kc = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (B, S, R), jnp.float32)
    b = jax.random.normal(kb, (R, N), jnp.float32)
    cotangent = jax.random.normal(kc, (B, S, groups * N), jnp.float32)
    dense_y, dense_vjp = jax.vjp(lambda h, b: h @ dense_block_diagonal(b, groups), h, b)
    for flat in (True, False):
        y, vjp = jax.vjp(lambda h, b: up_projection(h, b, groups, flat=flat), h, b)
        np.testing.assert_allclose(y, dense_y, rtol=1e-5, atol=1e-5)
        for grad, dense_grad in zip(vjp(cotangent), dense_vjp(cotangent)):
            np.testing.assert_allclose(grad, dense_grad, rtol=1e-5, atol=1e-5)


def test_rebuilt_keys_are_the_training_up_projection_heads_first():
    groups, kv_heads = 4, 2 * 4  # two kv heads per latent head
    n = kv_heads * HEAD_DIM // groups
    h = jax.random.normal(jax.random.key(1), (B, S, R), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (R, n), jnp.float32)
    keys = keys_from_latents(h, b, groups, HEAD_DIM)  # [B, H_kv, T, d_h]
    trained = up_projection(h, b, groups, flat=True).reshape(B, S, kv_heads, HEAD_DIM)
    np.testing.assert_array_equal(keys, jnp.transpose(trained, (0, 2, 1, 3)))
    dense = (h @ dense_block_diagonal(b, groups)).reshape(B, S, kv_heads, HEAD_DIM)
    np.testing.assert_allclose(keys, jnp.transpose(dense, (0, 2, 1, 3)), rtol=1e-5, atol=1e-5)
