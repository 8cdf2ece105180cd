"""Pipeline parallelism: the SPMD schedule equals the plain layer scan, for the model and for a toy
stack; no bubble reaches a result; the stage boundary moves [b/M, s, d/tp] per device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from boost_jax.analysis.comm import measure
from boost_jax.analysis.program import build, config_for
from boost_jax.analysis.work import analyze
from boost_jax.config import ConfigError, load_config
from boost_jax.model.weights import abstract_model, place_params, relayout_layers
from boost_jax.parallel import make_plan
from boost_jax.parallel.context import query_group
from boost_jax.parallel.pipeline import Schedule, merge_microbatches, run_pipeline, split_microbatches
from boost_jax.training.run import train


def toy_layer(w, x, ctx):
    """A layer that reads its micro-batch's context (as the model reads its tokens' positions)."""
    return {"h": jnp.tanh(x["h"] @ w + ctx) + x["h"], "n": x["n"] + 1.0}


@pytest.mark.parametrize("stages, repeats, micro", [(2, 2, 4), (4, 1, 8),
                                                    *(pytest.param(*c, marks=pytest.mark.slow) for c in [(2, 1, 2), (4, 2, 4)])])
def test_schedule_equals_sequential_layers_and_hides_bubbles(stages, repeats, micro):
    mesh = jax.make_mesh((stages, 8 // stages), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layers = jax.random.normal(jax.random.key(0), (8, 16, 16)) * 0.3
    x = {"h": jax.random.normal(jax.random.key(1), (micro, 4, 16)), "n": jnp.zeros((micro, 4, 16))}
    ctx = jax.random.normal(jax.random.key(2), (micro, 4, 16))  # differs per micro-batch: each stage must read its own

    def sequential(layers, x):
        return jax.lax.scan(lambda c, w: (jax.vmap(lambda xi, ci: toy_layer(w, xi, ci))(c, ctx), None), x, layers)[0]

    schedule = Schedule(stages, repeats, micro)
    order = schedule.layer_order(8)

    def piped(layers, x):
        # NaN in every stage before the first micro-batch arrives: it must never reach an output or gradient.
        return run_pipeline(mesh, schedule, toy_layer, layers[order], x, ctx, bubble_value=jnp.nan)

    loss = lambda f: lambda layers, x: jnp.sum(f(layers, x)["h"] ** 2)
    want = sequential(layers, x)
    got = jax.jit(piped)(layers, x)
    np.testing.assert_allclose(got["h"], want["h"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["n"], 8.0)  # every micro-batch ran all 8 layers, once each
    g_want = jax.grad(loss(sequential), argnums=(0, 1))(layers, x)
    g_got = jax.jit(jax.grad(loss(piped), argnums=(0, 1)))(layers, x)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("repeats, copies", [(1, 0), (2, 1)])
def test_weights_kept_for_the_backward_once_per_stage_with_one_repeat(repeats, copies):
    """The loop's backward needs each chunk's weights. With one repeat the chunk is the whole stage,
    a static slice the same every iteration, so the weights are kept once (no [iterations, ...]
    residual); with R > 1 a traced index picks the chunk and each iteration keeps its copy (the
    memory model counts them: analysis/memory_model.py)."""
    mesh = jax.make_mesh((2,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,))
    schedule = Schedule(2, repeats, 4)
    layers = jax.ShapeDtypeStruct((4, 16, 16), jnp.float32)
    x = {"h": jax.ShapeDtypeStruct((4, 2, 8, 16), jnp.float32), "n": jax.ShapeDtypeStruct((4, 2, 8, 16), jnp.float32)}
    piped = lambda w, x: run_pipeline(mesh, schedule, toy_layer, w, x, jnp.zeros((4, 2, 8, 16)))
    with jax.set_mesh(mesh):
        _, residuals = jax.eval_shape(lambda w, x: jax.vjp(piped, w, x), layers, x)
    weight_like = [r.shape for r in jax.tree.leaves(residuals) if r.shape[-2:] == (16, 16)]
    per_iteration = [s for s in weight_like if s[0] == schedule.iterations]
    assert weight_like and len(per_iteration) == copies, weight_like


def test_microbatch_split_round_trips():
    x = jnp.arange(24).reshape(12, 2)
    parts = split_microbatches(x, 3)
    assert parts.shape == (3, 4, 2) and parts[1, 0, 0] == x[1, 0] and parts[1, 1, 0] == x[4, 0]
    np.testing.assert_array_equal(merge_microbatches(parts), x)


def config(arch, scheme, pp, tp, micro, repeats=1, *extra):
    return load_config(None, ["model.preset=llama-tiny", "model.n_layers=8", f"model.arch={arch}",
                              f"parallel.scheme={scheme}", f"parallel.pp={pp}", f"parallel.tp={tp}",
                              f"parallel.pp_repeats={repeats}", f"train.microbatches={micro}", "train.batch_size=8",
                              *extra])


def loss_and_grads(cfg, devices=None):
    plan = make_plan(cfg, devices)
    graphdef, _ = abstract_model(cfg)
    params = place_params(cfg, plan)  # the layers in the pipeline's storage order
    tokens = jax.random.randint(jax.random.key(0), (8, 32), 0, cfg.model.vocab_size)
    batch = jax.device_put(tokens, plan.sharding(("batch", None)))

    def loss(params):
        logits = nnx.merge(graphdef, params)(batch, plan=plan, remat_mode=cfg.train.remat)
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(batch, -1, 1)).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    order = plan.layer_order(cfg.model.n_layers)
    return jax.device_get((value, relayout_layers(grads, order, np.arange(len(order)))))


@functools.cache
def reference(arch, *extra):
    cfg = config(arch, "megatron" if arch == "dense" else "btp", 1, 1, 1, 1, *extra)
    return loss_and_grads(cfg, jax.devices()[:1])


@pytest.mark.parametrize("arch, scheme, pp, tp, micro, repeats, remat, extra", [
    ("cola", "btp", 2, 4, 2, 1, "none", ()),
    # The rest of the grid (megatron, pp 4, R 2, LaX, full and lowrank remat) runs in the full suite; decoupled
    # RoPE's keys are layer parameters the stages carry as any other (its math: test_parallel.py's rope cases).
    pytest.param("svd", "btp", 2, 2, 2, 1, "none", ("model.attn_rope_dims=4",), marks=pytest.mark.slow),
    pytest.param("dense", "megatron", 2, 4, 4, 1, "full", (), marks=pytest.mark.slow),
    pytest.param("lax", "btp", 2, 2, 4, 2, "lowrank", (), marks=pytest.mark.slow),  # dp=2; LaX; circular
    pytest.param("dense", "megatron", 4, 2, 4, 2, "none", (), marks=pytest.mark.slow),
    pytest.param("cola", "btp", 4, 2, 8, 1, "lowrank", (), marks=pytest.mark.slow),
    # Tied embeddings: one table for the lookup and the head, its vocabulary split over tp x pp.
    pytest.param("cola", "vanilla", 2, 2, 2, 1, "none", ("model.tie_embeddings=true",), marks=pytest.mark.slow),
])
def test_pipelined_model_equals_one_device(arch, scheme, pp, tp, micro, repeats, remat, extra):
    value, grads = loss_and_grads(config(arch, scheme, pp, tp, micro, repeats, f"train.remat={remat}", *extra))
    ref_value, ref_grads = reference(arch, *extra)
    assert value == pytest.approx(ref_value, rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max() + 1e-7


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.pp=2", "parallel.pp_repeats=3", "train.microbatches=2"],
     "model.n_layers=8 must divide by parallel.pp x parallel.pp_repeats = 2 x 3"),
    (["parallel.pp=4", "train.microbatches=2"], "train.microbatches=2 must be at least parallel.pp=4"),
    (["parallel.pp_repeats=2"], "parallel.pp_repeats=2 needs parallel.pp > 1"),
    (["parallel.pp=2", "parallel.dp=4", "train.microbatches=4"],
     "a micro-batch of train.batch_size / train.microbatches = 2 rows must divide by dp x fsdp = 4"),
])
def test_pipeline_shapes_that_do_not_divide_fail_early(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        make_plan(load_config(None, ["model.preset=llama-tiny", "model.n_layers=8", "train.batch_size=8",
                                     *overrides]))


def head_flops(model, pp, seq, tp=4, **kw):
    """The GEMM FLOPs outside the compiled train step's loops, per device: the LM head's forward and
    backward (the embedding is a lookup), and the model's config."""
    cfg = config_for(model, "cola", "btp", tp=tp, pp=pp, microbatches=pp, batch_size=pp, seq=seq, dtype="bfloat16", **kw)
    prog = build(cfg)
    text = jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).compile().as_text()
    gemms, _ = analyze(text, seq=seq, itemsize=2, query_block=cfg.model.attention_query_block,
                       group=query_group(prog.plan, cfg.model))
    return sum(g.flops * g.trip_count for g in gemms if not g.in_loop and not g.attention), cfg.model


