"""Pallas kernels (interpret mode on CPU) against their jnp twins and the plain math.

The pallas and xla impls share one analytic backward, so gradients are also checked against
autodiff of the plain formulas; that is what pins the custom_vjp.
"""

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from pallas_kernels import grouped_matmul, norm_down, recover

EPS = 1e-6
DT = {"f32": jnp.float32, "bf16": jnp.bfloat16}
TOL = {"f32": 1e-5, "bf16": 4 * 2.0**-8}  # normwise: max error / max |reference|


def rng(*case):
    """An independent generator per test case (seeded by a hash of its parameters).
    numpy, not jax.random: eager jax ops would compile one small program per shape."""
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def normal(gen, shape, dtype=jnp.float32, mean=0.0, std=1.0):
    return jnp.asarray(mean + std * gen.standard_normal(shape), dtype)


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= tol, f"normwise error {err:.2e} > {tol:.1e}"


def weighted_sum(fn, weights):
    """A scalar with a random cotangent for every output of `fn`."""
    return lambda *args: sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(fn(*args), weights))


def grads(fn, args, gen):
    weights = [normal(gen, o.shape) for o in jax.eval_shape(fn, *args)]
    return jax.jit(jax.grad(weighted_sum(fn, weights), argnums=tuple(range(len(args)))))(*args)


# ---- norm_down --------------------------------------------------------------------------------

def nd_inputs(shape, dtypes, case):
    *lead, k, n = shape
    gen = rng(shape, dtypes, case)
    x = normal(gen, (*lead, k), DT[dtypes[0]], std=3.0)
    gamma = normal(gen, (k,), DT[dtypes[1]], mean=1.0, std=0.2)
    a = normal(gen, (k, n), DT[dtypes[2]], std=k**-0.5)
    return x, gamma, a


def nd(impl):
    return jax.jit(lambda x, g, a: norm_down(x, g, a, eps=EPS, d_total=4 * x.shape[-1], impl=impl))


def nd_plain(x, g, a):
    """What (h, s) mean, in fp32 and without any normalisation."""
    x, g, a = (v.astype(jnp.float32) for v in (x, g, a))
    return (x * g) @ a, jnp.sum(x * x, axis=-1)


# In the inner loop each tiling (one block, several blocks) once, one in fp32 and one in bf16.
ND_CASES = [((37, 24, 48), ("f32",) * 3), pytest.param((37, 24, 48), ("bf16",) * 3, marks=pytest.mark.slow),
            pytest.param((130, 40, 200), ("f32",) * 3, marks=pytest.mark.slow), ((130, 40, 200), ("bf16",) * 3),
            ((2, 19, 72, 20), ("f32",) * 3), ((9, 136, 16), ("bf16", "f32", "bf16"))]


@pytest.mark.parametrize("shape,dtypes", ND_CASES)
def test_norm_down_matches_twin_and_math(shape, dtypes):
    args = nd_inputs(shape, dtypes, "values")
    tol = TOL["bf16" if "bf16" in dtypes else "f32"]
    (h, s), (hx, sx) = nd("pallas")(*args), nd("xla")(*args)
    assert h.dtype == s.dtype == jnp.float32 and h.shape == (*shape[:-2], shape[-1])
    assert_close(h, hx, tol)
    assert_close(s, sx, TOL["f32"])
    hp, sp = nd_plain(*args)
    assert_close(h, hp, tol)
    assert_close(s, sp, TOL["f32"])


@pytest.mark.parametrize("shape,dtypes", ND_CASES)
def test_norm_down_gradients(shape, dtypes):
    args = nd_inputs(shape, dtypes, "grads")
    tol = TOL["bf16" if "bf16" in dtypes else "f32"]
    gp, gx = grads(nd("pallas"), args, rng(shape, dtypes)), grads(nd("xla"), args, rng(shape, dtypes))
    gm = grads(nd_plain, tuple(v.astype(jnp.float32) for v in args), rng(shape, dtypes))
    for p, x, m, arg in zip(gp, gx, gm, args):
        assert p.dtype == arg.dtype
        assert_close(p, x, tol)
        assert_close(p, m, tol)


