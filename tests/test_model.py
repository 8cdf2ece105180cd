import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.config import ModelConfig
from boost_jax.layers.lowrank import cola_init_std
from boost_jax.model import Model, loss_fn
from boost_jax.ops.attention import Positions, causal_attention, rope
from boost_jax.parallel import single_device_plan

ARCHS = ("dense", "svd", "cola", "lax")


@nnx.jit
def logits_of(model, t):
    return model(t, plan=single_device_plan(model.cfg))


@nnx.jit
def loss_and_grads(model, t):
    return nnx.value_and_grad(loss_fn)(model, {"inputs": t, "targets": t}, single_device_plan(model.cfg))


def tiny(arch="cola", **kw) -> ModelConfig:
    return ModelConfig(preset="llama-tiny", arch=arch, **kw).resolved()


def tokens(b=2, s=16, vocab=512, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, s), 0, vocab)


# bf16 compute once on the dense path and once on the low-rank one (svd and cola: LaX's projections)
@pytest.mark.parametrize("arch, dtype", [*((a, "float32") for a in ARCHS),
                                         *(pytest.param(a, "bfloat16", marks=pytest.mark.slow) for a in ("dense", "lax"))])
def test_forward_backward_shapes(arch, dtype):
    model = Model(tiny(arch, dtype=dtype), rngs=nnx.Rngs(0))
    t = tokens()
    logits = logits_of(model, t)
    assert logits.shape == (2, 16, 512) and logits.dtype == jnp.float32
    loss, grads = loss_and_grads(model, t)
    assert abs(float(loss) - np.log(512)) < 0.1  # a fresh model predicts ~uniformly
    params = nnx.state(model, nnx.Param)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    grads = jax.device_get(jax.tree.leaves(grads))  # checked on the host: no program per leaf shape
    for g, p in zip(grads, jax.tree.leaves(params)):
        assert g.shape == p.shape and p.dtype == jnp.float32 and np.isfinite(g).all()
    assert all(np.abs(g).max() > 0 for g in grads)


@pytest.mark.parametrize("arch", ["svd", "cola", "lax"])
def test_bf16_compute_tracks_fp32(arch):
    cfg = tiny(arch)
    f32 = Model(cfg, rngs=nnx.Rngs(0))
    b16 = Model(dataclasses.replace(cfg, dtype="bfloat16"), rngs=nnx.Rngs(0))
    a, b = logits_of(f32, tokens()), logits_of(b16, tokens())
    assert 0 < float(jnp.abs(a - b).max()) < 0.05


def test_cola_init_statistics():
    d_in, d_out, r = 1024, 2752, 256
    cfg = ModelConfig(preset="llama-tiny", arch="cola", d_model=d_in, d_ff=d_out, n_heads=8, n_kv_heads=8,
                      mlp_rank=r, n_layers=1).resolved()
    gate = Model(cfg, rngs=nnx.Rngs(0)).layers.mlp.gate
    a, b = np.asarray(gate.a[...][0]), np.asarray(gate.b[...][0])
    std = cola_init_std(d_in, d_out, r)
    assert std == pytest.approx(r**-0.25 * (d_in + d_out) ** -0.25)
    assert a.std() == pytest.approx(std, rel=0.01) and b.std() == pytest.approx(std, rel=0.01)
    assert abs(a.mean()) < 0.01 * std and abs(b.mean()) < 0.01 * std
    # The product A @ B has variance ~ 1 / (d_in + d_out).
    assert (a @ b).var() == pytest.approx(1 / (d_in + d_out), rel=0.05)