@pytest.mark.parametrize("model, pp, tp, seq", [
    ("llama-tiny", 2, 4, 32),  # the paper's 13B layout
    # 30B at pp=4 on the tests' 8 devices with tp=2 (the paper's tp=4 needs 16)
    pytest.param("llama-30b", 4, 2, 512, marks=pytest.mark.slow)])
def test_each_stage_runs_1_over_pp_of_the_head(model, pp, tp, seq):
    """The embedding, head and loss split their vocabulary over tp x pp: each device's head GEMMs
    (forward, and the backward's two) do 1/pp of the 6 T d V / tp FLOPs every stage did when the
    edges ran the same on each (pp micro-batches of one sequence: T = pp x seq)."""
    flops, m = head_flops(model, pp, seq, tp, **({"overrides": ["model.n_layers=4"]} if model == "llama-tiny" else {}))
    every_stage_before = 6 * pp * seq * m.d_model * m.vocab_size / tp
    assert flops == every_stage_before / pp


@pytest.mark.slow  # the inner loop checks the stage-to-stage bytes in tests/test_perf_model.py
def test_stage_boundary_traffic_and_tp_collectives_from_the_hlo():
    """btp at pp=2 x tp=2: each iteration moves one [b/M, s, d/tp] residual per device (measured on
    the compiled HLO = analytic); the layers' TP collectives are those of the unpipelined model at
    the micro-batch's size: 4 all-reduces of rank-r latents."""
    common = dict(tp=2, seq=32, dtype="bfloat16", overrides=["model.n_layers=4", "model.n_kv_heads=8"])
    piped = measure(build(config_for("llama-tiny", "cola", "btp", batch_size=8, pp=2, microbatches=4, **common)))
    plain = measure(build(config_for("llama-tiny", "cola", "btp", batch_size=2, **common)))
    pipe = piped["pipeline"]
    assert (pipe["iterations"], pipe["bubble_fraction"]) == (5, 1 / 5)
    assert pipe["p2p_bytes_per_iteration"] == pipe["analytic_p2p_bytes_per_iteration"] == 2 * 32 * (64 // 2) * 2
    assert pipe["p2p_ops_per_iteration"] == ["collective-permute bf16[1, 2, 32, 32] over 2 (0.00 MiB)"]
    for key in ("layer_forward_bytes", "layer_backward_bytes", "layer_forward_collectives", "layer_forward_issued"):
        assert piped[key] == plain[key], key
    assert piped["layer_forward_issued"] == {"all-reduce": 4}


@pytest.mark.slow
def test_training_tracks_one_device_across_resumes_onto_other_layouts(tmp_path, tiny_overrides):
    """9 steps on one device against one run (btp, 4 micro-batches) resumed twice, each time on
    another layout of the 8 devices: steps 0-3 without a pipeline (tp=4, dp=2, the micro-batches
    accumulated), 3-6 under a circular pipeline (pp=2 x 2 repeats x tp=2, dp=2: the checkpoint's
    layers move into the pipeline's storage order), 6-9 out of it, with the weights sharded over
    fsdp instead of replicated over dp (tp=4 x fsdp=2): the losses follow the single device's."""
    common = [*tiny_overrides, "model.n_layers=4", "train.schedule_steps=9", "checkpoint.every=3",
              "train.eval_every=0"]
    one = train(load_config(None, [*common, "train.steps=9", f"run_dir={tmp_path / 'one'}", "checkpoint.every=0"]),
                jax.devices()[:1])  # the reference: its losses, no checkpoint
    moved = [*common, f"run_dir={tmp_path / 'moved'}", "train.microbatches=4"]
    layouts = [["parallel.tp=4"], ["parallel.pp=2", "parallel.pp_repeats=2", "parallel.tp=2"],
               ["parallel.tp=4", "parallel.fsdp=2", "parallel.dp=1"]]
    runs = [train(load_config(None, [*moved, f"train.steps={3 * i}", *layout])) for i, layout in enumerate(layouts, 1)]
    assert [r["start_step"] for r in runs] == [0, 3, 6]
    np.testing.assert_allclose([x for r in runs for x in r["losses"]], one["losses"], atol=1e-4)
    assert one["losses"][-1] < one["losses"][0] - 0.5
