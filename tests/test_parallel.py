"""Every TP scheme is the single-device model: same logits, loss and gradients on any mesh."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from boost_jax.config import ConfigError, load_config
from boost_jax.model.weights import abstract_model, init_params, place_params, sharded_init
from boost_jax.parallel import make_plan

# (arch, scheme, (dp, fsdp, tp)) on 8 devices. The inner loop: one case per scheme, each on a mesh with
# two parallel axes. The slow tier: pure data parallel once (no scheme splits anything), tp = 8 under
# each scheme (it replicates llama-tiny's 2 kv heads), fsdp under the two low-rank schemes; each
# (arch, scheme) pair once. A second dp x tp shape adds nothing the inner cases' do not.
INNER_LOOP = [("dense", "megatron", (2, 2, 2)), ("cola", "vanilla", (2, 1, 4)), ("cola", "btp", (4, 1, 2))]
SLOW = [("lax", "btp", (8, 1, 1)), ("dense", "megatron", (1, 1, 8)), ("svd", "vanilla", (1, 1, 8)),
        ("lax", "btp", (1, 1, 8)), ("lax", "vanilla", (2, 2, 2)), ("svd", "btp", (2, 2, 2))]


def config(arch, scheme, dp=1, fsdp=1, tp=1, *extra):
    return load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}", f"parallel.scheme={scheme}",
                              f"parallel.dp={dp}", f"parallel.fsdp={fsdp}", f"parallel.tp={tp}",
                              "train.batch_size=8", *extra])


def loss_logits_grads(cfg, devices):
    plan = make_plan(cfg, devices)
    graphdef, abstract = abstract_model(cfg)
    params = jax.device_put(init_params(cfg), plan.named(plan.param_specs(abstract)))
    tokens = jax.random.randint(jax.random.key(0), (8, 32), 0, cfg.model.vocab_size)
    batch_sharding = plan.sharding(("batch", None))
    inputs, targets = (jax.device_put(t, batch_sharding) for t in (tokens, jnp.roll(tokens, -1, 1)))

    def loss(params):
        logits = nnx.merge(graphdef, params)(inputs, plan=plan)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return jax.device_get((value, logits, grads))


@functools.cache
def reference(arch):
    return loss_logits_grads(config(arch, "megatron" if arch == "dense" else "btp"), jax.devices()[:1])


def assert_close(a, b, rtol):
    """Relative to each tensor's scale: fp32 sums reordered across devices differ by ~1e-6."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.abs(x - y).max() <= rtol * np.abs(y).max(), (np.abs(x - y).max(), np.abs(y).max())


@pytest.mark.parametrize("arch, scheme, mesh", [
    pytest.param(a, s, m, id=f"{a}-{s}-dp{m[0]}-fsdp{m[1]}-tp{m[2]}",
                 marks=() if (a, s, m) in INNER_LOOP else pytest.mark.slow) for a, s, m in INNER_LOOP + SLOW])
