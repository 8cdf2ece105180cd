"""Grouped up-projection (docs/design.md section 5): y[i] = z[i] @ b[i] for c latents in one kernel.

BTP's column-parallel up-projections that read different latents (B_q, B_k, B_v on z_q, z_k, z_v;
B_gate, B_up on z_g, z_u) run as one launch:

    y = grouped_matmul(jnp.stack([zq, zk, zv]), b_qkv)   # [3, T, r] x [3, r, m] -> [3, T, m]

The Pallas kernel's grid is (group, T block, m block); each program accumulates its tile over r
chunks in fp32 and stores it in z's dtype. Portable subset only (Triton on GPU, interpret on CPU).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import TRITON, block, check_impl, pad_axis, resolve_interpret, round_up

F32 = jnp.float32
BLOCK_T, BLOCK_M, BLOCK_K = 64, 128, 32


def grouped_matmul(z, b, *, impl: str = "pallas", interpret: bool | None = None):
    """z: [c, ..., r], b: [c, r, m] -> y: [c, ..., m] in z's dtype, y[i] = z[i] @ b[i].

    impl="pallas" runs the kernel (interpreted on CPU unless `interpret` says otherwise),
    impl="xla" its jnp twin (one batched dot); both share the analytic backward.
    """
    check_impl(impl)
    if b.ndim != 3 or z.ndim < 2 or z.shape[0] != b.shape[0] or z.shape[-1] != b.shape[1]:
        raise ValueError(f"shapes z{z.shape} b{b.shape}: need [c, ..., r] and [c, r, m]")
    if impl == "xla":  # one batched dot over every leading dim: a sequence split over devices stays split
        return _grouped(z, b, impl, None)
    c, lead = z.shape[0], z.shape[1:-1]
    y = _grouped(z.reshape(c, -1, z.shape[-1]), b, impl, resolve_interpret(interpret))
    return y.reshape(c, *lead, b.shape[2])


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _grouped(z, b, impl, interpret):
    if impl == "xla":
        return _reference(z, b)
    return _pallas(z, b, interpret)


def _fwd(z, b, impl, interpret):
    return _grouped(z, b, impl, interpret), (z, b)


def _bwd(impl, interpret, res, dy):
    z, b = res
    t = _rows(z)
    # dz in z's dtype straight from the dot: under column-parallel B it is a partial sum that the
    # SPMD partitioner all-reduces right at the dot, so an fp32 result would double that traffic.
    dz = jnp.einsum(f"c{t}m,crm->c{t}r", dy, b.astype(dy.dtype), preferred_element_type=z.dtype)
    db = jnp.einsum(f"c{t}r,c{t}m->crm", z, dy, preferred_element_type=F32)
    return dz.astype(z.dtype), db.astype(b.dtype)


def _rows(z) -> str:
    """Einsum letters for z's dims between the group and the contraction: "t" for [c, T, r]."""
    return "tuvw"[:z.ndim - 2]


_grouped.defvjp(_fwd, _bwd)


def _reference(z, b):
    """The jnp twin: one batched XLA dot, fp32 accumulation."""
    t = _rows(z)
    return jnp.einsum(f"c{t}r,crm->c{t}m", z, b, preferred_element_type=F32).astype(z.dtype)


def _pallas(z, b, interpret):
    (c, t, r), m = z.shape, b.shape[2]
    bt, bm, bk = block(t, BLOCK_T), block(m, BLOCK_M), block(r, BLOCK_K)
    tp, mp, kp = round_up(t, bt), round_up(m, bm), round_up(r, bk)
    # Zero padding is inert: padded r adds nothing, padded rows and columns are sliced off.
    z = pad_axis(pad_axis(z, 1, tp), 2, kp)
    b = pad_axis(pad_axis(b, 1, kp), 2, mp)
    y = pl.pallas_call(
        partial(_kernel, bk=bk),
        grid=(c, tp // bt, mp // bm),
        in_specs=[  # None squeezes the group dim: Triton's dot takes 2-D tiles only
            pl.BlockSpec((None, bt, kp), lambda g, i, j: (g, i, 0)),
            pl.BlockSpec((None, kp, bm), lambda g, i, j: (g, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, bt, bm), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((c, tp, mp), z.dtype),
        interpret=interpret,
        compiler_params=TRITON,
        name="grouped_matmul",
    )(z, b)
    return y[:, :t, :m]


def _kernel(z_ref, b_ref, y_ref, *, bk):
    dtype = jnp.promote_types(z_ref.dtype, b_ref.dtype)  # dot operands must agree
    rows = lambda i: pl.ds(pl.multiple_of(i * bk, bk), bk)

    def step(i, acc):
        zc, bc = z_ref[:, rows(i)].astype(dtype), b_ref[rows(i), :].astype(dtype)
        return acc + jnp.dot(zc, bc, preferred_element_type=F32)

    acc = lax.fori_loop(0, z_ref.shape[1] // bk, step, jnp.zeros(y_ref.shape, F32))
    y_ref[...] = acc.astype(y_ref.dtype)
