"""Fused online RMSNorm + down-projection of one tensor-parallel rank (docs/design.md section 4).

Under BTP the residual is sharded on d, so a rank cannot normalise alone. It computes its share:

    s = sum_j x_j^2                                   (fp32, over the local k = d/p columns)
    h = ((x / rms) * gamma) @ a * rms,  rms = sqrt(s/k + eps)

Normalising by the LOCAL rms keeps the GEMM input in range for bf16; the rescale makes
h == (x * gamma) @ a, the rank's partial sum. One all-reduce of (h, s) and `recover` give
RMSNorm(x_full) @ A_full exactly:

    def block_in(x, gamma, a):                        # inside shard_map over "tp"; x: [T, d/p]
        h, s = norm_down(x, gamma, a, eps=1e-6, d_total=d)
        h, s = jax.lax.psum((h, s), "tp")             # ONE all-reduce (a tuple)
        return recover(h, s, eps=1e-6, d_total=d)     # [T, n] fp32; the caller casts

The Pallas kernel tiles tokens x output columns; each program computes its row block's
statistics, then the normalised GEMM over k chunks with fp32 accumulation, in one pass. It uses
only the portable subset (BlockSpecs, a grid, ref slices, fori_loop, jnp.dot) and asks for the
Triton backend on GPU (tests cross-lower it for CUDA); on CPU it runs in interpret mode.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import TRITON, block, check_impl, pad_axis, resolve_interpret, round_up

F32 = jnp.float32
# Powers of two >= 16 (Triton); small T/n/k shrink them. 64x128 fp32 accumulators fit 4 warps.
BLOCK_T, BLOCK_N, BLOCK_K = 64, 128, 32


def norm_down(x, gamma, a, *, eps: float, d_total: int, impl: str = "pallas",
              interpret: bool | None = None):
    """This rank's (h, s) for the online RMSNorm + down-projection.

    x: [..., k] residual shard, gamma: [k], a: [k, n] (fp32 or bf16).
    Returns h: [..., n] fp32 (== (x * gamma) @ a) and s: [...] fp32 (sum of x^2 over k).
    `d_total` (the full d) is checked against k; the math here needs only the local k.
    impl="pallas" runs the kernel (interpreted on CPU unless `interpret` says otherwise),
    impl="xla" its jnp twin; both share the analytic backward.
    """
    check_impl(impl)
    k = x.shape[-1]
    if gamma.shape != (k,) or a.ndim != 2 or a.shape[0] != k:
        raise ValueError(f"shapes x{x.shape} gamma{gamma.shape} a{a.shape}: need [..., k], [k], [k, n]")
    if d_total % k:
        raise ValueError(f"d_total={d_total} is not a multiple of the local k={k}")
    lead = x.shape[:-1]
    h, s = _norm_down(x.reshape(-1, k), gamma, a, float(eps), impl, resolve_interpret(interpret))
    return h.reshape(*lead, a.shape[1]), s.reshape(lead)


def recover(h_sum, s_sum, *, eps: float, d_total: int):
    """RMSNorm(x) @ A from the all-reduced (h, s): y = H / sqrt(S/d + eps)."""
    return h_sum / jnp.sqrt(s_sum / d_total + eps)[..., None]


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_down(x, gamma, a, eps, impl, interpret):
    if impl == "xla":
        return _reference(x, gamma, a, eps)
    return _pallas(x, gamma, a, eps, interpret)


def _fwd(x, gamma, a, eps, impl, interpret):
    return _norm_down(x, gamma, a, eps, impl, interpret), (x, gamma, a)


def _bwd(eps, impl, interpret, res, cts):
    # h == (x * gamma) @ a and s == sum x^2, so the norm's rms cancels out of the gradients.
    x, gamma, a = res
    dh, ds = cts
    xf, gf, dh = x.astype(F32), gamma.astype(F32), dh.astype(a.dtype)
    dxg = jnp.dot(dh, a.T, preferred_element_type=F32)  # d(x * gamma)
    dx = dxg * gf + 2.0 * xf * ds[:, None]
    dgamma = jnp.sum(xf * dxg, axis=0)
    da = jnp.dot((xf * gf).astype(a.dtype).T, dh, preferred_element_type=F32)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), da.astype(a.dtype)


_norm_down.defvjp(_fwd, _bwd)


def _reference(x, gamma, a, eps):
    """The jnp twin: the kernel's math and roundings, one XLA GEMM."""
    xf = x.astype(F32)
    s = jnp.sum(xf * xf, axis=1)
    rms = jnp.sqrt(s / x.shape[1] + eps)
    xn = (xf * (1.0 / rms)[:, None] * gamma.astype(F32)).astype(a.dtype)
    return jnp.dot(xn, a, preferred_element_type=F32) * rms[:, None], s


def _pallas(x, gamma, a, eps, interpret):
    (t, k), n = x.shape, a.shape[1]
    bt, bn, bk = block(t, BLOCK_T), block(n, BLOCK_N), block(k, BLOCK_K)
    tp, np_, kp = round_up(t, bt), round_up(n, bn), round_up(k, bk)
    # Zero padding is inert: padded columns add 0 to s and the GEMM; padded rows are sliced off.
    x = pad_axis(pad_axis(x, 0, tp), 1, kp)
    a = pad_axis(pad_axis(a, 0, kp), 1, np_)
    gamma = pad_axis(gamma, 0, kp)
    h, s = pl.pallas_call(
        partial(_kernel, k=k, eps=eps, bk=bk),
        grid=(tp // bt, np_ // bn),
        in_specs=[
            pl.BlockSpec((bt, kp), lambda i, j: (i, 0)),  # whole rows: the stats need all of k
            pl.BlockSpec((kp,), lambda i, j: (0,)),
            pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
        ],
        out_specs=[pl.BlockSpec((bt, bn), lambda i, j: (i, j)), pl.BlockSpec((bt,), lambda i, j: (i,))],
        out_shape=[jax.ShapeDtypeStruct((tp, np_), F32), jax.ShapeDtypeStruct((tp,), F32)],
        interpret=interpret,
        compiler_params=TRITON,
        name="online_rmsnorm_down",
    )(x, gamma, a)
    return h[:t, :n], s[:t]


def _kernel(x_ref, g_ref, a_ref, h_ref, s_ref, *, k, eps, bk):
    bt, bn = h_ref.shape
    steps = x_ref.shape[1] // bk
    cols = lambda i: pl.ds(pl.multiple_of(i * bk, bk), bk)

    def sumsq(i, s):
        xc = x_ref[:, cols(i)].astype(F32)
        return s + jnp.sum(xc * xc, axis=1)

    s = lax.fori_loop(0, steps, sumsq, jnp.zeros((bt,), F32))
    rms = jnp.sqrt(s / k + eps)
    inv = 1.0 / rms

    def gemm(i, acc):
        xn = x_ref[:, cols(i)].astype(F32) * inv[:, None] * g_ref[cols(i)].astype(F32)[None, :]
        return acc + jnp.dot(xn.astype(a_ref.dtype), a_ref[cols(i), :], preferred_element_type=F32)

    acc = lax.fori_loop(0, steps, gemm, jnp.zeros((bt, bn), F32))
    h_ref[...] = acc * rms[:, None]
    s_ref[...] = s  # every n block writes the same row statistics: benign
