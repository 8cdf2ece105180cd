"""Per-device memory of a config's train step, before it runs: what `python -m boost_jax.plan`
checks a layout against the GPU's HBM with.

    b = breakdown(cfg)                  # bytes per device, by part
    b["total"], b["step"]               # with and without the optimizer's state
    b["param_elems"]                    # parameters per device (a count)

Parts (docs/design.md, "Memory model"):
  params, grads     each weight's shard under the plan (dp/fsdp/tp/pp splits), at model.param_dtype;
                    with gradient accumulation, a second fp32 copy that sums the micro-batches
  fsdp_gathered     under FSDP, the rest of each weight's tp shard: XLA:CPU gathers the stacked
                    weights for the whole step, XLA:GPU one layer's inside the layer scan (`COMPILERS`)
  optimizer         train.optimizer's state as its init makes it (training/optimizers.py): AdamW two fp32
                    moments per parameter it updates, Muon one per matrix (and spectron an [L, r]
                    vector per factor, replicated), each moment sharded like its parameter
  activations       what one decoder layer saves for the backward pass under train.remat (read off
                    one compiled layer on its tp x cp devices, so context parallelism's 1/cp of
                    the positions and its attention's gathered keys are in it: the residuals of its vjp, per device, split into those
                    computed from its input, from its weights alone, and the weights themselves:
                    `LayerBytes`) x the layers of a stage x the micro-batches whose residuals are
                    live at once (1 with accumulation; all M * R + S - 1 iterations of the
                    pipeline's loop, each running Lc layers). A pipeline with one repeat keeps its
                    stage's weight-only residuals once; with R > 1 each iteration keeps its chunk's
                    weights (picked by a traced index: under FSDP gathered by XLA:CPU, the device's
                    shard by XLA:GPU) and what is computed from them; one iteration's residuals are
                    copied once more beside the loop's stacks.
  pipeline_buffers  the M micro-batches' hidden states around the pipeline's loop: on XLA:CPU 3.5 x M
                    full-width [rows, seq / cp, d] values, a fitted constant (input, inbox and outbox,
                    merged output, cotangents); on XLA:GPU counted in its buffer report: 4 x M of the
                    device's [rows, seq / cp, d / tp] (the backward loop's two cotangent carries, its
                    body's updated copy of one, the merged output the head's weight gradient reads
                    after the loop), and the loop's `jnp.where` predicates, which its backward stacks
                    per iteration broadcast to that shape, one byte an element (3 a stage-iteration in
                    parallel/pipeline.py: `valid` and the inbox's and outbox's puts; `stage == 0` is
                    loop-invariant)
  pipeline_backward on XLA:GPU, what a pipeline's backward holds beside its loop: the chunk's gradients
                    ([Lc, ...] out of its layer scan, beside the loop's accumulator of the stage's)
                    and the logits' cotangent at the compute dtype, which the head's weight gradient
                    reads after the loop
  loss              the fp32 logits [rows, seq (or train.loss_chunk) / cp, V / (tp pp)] and their cotangent
                    (XLA:GPU writes one over the other: `COMPILERS`; rows:
                    one micro-batch's, or under a pipeline all M, which the head sees merged)
  transient         the largest working set on top: one layer's backward (its recomputed forward
                    and cotangents), or the loss's

The layer's saved residuals are measured at the compute dtype, so a bf16 config gets bf16
activations at 2 bytes (what a GPU keeps; the CPU backend's own bf16 figures hold f32 copies).

XLA's CPU and GPU compilers lay the same step out differently (`COMPILERS`, measured on both
compiles: docs/design.md, "Compiled for GPUs"): the caller names the compiler whose program it
predicts, "cpu" for the programs the tests compile, "gpu" for what `python -m boost_jax.compile` and
the benchmarks' `--gpu-compile` check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Var
from jax.sharding import PartitionSpec as P

from boost_jax.config import Config
from boost_jax.config.archs import ARCHS
from boost_jax.model import PROJECTIONS, RESIDUAL_AXES, decoder_layer
from boost_jax.model.weights import abstract_model
from boost_jax.parallel import Plan, abstract_plan, make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.parallel.plan import abstract_config
from boost_jax.training.optimizers import make_optimizer
from boost_jax.training.step import optimizer_state_specs

FP32 = 4
# What the analyses read (XLA's optimized HLO, its buffer assignment) is fixed before the CPU backend
# emits and optimizes machine code, which they never run: LLVM at -O0 and the older elemental
# emitters (not the MLIR fusion emitters) compile in a third of the time. The buffer assignment, the
# GEMMs and the collectives are the same as the defaults'; the elemental emitters' fusions move a
# few percent fewer bytes (tests/test_planner_compile.py measures both).
ANALYSIS_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
ATTENTION = ("q", "k", "v", "o")  # projections at model.attn_rank; the MLP's at mlp_rank


@dataclasses.dataclass(frozen=True)
class CompilerMemory:
    """Where XLA's compilers differ in laying out one train step (each measured on both compiles)."""

    # FSDP: the whole stacked weights gathered for the step, or one layer's in the scan (so a circular
    # pipeline's iterations keep their chunk's weights gathered, or the device's shards)
    gathers_stack: bool
    loss_beside_grads: bool  # the loss's logits live beside the layers' gradients, or before they exist
    loss_buffers: int  # fp32 logits-sized buffers of the loss: logits and cotangent, or one written over
    # The optimizer update's working set on top of the gradients, in parameter bytes: one fitted
    # constant (docs/design.md section 15 says where); it sets the peak of a step whose activations
    # are small (full remat).
    update_temporaries: float
    # A pipeline's loop: counted from the compiler's buffer report (XLA:GPU), or XLA:CPU's fitted
    # 3.5 x M full-width values ("pipeline_buffers" in the module docstring)
    counts_pipeline_loop: bool