def test_lax_crosses_latents_between_layers():
    one = dict(n_layers=1)
    cola, lax = Model(tiny("cola", **one), rngs=nnx.Rngs(0)), Model(tiny("lax", **one), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(logits_of(cola, tokens()), logits_of(lax, tokens()))  # first layer: h_prev = 0
    cola, lax = Model(tiny("cola"), rngs=nnx.Rngs(0)), Model(tiny("lax"), rngs=nnx.Rngs(0))
    assert float(jnp.abs(logits_of(cola, tokens()) - logits_of(lax, tokens())).max()) > 1e-3


def test_lax_adds_previous_latent_before_up_projection():
    layer = first_layer(Model(tiny("lax", n_layers=1), rngs=nnx.Rngs(0)))
    x, prev = jax.random.normal(jax.random.key(2), (1, 3, 64)), jax.random.normal(jax.random.key(3), (1, 3, 16))
    plan = single_device_plan(tiny("lax"))
    proj = plan.projections(tiny("lax"), plan, {"q": prev})
    a, b = layer.attn.q.a[...], layer.attn.q.b[...]
    got = proj("q", layer.attn.q, x, ("act_embed", "embed"))
    np.testing.assert_allclose(got, (jax.nn.silu(x @ a) + prev) @ b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(proj.new["q"], jax.nn.silu(x @ a), rtol=1e-6)


def first_layer(model: Model):
    """Layer 0 of the scanned stack as an ordinary (unstacked) Block."""
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[0], state))


def test_gate_silu_switch():
    on = Model(tiny("cola", mlp_gate_silu=True), rngs=nnx.Rngs(0))
    off = Model(tiny("cola", mlp_gate_silu=False), rngs=nnx.Rngs(0))
    assert float(jnp.abs(logits_of(on, tokens()) - logits_of(off, tokens())).max()) > 1e-3


def naive_attention(q, k, v):
    """Causal softmax attention with kv heads repeated for GQA, written out."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def test_a_flat_gemm_equals_the_batched_one_with_a_one_axis_weight_gradient():
    """`lowrank.matmul(flat=True)`: the same values and gradients as x @ w on [B, S, k] (odd sizes),
    and the weight gradient's dot contracts one axis, not two."""
    from boost_jax.layers.lowrank import matmul

    kx, kw, kg = jax.random.split(jax.random.key(11), 3)
    x, w, g = jax.random.normal(kx, (3, 7, 5)), jax.random.normal(kw, (5, 9)), jax.random.normal(kg, (3, 7, 9))
    outs = {}
    for flat in (True, False):
        y, vjp = jax.vjp(lambda x, w: matmul(x, w, flat=flat), x, w)
        outs[flat] = (y, *vjp(g))
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    weight_grad = lambda flat: jax.jit(jax.grad(lambda w: (matmul(x, w, flat=flat) * g).sum())).lower(w).as_text()
    assert "contracting_dims = [0, 1] x [0, 1]" in weight_grad(False)  # the check sees the layout it rules out
    assert "contracting_dims = [0, 1]" not in weight_grad(True)