def test_scheme_equals_single_device(arch, scheme, mesh):
    value, logits, grads = loss_logits_grads(config(arch, scheme, *mesh), jax.devices())
    ref_value, ref_logits, ref_grads = reference(arch)
    assert value == pytest.approx(ref_value, rel=1e-6)
    assert_close(logits, ref_logits, 1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert_close(grads, ref_grads, 1e-5)


# Latent heads (model.attn_latent_heads): under btp each rank computes and keeps only its own groups of
# the k/v latents (a reduce-scatter, its backward an all-gather). The reference is the same model on one
# device; the inner loop runs latent heads under btp in test_decoupled_rope_equals_single_device's cola
# case (with the rotary keys beside the latents) and in tests/test_context.py (with cp), so the grid (tp=2,
# 4 and 8, GQA, fsdp, LaX's crossing, ungrouped, the sync norm, svd) is the slow tier's.
# (arch, (dp, fsdp, tp), overrides)
LATENT_HEADS = [
    ("cola", (4, 1, 2), ("model.attn_latent_heads=2",)),
    ("lax", (2, 2, 2), ("model.attn_latent_heads=2",)),
    ("cola", (1, 1, 8), ("model.attn_latent_heads=8", "model.n_kv_heads=8")),
    ("lax", (2, 1, 4), ("model.attn_latent_heads=4", "model.n_kv_heads=8", "model.grouping=false")),
    ("svd", (2, 1, 4), ("model.attn_latent_heads=4", "model.n_kv_heads=4", "model.norm=sync")),
]


@pytest.mark.parametrize("arch, mesh, overrides", [
    pytest.param(a, m, o, id=f"{a}-dp{m[0]}-fsdp{m[1]}-tp{m[2]}-" + "-".join(x.split("=")[1] for x in o),
                 marks=pytest.mark.slow) for a, m, o in LATENT_HEADS])
def test_latent_heads_equal_single_device(arch, mesh, overrides):
    value, logits, grads = loss_logits_grads(config(arch, "btp", *mesh, *overrides), jax.devices())
    ref_value, ref_logits, ref_grads = loss_logits_grads(config(arch, "btp", 1, 1, 1, *overrides), jax.devices()[:1])
    assert value == pytest.approx(ref_value, rel=1e-6)
    assert_close(logits, ref_logits, 1e-5)
    assert_close(grads, ref_grads, 1e-5)


# Decoupled RoPE (model.attn_rope_dims): each key [B_k's position-free part | a rotary key of its own
# projection, one per latent head]; the reference is the same model on one device. The inner loop: btp
# with latent heads on dp x fsdp x tp; the grid (vanilla at tp = 4, btp without latent heads, btp with
# latent heads at tp = 4, vanilla with fsdp, ungrouped latent heads, the sync norm) in the slow tier.
ROPE = [
    ("cola", "btp", (2, 2, 2), ("model.attn_latent_heads=2",)),
    ("svd", "vanilla", (2, 1, 4), ()),
    ("cola", "btp", (2, 2, 2), ()),
    ("lax", "btp", (2, 1, 4), ("model.attn_latent_heads=4", "model.n_kv_heads=4")),
    ("lax", "vanilla", (2, 2, 2), ()),
    ("cola", "btp", (4, 1, 2), ("model.attn_latent_heads=2", "model.grouping=false")),
    ("svd", "btp", (2, 1, 4), ("model.norm=sync",)),
]


@pytest.mark.parametrize("arch, scheme, mesh, overrides", [
    pytest.param(a, s, m, o, id=f"{a}-{s}-dp{m[0]}-fsdp{m[1]}-tp{m[2]}-" + "-".join(x.split("=")[1] for x in o),
                 marks=() if i < 1 else pytest.mark.slow) for i, (a, s, m, o) in enumerate(ROPE)])
def test_decoupled_rope_equals_single_device(arch, scheme, mesh, overrides):
    extra = ("model.attn_rope_dims=4", *overrides)
    value, logits, grads = loss_logits_grads(config(arch, scheme, *mesh, *extra), jax.devices())
    ref_value, ref_logits, ref_grads = loss_logits_grads(config(arch, "btp", 1, 1, 1, *extra), jax.devices()[:1])
    assert value == pytest.approx(ref_value, rel=1e-6)
    assert_close(logits, ref_logits, 1e-5)
    assert_close(grads, ref_grads, 1e-5)


def test_parameter_init_does_not_depend_on_the_mesh():
    cfg = config("cola", "btp", 1, 2, 4)
    plan = make_plan(cfg)
    graphdef, abstract = abstract_model(cfg)
    sharded = jax.device_put(init_params(cfg), plan.named(plan.param_specs(abstract)))
    single = init_params(config("cola", "btp"))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), jax.device_get(single))


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_accelerators_compute_only_their_own_parameter_shards():
    """What `place_params` runs off the CPU: the initializer compiled for the plan's shardings (here a
    pipeline's layer order, fsdp and tp) gives the one-device values, and no device holds the model."""
    cfg = config("cola", "btp", 1, 2, 2, "parallel.pp=2", "parallel.pp_repeats=2", "model.n_layers=4",
                 "train.microbatches=2")
    plan = make_plan(cfg)
    init = sharded_init(cfg, plan)
    expected = place_params(cfg, plan)  # on the CPU: initialised on one device, then placed
    params = init()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(expected))
    memory = init.lower().compile().memory_analysis()  # per device
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    shards = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert shards < whole / 4
    assert shards <= memory.output_size_in_bytes <= shards + 8 * len(jax.tree.leaves(params))  # + the tuple's pointers
    # The random bits of its own shards, not of whole arrays: a third of the model's bytes (2 x the
    # shards before the pipeline split the vocabulary over pp too, which halved the table's shard).
    assert memory.temp_size_in_bytes < whole / 3