COMPILERS = {
    "cpu": CompilerMemory(gathers_stack=True, loss_beside_grads=True, loss_buffers=2, update_temporaries=0.0,
                          counts_pipeline_loop=False),
    "gpu": CompilerMemory(gathers_stack=False, loss_beside_grads=False, loss_buffers=1, update_temporaries=1.5,
                          counts_pipeline_loop=True),
}
PIPELINE_PREDICATES = 3  # the `jnp.where` masks per stage-iteration that parallel/pipeline.py's backward keeps


def _shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def one_layer_config(cfg: Config) -> Config:
    """What one device runs of one decoder layer: cfg's TP and CP splits and one micro-batch of the
    rows a device holds, on no other axis (dp/fsdp/pp change how many rows and layers, not the layer)."""
    p, t = cfg.parallel, cfg.train
    rows = t.batch_size // t.microbatches // (p.dp * p.fsdp)
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(p, dp=1, fsdp=1, pp=1, pp_repeats=1),
        train=dataclasses.replace(t, batch_size=rows, microbatches=1))


class LayerBytes(NamedTuple):
    """What one decoder layer keeps for its backward pass, per device, split by what it depends on
    (a loop keeps the three differently), and what its backward holds on top while it runs."""

    activations: int  # residuals computed from the layer's input: one set per layer per micro-batch
    invariant: int  # computed from the weights and constants alone (a weight's bf16 cast, the causal mask)
    weights: int  # the weights themselves
    transient: int  # the backward's working set: recomputed forward, cotangents, the layer's gradients


class Layer(NamedTuple):
    bytes: LayerBytes
    hlo: tuple[str, str]  # the compiled forward's and backward's text (the planner reads their GEMMs)


def layer_bytes(layer_cfg: Config) -> LayerBytes:
    return measure_layer(layer_cfg).bytes


def layer_bytes_on(devices: Sequence[jax.Device]) -> Callable[[Config], LayerBytes]:
    """`layer_bytes` compiled for `devices` (the first tp x cp of them): a GPU topology's
    (launch/gpu_target.py) measures the layer as XLA:GPU compiles it."""
    return lambda layer_cfg: measure_layer(layer_cfg, devices).bytes


