"""Collectives per decoder layer, forward and backward, measured on the compiled HLO of a `Program`
next to its scheme's analytic volume (`boost_jax/config/schemes.py`; docs/design.md derives it).

Per layer = the collectives inside the scanned layer body (each runs once per layer). One compile of
the loss's value and gradient holds both passes: forward are its collectives that JAX did not name as
the backward pass's (`Collective.backward`), backward the rest. Per layer these are exactly the
collectives of the loss compiled on its own (tests/test_comm.py checks it); outside the layers XLA
may merge a forward collective into a backward one (the loss's scalar all-reduce over dp into a
gradient's), which the edges then count as backward.
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np

from boost_jax.analysis.hlo import Collective, audit, canonical_groups, collectives, nbytes, summarize
from boost_jax.analysis.issued import issued
from boost_jax.analysis.perf_model import collective_seconds
from boost_jax.analysis.program import Program, optimizer_state
from boost_jax.config import ModelConfig
from boost_jax.config.archs import ARCHS
from boost_jax.config.hardware import Hardware, ring_bytes
from boost_jax.config.schemes import CP
from boost_jax.parallel import Plan
from boost_jax.parallel.context import layer_forward_bytes as cp_layer_forward_bytes
from boost_jax.runtime.units import MIB
from boost_jax.training.muon_layout import chosen_ways, placements, way_seconds
from boost_jax.training.optimizers import latent_head_blocks, make_optimizer

P2P = "collective-permute"


def in_layers(cols: list[Collective], pipelined: bool = False) -> list[Collective]:
    """The collectives of the layer scan: those inside loops, less a pipeline's stage-to-stage permutes
    (a program without a pipeline permutes only inside its layers: context parallelism's ring)."""
    return [c for c in cols if c.loop_depth and not (pipelined and c.kind == P2P)]


def over_axis(c: Collective, mesh_shape: dict, axis: str) -> bool:
    """Whether a collective's groups (or a permute's pairs) run along one mesh axis: the devices that
    differ in that axis' coordinate alone (the program's partition ids are the mesh's positions)."""
    names = list(mesh_shape)
    ids = np.arange(int(np.prod(list(mesh_shape.values())))).reshape(list(mesh_shape.values()))
    rows = np.moveaxis(ids, names.index(axis), -1).reshape(-1, mesh_shape[axis])
    group_of = {int(d): i for i, row in enumerate(rows) for d in row}
    groups = [[int(d) for d in g.split(",") if d] for g in canonical_groups(c.replica_groups).strip("{}").split("},{")]
    if c.kind == "collective-permute":  # pairs: each within one group of the axis
        return all(group_of[a] == group_of[b] for a, b in groups)
    return sorted(map(sorted, groups)) == sorted(map(sorted, rows.tolist()))


def forward(cols: list[Collective]) -> list[Collective]:
    """The forward pass's collectives among a gradient program's."""
    return [c for c in cols if not c.backward]


def layer_split(both: list[Collective], pipelined: bool = False) -> tuple[dict, dict]:
    """Per-layer (forward, backward) summaries of a gradient program's collectives."""
    return (summarize(in_layers(forward(both), pipelined), in_loop=True),
            summarize(in_layers([c for c in both if c.backward], pipelined), in_loop=True))


def measure(prog: Program, hw: Hardware | None = None) -> dict:
    """The program's collectives per layer (module docstring); with `hw`, also the seconds the layers'
    collectives take per step on it (`layers_collective_s`, the performance model's pricing)."""
    program_issues = issued(prog.loss, prog.params, prog.batch)
    both = audit(jax.value_and_grad(prog.loss), prog.params, prog.batch)  # as the train step computes it
    fwd, bwd = forward(both), [c for c in both if c.backward]
    m, cfg, pipe, shape = prog.cfg.model, prog.cfg, prog.plan.pipeline, dict(prog.plan.mesh.shape)
    # The layers' collectives; those along cp alone are context parallelism's, reported apart.
    on_cp = lambda c: shape[CP] > 1 and over_axis(c, shape, CP)
    layers = lambda cols: [c for c in in_layers(cols, pipe is not None) if not on_cp(c)]
    layer_fwd, layer_bwd = summarize(layers(fwd), in_loop=True), summarize(layers(bwd), in_loop=True)
    tokens, itemsize, analytic, _ = layer_analytic(cfg, prog.plan)
    kinds = layer_analytic_by_kind(cfg, prog.plan)
    analytic_bwd = kinds["backward"] and kinds["backward"]["all-reduce"]
    parts = lambda cols, kind: sorted(nbytes(dt, dims) * (c.group_size if kind == "reduce-scatter" else 1)
                                      for c in layers(cols) if c.kind == kind for dt, dims in c.parts)
    upcast = lambda cols: sum(c.bytes_as_compiled - c.bytes for c in layers(cols) if c.upcast_from)
    # What a ring sends per device, per layer: an all-reduce twice a reduce-scatter's or all-gather's.
    ring = lambda cols: sum(ring_bytes(c.kind, c.group_size, c.bytes) for c in layers(cols) if c.loop_depth > 0)
    tp = prog.plan.mesh.shape["tp"]
    fwd_ops = [_describe(c) for c in layers(fwd)]
    layer_issued = {k: v for k, v in program_issues["layer"].items() if k != P2P}
    return {
        "model": m.preset, "arch": m.arch, "scheme": cfg.parallel.scheme, "tp": prog.plan.mesh.shape["tp"],
        "dp": prog.plan.mesh.shape["dp"], "batch": cfg.train.batch_size, "seq": cfg.train.seq_len,
        "dtype": m.dtype, "layers": m.n_layers, "norm": m.norm, "grouping": m.grouping, "kernels": m.kernels,
        "layer_forward_bytes": layer_fwd["bytes"], "layer_backward_bytes": layer_bwd["bytes"],
        "layer_forward_collectives": layer_fwd["count"], "layer_backward_collectives": layer_bwd["count"],
        # Explicit (shard_map) collectives per layer as the program issues them, before XLA combines any.
        "layer_forward_issued": layer_issued,
        "analytic_layer_forward_bytes": analytic,
        "forward_over_analytic": layer_fwd["bytes"] / analytic,
        # The backward's all-reduces per layer, one entry per partial sum (combined or not by XLA).
        "analytic_layer_backward_all_reduces": analytic_bwd,
        "analytic_layer_backward_bytes": None if analytic_bwd is None else sum(analytic_bwd)
        + sum(kinds["backward"]["all-gather"]),
        "layer_backward_all_reduce_parts": parts(bwd, "all-reduce"),
        # Latent heads: the k/v latents reduce-scattered forward (bytes at the input) and their gradients
        # all-gathered backward (at the output), each part beside the scheme's (latents only).
        "analytic_layer_forward_by_kind": kinds["forward"],
        "analytic_layer_backward_all_gathers": kinds["backward"] and kinds["backward"]["all-gather"],
        "layer_forward_reduce_scatter_parts": parts(fwd, "reduce-scatter"),
        "layer_backward_all_gather_parts": parts(bwd, "all-gather"),
        "by_kind": {"forward": layer_fwd["by_kind"], "backward": layer_bwd["by_kind"]},
        "layer_forward_ring_bytes": ring(fwd), "layer_backward_ring_bytes": ring(bwd),
        # the scheme's forward collectives over tp, priced the same way
        "analytic_layer_forward_ring_bytes": sum(ring_bytes(k, tp, b) for k, b in kinds["forward"].items()),
        "edges": {"forward": summarize(fwd, in_loop=False), "train_step": summarize(both, in_loop=False)},
        "backend_upcast_extra_bytes": {"forward": upcast(fwd), "forward_and_backward": upcast(both)},
        "layer_forward_ops": fwd_ops,
        "layer_backward_ops": [_describe(c) for c in layers(bwd)],
        **({"layers_collective_s": sum(collective_seconds(c, hw) * c.trip_count for c in layers(both))} if hw else {}),
        **({"pipeline": pipeline_comm(prog, fwd, tokens, itemsize)} if pipe else {}),
        **({"context": context_comm(prog, *([c for c in in_layers(cols, pipe is not None) if on_cp(c)]
                                            for cols in (fwd, bwd)))} if shape[CP] > 1 else {}),
    }


def layer_analytic(cfg, plan: Plan) -> tuple[int, int, int, list[int] | None]:
    """(tokens one layer sees per run, per device: its rows' share of the sequence (cp), one micro-batch
    under a pipeline; the compute dtype's bytes; the scheme's forward bytes per layer; its backward's
    collectives per layer (all-reduces, and the all-gathers of latent heads), bytes each, sorted, or
    None where XLA alone decides them)."""
    tokens, itemsize = _layer_tokens(cfg, plan)
    backward = layer_analytic_by_kind(cfg, plan)["backward"]
    return (tokens, itemsize, plan.scheme.layer_forward_elements(cfg.model, tokens) * itemsize,
            None if backward is None else sorted(backward["all-reduce"] + backward["all-gather"]))


def layer_analytic_by_kind(cfg, plan: Plan) -> dict:
    """The scheme's collectives per decoder layer by kind, bytes per device: {"forward": {kind: bytes}
    (the latents only), "backward": {kind: [bytes of each part], sorted} or None where XLA alone
    decides them}. Latents split over tp (latent heads) are reduce-scattered forward and their
    gradients all-gathered backward; the rest all-reduced."""
    m, tp = cfg.model, plan.mesh.shape["tp"]
    tokens, itemsize = _layer_tokens(cfg, plan)
    scattered = [n * itemsize for n in plan.scheme.layer_scattered(m, tokens, tp)]
    reduced = plan.scheme.layer_forward_elements(m, tokens) * itemsize - sum(scattered)
    forward = {"all-reduce": reduced, **({"reduce-scatter": sum(scattered)} if scattered else {})}
    backward = plan.scheme.layer_backward_all_reduces(m, tokens, tp)
    if backward is None:
        return {"forward": forward, "backward": None}
    return {"forward": forward, "backward": {"all-reduce": sorted(n * itemsize for n in backward),
                                             "all-gather": sorted(scattered)}}


def _layer_tokens(cfg, plan: Plan) -> tuple[int, int]:
    """Tokens one layer sees per run, per device (its rows' share of the sequence under cp, one
    micro-batch under a pipeline), and the compute dtype's bytes."""
    pipe = plan.pipeline
    tokens = (cfg.train.batch_size // plan.size("batch") * cfg.train.seq_len // plan.size("seq")
              // (pipe.microbatches if pipe else 1))
    return tokens, 2 if cfg.model.dtype == "bfloat16" else 4


def context_comm(prog: Program, fwd: list[Collective], bwd: list[Collective]) -> dict:
    """A decoder layer's collectives along cp (parallel/context.py), forward and backward, beside the
    forward bytes `cp_attention` implies. The backward's also sum the weights' gradients over cp, as
    data parallelism's do."""
    plan, cfg = prog.plan, prog.cfg
    rows = cfg.train.batch_size // plan.size("batch") // (plan.pipeline.microbatches if plan.pipeline else 1)
    return {"cp": plan.mesh.shape[CP], "attention": plan.cp_attention,
            "forward": summarize(fwd, in_loop=True), "backward": summarize(bwd, in_loop=True),
            "analytic_forward_bytes": cp_layer_forward_bytes(plan, cfg.model, rows, cfg.train.seq_len),
            "forward_ops": [_describe(c) for c in fwd], "backward_ops": [_describe(c) for c in bwd]}


def pipeline_carry_width(plan: Plan, m: ModelConfig) -> int:
    """Elements per token a pipeline stage sends the next: the residual as the plan splits it, plus
    any latents the arch carries (LaX)."""
    carry = m.d_model // plan.size("act_embed")
    if ARCHS[m.arch].carries_latents:  # k's and v's as the plan lays them (split by latent heads under btp)
        carry += (2 * m.attn_rank + 3 * m.mlp_rank) // plan.size("act_latent") + 2 * m.attn_rank // plan.size("act_kv_latent")
    return carry


def pipeline_comm(prog: Program, fwd: list[Collective], tokens: int, itemsize: int) -> dict:
    """The schedule, and the stage-to-stage traffic of one iteration per device: measured (the
    permutes inside the iteration loop) next to the carry's size (residual as the plan splits it,
    plus any latents LaX carries)."""
    plan, m, pipe = prog.plan, prog.cfg.model, prog.plan.pipeline
    carry = pipeline_carry_width(plan, m)
    return {
        "stages": pipe.stages, "microbatches": pipe.microbatches, "repeats": pipe.repeats,
        "iterations": pipe.iterations, "bubble_fraction": pipe.bubble_fraction,
        "p2p_bytes_per_iteration": sum(c.bytes for c in fwd if c.kind == P2P and c.loop_depth),
        "analytic_p2p_bytes_per_iteration": tokens * carry * itemsize,
        "p2p_ops_per_iteration": [_describe(c) for c in fwd if c.kind == P2P and c.loop_depth],
    }


def _describe(c: Collective) -> str:
    parts = " + ".join(f"{d}{list(s)}" for d, s in c.parts)
    return f"{c.kind} {parts} over {c.group_size} ({c.bytes / MIB:.2f} MiB)"



def optimizer_comm(prog: Program, hw: Hardware) -> dict | None:
    """The optimizer update's collectives (muon, spectron; None for adamw), compiled on the program's
    abstract parameters as the train step lays out its state, next to what the chosen ways' formulas
    say (training/muon_layout.py) and their seconds per step on `hw`, with every way's. The
    global-norm clip's scalar all-reduce and the Frobenius norms' [L] ones (pre-scaling matrices left
    in place), which every layout has, are counted apart."""
    cfg = prog.cfg
    if cfg.train.optimizer == "adamw":
        return None
    chosen = chosen_ways(cfg, prog.plan, hw.gpus_per_node)
    tx = make_optimizer(cfg.train, prog.params, placements(cfg, prog.plan), split=prog.plan.mesh.size > 1,
                        blocks=latent_head_blocks(cfg.model))
    found = collectives(jax.jit(tx.update).lower(prog.params, optimizer_state(prog, tx), prog.params).compile().as_text())
    small = lambda c: c.kind == "all-reduce" and len(c.shape) <= 1
    formula = Counter()
    for w in chosen.values():
        for kind, size, n in w.collectives:
            formula[f"{kind} {size} B"] += n
    return {
        "ways": dict(Counter(w.name for w in chosen.values())),
        "measured": dict(Counter(f"{c.kind} {c.bytes} B" for c in found if not small(c))),
        "formula": dict(formula),
        "norms_and_clip": len([c for c in found if small(c)]),
        "bytes": sum(c.bytes for c in found if not small(c)),
        "formula_bytes": sum(w.bytes for w in chosen.values()),
        "hardware": hw.name,
        "seconds": sum(w.seconds(hw) for w in chosen.values()),
        "seconds_by_way": way_seconds(cfg, prog.plan, hw),
    }