@pytest.mark.parametrize("overrides, needle", [
    (["model.arch=cola", "parallel.scheme=megatron"], "megatron does not apply to arch cola"),
    (["model.arch=dense", "parallel.scheme=btp"], "btp does not apply to arch dense"),
    (["parallel.tp=3"], "does not divide the 8 devices"),
    (["parallel.tp=4", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=32"], "model.n_heads=2 must divide by tp = 4"),
    (["parallel.tp=8", "model.d_ff=100"], "model.d_ff=100 must divide by tp = 8"),
    (["parallel.tp=8", "parallel.scheme=vanilla", "model.attn_rank=12"], "model.attn_rank=12 must divide by tp = 8"),
    (["parallel.tp=2", "model.vocab_size=511"], "model.vocab_size=511 must divide by tp x pp = 2"),
    (["parallel.tp=2", "parallel.pp=2", "train.microbatches=2", "model.vocab_size=514"],
     "model.vocab_size=514 must divide by tp x pp = 4 (vocab-parallel embedding and head, over tp and pipeline stages)"),
    (["parallel.dp=8", "train.batch_size=4"], "train.batch_size=4 must divide by dp x fsdp = 8"),
    (["parallel.fsdp=4", "parallel.scheme=vanilla", "model.n_heads=3", "model.n_kv_heads=3", "model.head_dim=2"],
     "model.n_heads*head_dim=6 must divide by fsdp = 4"),
    (["parallel.fsdp=8", "model.attn_latent_heads=2", "model.head_dim=4"],
     "model.n_kv_heads*head_dim/attn_latent_heads=4 must divide by fsdp = 8 (the columns of a latent head's block"),
])
def test_shapes_that_do_not_divide_fail_early(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        make_plan(load_config(None, ["model.preset=llama-tiny", "train.batch_size=8", *overrides]))


@pytest.mark.slow  # the kernels against their twins: tests/test_kernels.py
def test_pallas_kernels_match_xla_in_a_btp_model():
    """The whole model with the Pallas kernels (interpreted on CPU) inside its shard_map blocks."""
    xla = loss_logits_grads(config("cola", "btp", 2, 1, 4, "model.kernels=xla"), jax.devices())
    pallas = loss_logits_grads(config("cola", "btp", 2, 1, 4, "model.kernels=pallas"), jax.devices())
    assert pallas[0] == pytest.approx(xla[0], rel=1e-6)
    assert_close(pallas[1:], xla[1:], 1e-5)


# Each switch off its default once; (sync, ungrouped) together would add no mechanism of its own.
@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
@pytest.mark.parametrize("norm, grouping", [("sync", True), pytest.param("online", False, marks=pytest.mark.slow)])
def test_norm_and_grouping_switches_keep_the_math(norm, grouping):
    value, logits, grads = loss_logits_grads(
        config("lax", "btp", 2, 1, 4, f"model.norm={norm}", f"model.grouping={grouping}"), jax.devices())
    ref_value, ref_logits, ref_grads = reference("lax")
    assert value == pytest.approx(ref_value, rel=1e-6)
    assert_close(logits, ref_logits, 1e-5)
    assert_close(grads, ref_grads, 1e-5)


@pytest.mark.slow  # the default (grouped) vanilla runs in the scheme x mesh cases above
def test_ungrouped_vanilla_keeps_the_math():
    value, logits, grads = loss_logits_grads(config("cola", "vanilla", 2, 1, 4, "model.grouping=false"), jax.devices())
    ref_value, ref_logits, ref_grads = reference("cola")
    assert value == pytest.approx(ref_value, rel=1e-6)
    assert_close(logits, ref_logits, 1e-5)
    assert_close(grads, ref_grads, 1e-5)


@pytest.mark.slow
def test_online_norm_equals_sync_norm_in_bf16():
    """Online RMSNorm is exact in bf16 too: same logits as sync within bf16 rounding, at tp=4."""
    run = lambda norm: loss_logits_grads(
        config("cola", "btp", 2, 1, 4, "model.dtype=bfloat16", f"model.norm={norm}"), jax.devices())
    online, sync = run("online"), run("sync")
    assert online[0] == pytest.approx(sync[0], rel=2e-3)
    assert_close(online[1], sync[1], 2e-2)


def test_megatron_stacks_projections_only_where_their_outputs_are_split():
    """Dense grouping stacks q|k|v and gate|up to all-reduce the input's gradient once under tp; at
    tp = 1 there is nothing to save and the stack only copies the weights (1.11-1.17x slower on CPU):
    the program is then grouping=false's. At tp = 2 the stacks are there (2 concatenates more: q|k|v,
    gate|up)."""
    from boost_jax.analysis.program import build

    def text(tp, grouping):
        prog = build(config("dense", "megatron", 1, 1, tp, "model.n_kv_heads=8", f"model.grouping={grouping}"))
        return jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).as_text()

    assert text(1, True) == text(1, False)
    assert text(2, True).count("stablehlo.concatenate") == text(2, False).count("stablehlo.concatenate") + 2