def measure_layer(layer_cfg: Config, devices: Sequence[jax.Device] | None = None) -> Layer:
    """One decoder layer of a `one_layer_config`, measured from two compiles of the layer alone on
    its tp x cp devices (of `devices`, default JAX's): its forward returning the vjp's residuals, and
    its backward taking them. The compiles use the CPU's analysis options where they run on the CPU."""
    cfg, m = layer_cfg, layer_cfg.model
    n = cfg.parallel.tp * cfg.parallel.cp
    plan = make_plan(cfg, mesh_devices(cfg.parallel) if devices is None else list(devices)[:n])
    options = ANALYSIS_COMPILER_OPTIONS if plan.platform == "cpu" else {}
    graphdef, abstract = abstract_model(cfg)
    layers_def, layers = nnx.split(nnx.merge(graphdef, abstract).layers)
    one = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=plan.named(P(*s[1:]))),
                       nnx.to_pure_dict(layers), plan.param_specs(layers), is_leaf=lambda x: isinstance(x, P))
    dt = jnp.dtype(m.dtype)
    act = lambda width, axes: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len, width), dt,
                                                   sharding=plan.sharding(axes))
    latents = {p: act(m.attn_rank if p in ATTENTION else m.mlp_rank, ("batch", "seq", None))
               for p in PROJECTIONS} if ARCHS[m.arch].carries_latents else {}
    carry = (act(m.d_model, RESIDUAL_AXES), latents)
    layer = decoder_layer(layers_def, plan, cfg.train.remat)

    def forward(params, carry):
        return jax.vjp(lambda p, c: layer(c, p)[0], params, carry)[1]

    traced = jax.jit(forward).trace(one, carry)  # one trace: the jaxpr, the residuals' shapes, the compile
    fwd = traced.lower().compile(options)
    jaxpr = traced.jaxpr.jaxpr
    n_weights = len(jax.tree.leaves(one))
    weights, from_input = set(jaxpr.invars[:n_weights]), _dependents(jaxpr, jaxpr.invars[n_weights:])
    residuals = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             traced.out_info, fwd.output_shardings)
    kinds = {"activations": 0, "invariant": 0, "weights": 0}
    for r, v in zip(jax.tree.leaves(residuals), jaxpr.outvars):
        kinds["weights" if v in weights else "activations" if v in from_input else "invariant"] += _shard_bytes(r)
    bwd = jax.jit(lambda vjp, ct: vjp(ct)).lower(residuals, carry).compile(options)
    used = bwd.memory_analysis()
    return Layer(LayerBytes(**kinds, transient=used.temp_size_in_bytes + used.output_size_in_bytes),
                 (fwd.as_text(), bwd.as_text()))


def _dependents(jaxpr, inputs) -> set:
    """The variables of `jaxpr` computed from any of `inputs` (an equation's outputs depend on all
    its inputs: conservative through nested calls)."""
    found = set(inputs)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in found for v in eqn.invars):
            found.update(eqn.outvars)
    return found


_ELEMS: dict[tuple, int] = {}  # the planner asks for the same model and mesh many times


def param_elems(cfg: Config, plan: Plan) -> int:
    """Parameter elements one device holds: each weight's shard under the plan's specs."""
    key = (cfg.model, plan.scheme.name, tuple(plan.mesh.shape.items()))
    if key not in _ELEMS:
        _, abstract = abstract_model(cfg)
        specs = jax.tree.leaves(plan.param_specs(abstract), is_leaf=lambda x: isinstance(x, P))
        _ELEMS[key] = sum(math.prod(plan.named(s).shard_shape(a.shape))
                          for a, s in zip(jax.tree.leaves(nnx.to_pure_dict(abstract)), specs))
    return _ELEMS[key]


def optimizer_bytes(cfg: Config, plan: Plan) -> int:
    """Per-device bytes of the state `train.optimizer` keeps (traced from its init, no arrays)."""
    _, abstract = abstract_model(cfg)
    params = nnx.to_pure_dict(abstract)
    state = jax.eval_shape(make_optimizer(cfg.train, params).init, params)
    specs = optimizer_state_specs(state, params, plan.param_specs(abstract))
    return sum(math.prod(plan.named(s).shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))


