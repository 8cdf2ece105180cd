"""Pallas kernels for BOOST's fused paths (online-RMSNorm + down-projection, grouped matmul).

Each kernel sits beside its jnp reference twin and a `jax.custom_vjp`; on CPU they run in
interpret mode. The kernels arrive with the optimization work (see docs); the package exists so
the import path is stable.
"""