def split_inputs(t=21, d=96, n=40):
    gen = rng("split", t, d, n)
    return normal(gen, (t, d), std=2.0), normal(gen, (d,), mean=1.0, std=0.2), normal(gen, (d, n), std=d**-0.5)


def rmsnorm_down(x, gamma, a):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * gamma @ a


def test_sharded_partials_recover_the_full_norm():
    p, (x, gamma, a) = 4, split_inputs()
    d = x.shape[1]
    local = jax.jit(lambda *v: norm_down(*v, eps=EPS, d_total=d))
    parts = [local(xi, gi, ai)
             for xi, gi, ai in zip(jnp.split(x, p, 1), jnp.split(gamma, p), jnp.split(a, p, 0))]
    h, s = sum(h for h, _ in parts), sum(s for _, s in parts)
    assert_close(recover(h, s, eps=EPS, d_total=d), rmsnorm_down(x, gamma, a), 1e-5)


def tp_norm_down(mesh, impl):
    d = 96

    def local(x, gamma, a):
        h, s = jax.lax.psum(norm_down(x, gamma, a, eps=EPS, d_total=d, impl=impl), "tp")
        return recover(h, s, eps=EPS, d_total=d)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), P("tp"), P("tp", None)),
                                 out_specs=P(), check_vma=False))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_shard_map_one_all_reduce(impl):
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    f, args = tp_norm_down(mesh, impl), split_inputs()
    assert_close(f(*args), rmsnorm_down(*args), 1e-5)
    hlo = f.lower(*args).compile().as_text()
    assert len(re.findall(r"\ball-reduce(?:-start)?\(", hlo)) == 1, "(h, s) must travel in ONE all-reduce"
    # Under grad (and remat) the sharded kernel still gives the unsharded gradient.
    gk = grads(lambda *v: (jax.checkpoint(f)(*v),), args, rng("tp grad"))
    gm = grads(lambda *v: (rmsnorm_down(*v),), args, rng("tp grad"))
    for got, want in zip(gk, gm):
        assert_close(got, want, 1e-5)


def test_norm_down_rejects_bad_inputs():
    x, gamma, a = nd_inputs((8, 16, 16), ("f32",) * 3, "bad")
    with pytest.raises(ValueError, match="impl"):
        norm_down(x, gamma, a, eps=EPS, d_total=64, impl="cuda")
    with pytest.raises(ValueError, match="d_total"):
        norm_down(x, gamma, a, eps=EPS, d_total=40)
    with pytest.raises(ValueError, match="shapes"):
        norm_down(x, gamma, a[:8], eps=EPS, d_total=64)


# ---- grouped_matmul ---------------------------------------------------------------------------

def gm_inputs(shape, dtype, case):
    c, *lead, r, m = shape
    gen = rng(shape, dtype, case)
    return normal(gen, (c, *lead, r), DT[dtype]), normal(gen, (c, r, m), DT[dtype], std=r**-0.5)


def gm(impl):
    return jax.jit(lambda z, b: (grouped_matmul(z, b, impl=impl),))


def gm_plain(z, b):
    z, b = z.astype(jnp.float32), b.astype(jnp.float32)
    return (jnp.stack([z[i] @ b[i] for i in range(z.shape[0])]),)


# As ND_CASES: each tiling once in the inner loop, one in fp32 and one in bf16.
GM_CASES = [((3, 37, 24, 48), "f32"), pytest.param((3, 37, 24, 48), "bf16", marks=pytest.mark.slow),
            pytest.param((2, 130, 40, 200), "f32", marks=pytest.mark.slow), ((2, 130, 40, 200), "bf16"),
            ((3, 2, 9, 16, 20), "f32"), ((1, 16, 136, 8), "bf16")]