def breakdown(cfg: Config, layer: Callable[[Config], LayerBytes] = layer_bytes,
              compiler: str = "cpu") -> dict[str, int]:
    """Per-device bytes of cfg's train step by part (module docstring), with `step` (what the
    compiled gradient program holds: all but the optimizer's state) and `total`, as `compiler`
    ("cpu" or "gpu": `COMPILERS`) lays the step out. `layer` measures one layer (`layer_bytes`; the
    planner passes a cached one). Needs devices only for cfg's tp."""
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: one of {', '.join(COMPILERS)}")
    xla = COMPILERS[compiler]
    cfg = abstract_config(cfg)  # the default parallel.dp=-1 is one replica
    plan = abstract_plan(cfg)
    m, t, mesh = cfg.model, cfg.train, plan.mesh.shape
    elems = param_elems(cfg, plan)
    pbytes = elems * jnp.dtype(m.param_dtype).itemsize
    shards = mesh["dp"] * mesh["fsdp"]
    rows = t.batch_size // t.microbatches // shards  # of one micro-batch, on one device
    cp = mesh["cp"]  # each device holds 1/cp of every row's positions
    one = layer(one_layer_config(cfg))
    pipe = plan.pipeline
    layers_per_stage = m.n_layers // mesh["pp"]
    if pipe is None:  # the layer scan reads each layer's weights from the stack; its casts are kept per layer
        activations = layers_per_stage * (one.activations + one.invariant)
    else:  # every iteration runs one chunk of layers_per_stage / R layers, and keeps its residuals
        chunk = layers_per_stage // pipe.repeats
        if pipe.repeats == 1:  # the chunk is the whole stage, the same every iteration: the loop's
            # backward computes its weight-only residuals once (hoisted out of the loop)
            kept = one.activations
            activations = pipe.iterations * chunk * kept + chunk * one.invariant
        else:  # the chunk's weights are a slice picked per iteration: the backward keeps each, as
            # the step holds them: gathered under FSDP where the compiler gathers the whole stack,
            # else the device's shard (XLA:GPU gathers each layer's inside the layer scan)
            kept = one.activations + one.invariant + one.weights // (1 if xla.gathers_stack else mesh["fsdp"])
            activations = pipe.iterations * chunk * kept
        if chunk > 1:  # one iteration's [Lc, ...] residuals (with R > 1 its picked weights too), copied
            activations += chunk * kept  # between the loop's [T, ...] stacks and the chunk's layer scan
    # Gradient accumulation sums the micro-batches' gradients in fp32 beside each one's own.
    accum = elems * FP32 if (t.microbatches > 1 and pipe is None) else 0
    # The head and loss run once per micro-batch under accumulation, but once on all M merged
    # micro-batches after a pipeline (model/transformer.py); train.loss_chunk: one chunk's logits (and
    # cotangent) at a time; under context parallelism, the device's 1/cp of those positions.
    loss_rows = rows * (t.microbatches if pipe is not None else 1)
    logit_elems = loss_rows * (t.loss_chunk or t.seq_len) // cp * m.vocab_size // plan.size("act_vocab")
    buffers, backward_extra = (0, 0) if pipe is None else \
        _pipeline_loop_bytes(cfg, plan, xla, chunk * one.weights, pipe.iterations, rows, logit_elems)
    parts = {
        "params": pbytes, "grads": pbytes + accum, "optimizer": optimizer_bytes(cfg, plan),
        # Under FSDP, the rest of each tp shard, of the whole stack or of one layer (see COMPILERS).
        "fsdp_gathered": pbytes * (mesh["fsdp"] - 1) // (1 if xla.gathers_stack else m.n_layers),
        "tokens": 2 * t.batch_size // shards * t.seq_len * 4,  # inputs and targets, int32 (whole rows under cp)
        "activations": activations, "pipeline_buffers": buffers, "pipeline_backward": backward_extra,
        "loss": xla.loss_buffers * logit_elems * FP32,  # the softmax fuses into the loss
        "transient": one.transient,
        "param_elems": elems,  # a count, not bytes: the optimizer's work per device
    }
    held = sum(parts[k] for k in ("params", "tokens", "activations", "pipeline_buffers"))
    backward = held + parts["grads"] + parts["fsdp_gathered"] + parts["transient"] + parts["pipeline_backward"]
    if xla.loss_beside_grads:  # the loss's working set is freed before the first layer's backward starts
        parts["step"] = backward - parts["transient"] + max(parts["loss"], parts["transient"])
    else:  # the layers' gradients are allocated after the loss's working set is freed
        parts["step"] = max(backward, held + parts["loss"])
    # After the backward: the update's working set beside the gradients (activations freed).
    update = parts["params"] + parts["grads"] + int(xla.update_temporaries * pbytes)
    parts["total"] = max(parts["step"], update) + parts["optimizer"]
    return parts


def _pipeline_loop_bytes(cfg: Config, plan: Plan, xla: CompilerMemory, chunk_weights: int, iterations: int,
                         rows: int, logit_elems: int) -> tuple[int, int]:
    """A pipeline's bytes around its loop (module docstring): what the step holds from the forward
    loop on ("pipeline_buffers") and what its backward holds on top ("pipeline_backward"). `rows`: of
    one micro-batch per device; `chunk_weights`: a chunk's layers' weights on its tp devices."""
    m, t, mesh = cfg.model, cfg.train, plan.mesh.shape
    dtype = jnp.dtype(m.dtype).itemsize
    if not xla.counts_pipeline_loop:  # XLA:CPU: a one-constant fit (bench/memory.py VALIDATION says where)
        return int(3.5 * t.microbatches * rows * t.seq_len // mesh["cp"] * m.d_model * dtype), 0
    hidden = rows * t.seq_len // mesh["cp"] * m.d_model // plan.size("act_embed")  # one micro-batch's, per device
    predicates = PIPELINE_PREDICATES * iterations * hidden  # bool, one byte each
    chunk_grads = chunk_weights // mesh["fsdp"]  # the device's FSDP shard (XLA:GPU gathers per layer)
    return 4 * t.microbatches * hidden * dtype + predicates, chunk_grads + logit_elems * dtype