# Dense and LaX; svd and cola have the same low-rank projections as LaX.
@pytest.mark.parametrize("arch", ["dense", "lax"])
def test_attention_matches_naive_gqa(arch):
    cfg = tiny(arch, n_layers=1)  # 8 heads, 2 kv heads
    layer = first_layer(Model(cfg, rngs=nnx.Rngs(0)))
    attn = layer.attn
    x = jax.random.normal(jax.random.key(4), (2, 12, 64))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    plan = single_device_plan(cfg)
    proj = plan.projections(cfg, plan, {p: jnp.zeros((2, 12, 16)) for p in "qkvo"})

    @nnx.jit  # one program (un-jitted, each op compiled alone)
    def layer_and_written_out(attn, norm, x):
        got, _ = attn(x, norm, proj, Positions(pos))
        x = norm(x)
        q = rope(attn.q(x, flat=False).reshape(2, 12, 8, 8), pos, cfg.rope_theta)  # x @ W as written
        k = rope(attn.k(x, flat=False).reshape(2, 12, 2, 8), pos, cfg.rope_theta)
        v = attn.v(x, flat=False).reshape(2, 12, 2, 8)
        return got, attn.o(naive_attention(q, k, v).reshape(2, 12, 64), flat=False)

    got, want = layer_and_written_out(attn, layer.attn_norm, x)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype, rtol, seq, head_dim, query_block", [
    # the loop over query blocks: 5 blocks of 8 of 40 positions
    (jnp.float32, 1e-6, 40, 8, 8),
    # one query block: 3 causal blocks of 128, each against the keys up to its end (each path once, each dtype once)
    (jnp.bfloat16, 2e-2, 384, 12, 512),
])
def test_blocked_attention_equals_whole_attention(dtype, rtol, seq, head_dim, query_block):
    """The CPU paths of attention against the written-out attention in fp32, with grouped-query
    heads: outputs and the gradients of a random cotangent, relative to each tensor's largest entry
    (measured: ~2e-7 in fp32, ~7e-3 in bf16)."""
    from boost_jax.ops.attention import causal_blocks, query_rows

    assert (query_rows(seq, query_block), causal_blocks(seq)) in ((8, 1), (384, 3))
    keys = jax.random.split(jax.random.key(6), 4)
    q, k, v = (jax.random.normal(key, (2, seq, h, head_dim)) for key, h in zip(keys, (8, 2, 2)))
    w = jax.random.normal(keys[3], (2, seq, 8, head_dim))
    blocked = lambda q, k, v: causal_attention(q, k, v, impl="xla", query_block=query_block).astype(jnp.float32)

    @jax.jit  # one program, as the model runs it (un-jitted, each op of the block loop compiled alone)
    def outputs_and_gradients(q, k, v, w):
        got, pull = jax.vjp(blocked, *(x.astype(dtype) for x in (q, k, v)))
        want, pull_want = jax.vjp(naive_attention, q, k, v)
        return (got, *pull(w)), (want, *pull_want(w))

    for a, b in zip(*outputs_and_gradients(q, k, v, w)):
        assert float(jnp.abs(a.astype(jnp.float32) - b).max()) <= rtol * float(jnp.abs(b).max())


def test_rope_is_relative():
    q, k = jax.random.normal(jax.random.key(5), (2, 1, 1, 1, 16))
    pos = lambda p: jnp.full((1, 1), p)
    dot = lambda m, n: float(jnp.sum(rope(q, pos(m), 1e4) * rope(k, pos(n), 1e4)))
    assert dot(7, 3) == pytest.approx(dot(104, 100), rel=1e-4)
    np.testing.assert_allclose(rope(q, pos(0), 1e4), q)


def hlo_size(n_layers: int) -> int:
    cfg = tiny("cola", n_layers=n_layers)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0))))
    f = jax.jit(jax.grad(lambda p, t: loss_fn(nnx.merge(graphdef, p), {"inputs": t, "targets": t},
                                              single_device_plan(cfg))))
    return len(f.lower(params, jax.ShapeDtypeStruct((2, 16), jnp.int32)).as_text().splitlines())


def test_layers_are_scanned_so_program_size_does_not_grow_with_depth():
    assert hlo_size(2) == hlo_size(16)


# Full remat's gradients: tests/test_remat.py.


def test_tied_embeddings_have_no_head():
    model = Model(tiny("cola", tie_embeddings=True), rngs=nnx.Rngs(0))
    assert not hasattr(model, "lm_head")
    # The head is the embedding table: scaling the table scales the logits' dependence on it.
    t = tokens()
    _, grads = loss_and_grads(model, t)
    assert float(jnp.abs(grads["embed"][...]).max()) > 0


def test_abstract_model_is_traced_once_and_each_caller_owns_its_copy():
    """`abstract_model` is cached per model config (planning and analysis ask for it many times); a
    caller that edits the state it got does not change what the next caller gets."""
    from boost_jax.config import load_config
    from boost_jax.model.weights import abstract_model

    cfg = load_config(None, ["model.preset=llama-tiny", "model.arch=cola"])
    graphdef, first = abstract_model(cfg)
    shapes = jax.tree.map(lambda x: x.shape, first)
    first["embed"] = nnx.Param(jax.ShapeDtypeStruct((1, 1), jnp.float32))
    again, second = abstract_model(cfg)
    assert again == graphdef and second is not first
    assert jax.tree.map(lambda x: x.shape, second) == shapes
    assert jax.tree.map(lambda x: x.shape, abstract_model(dataclasses.replace(cfg, model=tiny("dense")))[1]) != shapes