@pytest.mark.parametrize("shape,dtype", GM_CASES)
def test_grouped_matmul_matches_twin_and_per_group(shape, dtype):
    z, b = gm_inputs(shape, dtype, "values")
    (y,), (yx,), (ym,) = gm("pallas")(z, b), gm("xla")(z, b), gm_plain(z, b)
    assert y.dtype == z.dtype and y.shape == (*shape[:-2], shape[-1])
    assert_close(y, yx, TOL[dtype])
    assert_close(y, ym, TOL[dtype])


@pytest.mark.parametrize("shape,dtype", GM_CASES)
def test_grouped_matmul_gradients(shape, dtype):
    z, b = gm_inputs(shape, dtype, "grads")
    gp = grads(jax.checkpoint(gm("pallas")), (z, b), rng(shape, dtype))
    gx = grads(gm("xla"), (z, b), rng(shape, dtype))
    gm_ = grads(gm_plain, (z.astype(jnp.float32), b.astype(jnp.float32)), rng(shape, dtype))
    for p, x, m, arg in zip(gp, gx, gm_, (z, b)):
        assert p.dtype == arg.dtype
        assert_close(p, x, TOL[dtype])
        assert_close(p, m, TOL[dtype])


def test_grouped_matmul_column_parallel_in_shard_map():
    """B sharded on its output width, z replicated: no communication, the unsharded result."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    z, b = gm_inputs((3, 21, 16, 64), "f32", "tp")
    f = jax.jit(jax.shard_map(grouped_matmul, mesh=mesh, in_specs=(P(), P(None, None, "tp")),
                              out_specs=P(None, None, "tp"), check_vma=False))
    assert_close(f(z, b), gm_plain(z, b)[0], 1e-5)
    assert "all-reduce" not in f.lower(z, b).compile().as_text()


# ---- compiled kernels -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_kernels_lower_to_triton_without_a_gpu(dtype):
    """Cross-lowering for CUDA runs the Pallas->Triton lowering here (not PTX compilation): it
    catches non-power-of-two tiles, 3-D dots and a fall back to the Mosaic GPU backend."""
    dt = DT[dtype]
    nd_args = [jax.ShapeDtypeStruct(s, dt) for s in [(37, 24), (24,), (24, 48)]]
    gm_args = [jax.ShapeDtypeStruct(s, dt) for s in [(3, 37, 24), (3, 24, 48)]]
    nd_k = lambda x, g, a: norm_down(x, g, a, eps=EPS, d_total=96, interpret=False)
    gm_k = lambda z, b: (grouped_matmul(z, b, interpret=False),)
    for fn, args in [(nd_k, nd_args), (gm_k, gm_args)]:
        for f in (fn, jax.value_and_grad(weighted_sum(fn, [1.0, 1.0]), argnums=(0, 1))):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_compiled_kernels_on_gpu(dtype):
    # fp32 twins would use TF32 on tensor cores; the Triton kernels do IEEE fp32.
    with jax.default_matmul_precision("float32"):
        for shape in [(37, 24, 48), (512, 256, 384)]:
            args = nd_inputs(shape, (dtype,) * 3, "gpu")
            kern = lambda x, g, a: norm_down(x, g, a, eps=EPS, d_total=4 * x.shape[-1], interpret=False)
            for got, want in zip(jax.jit(kern)(*args), nd("xla")(*args)):
                assert_close(got, want, TOL[dtype])
            for got, want in zip(grads(kern, args, rng(shape)), grads(nd_plain, args, rng(shape))):
                assert_close(got, want, TOL[dtype])
        for shape in [(3, 37, 24, 48), (3, 512, 256, 384)]:
            z, b = gm_inputs(shape, dtype, "gpu")
            kern = lambda z, b: (grouped_matmul(z, b, interpret=False),)
            assert_close(jax.jit(kern)(z, b)[0], gm("xla")(z, b)[0], TOL[dtype])
            for got, want in zip(grads(kern, (z, b), rng(shape)), grads(gm_plain, (z, b), rng(shape))):
                assert_close(got, want, TOL[dtype])
