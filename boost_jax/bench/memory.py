"""`bench memory [CONFIG.yaml] [section.key=value ...]`: per-device peak memory of the train step
under each remat mode, from XLA's
compiled memory analysis of an abstract compile (nothing allocated: llama-7b works on a laptop),
beside the memory model's figure for it (`analysis/memory_model.py`: what the planner uses; at the
compute dtype, so in bf16 it is a GPU's figure and below the CPU compile's, which keeps f32 copies),
and, with `--time`, the measured step time and BOOST's efficiency metric: memory saved per
millisecond of recomputation, against remat=none (docs/design.md section 6).

`--microbatch-sweep 2,4,8` instead compiles the step at each micro-batch count M with
`train.batch_size` rows per micro-batch (so the global batch grows with M): without a pipeline,
gradient accumulation keeps one micro-batch's activations (flat); with `parallel.pp`, what the
pipeline keeps per micro-batch in flight (its iterations' saved activations and the stage buffers).

`--vary section.key=V1,V2,...` compiles the step of each value side by side (`--vary parallel.cp=1,2,4`:
what context parallelism saves), each against `--budget-gib` of memory per device (the compiled
fwd+bwd peak plus the AdamW moments); with `--time` the variants within the budget also train a few
steps here, and those over it are not started.

`--inference [--cache full|latent_v|latent]` instead compiles generation's programs (boost_jax/model/decode.py)
under the config's layout: the prefill of `train.batch_size` prompts of `train.seq_len` tokens into
a cache of as many positions, and a call of the decode loop against that cache. Per device it prints
the weights (at the compute dtype, as served) and the cache, beside each program's compiled memory
analysis (arguments, outputs, temporaries, peak): what serving a model of that size needs; and the
server's paged pool of that cache kind (`serve.*` of the config, `train.seq_len` positions per
request), sized by the function the server sizes it with (serving/programs.py pool_size).

`--validate` compiles the memory model's validation grid (`VALIDATION`) and prints the model beside
each compile; it exits with status 1 if any is off by `TOLERANCE` or more. `--validate --gpu-compile NAME`
does the same for XLA:GPU on its own grid (`GPU_VALIDATION`): each train step compiled for 4 GPUs of
NAME without a GPU (launch/gpu_target.py) beside the model as it lays the step out for XLA:GPU.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import jax
from flax import nnx

from boost_jax.analysis.memory_model import breakdown
from boost_jax.analysis.program import build, config_for, optimizer_state, peak_bytes
from boost_jax.bench.common import add_vary, config_of, parse, parser, variants
from boost_jax.bench.step import measure as measure_steps
from boost_jax.config import Config, ConfigError, from_args
from boost_jax.config.hardware import one_machine
from boost_jax.layers.kv_cache import CACHES
from boost_jax.model.decode import Decoder
from boost_jax.model.weights import abstract_model
from boost_jax.parallel import make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.runtime.units import GIB, MIB
from boost_jax.serving.programs import pool_size
from boost_jax.training.optimizers import make_optimizer
from boost_jax.training.step import accumulated_grad

MODES = ("none", "full", "lowrank")
TOLERANCE = 0.10  # the memory model against the compiled peak, relative


@dataclass(frozen=True)
class Case:
    """One program of the validation grid: fp32 (the CPU compile is faithful there: no bf16 upcasts)."""

    arch: str
    scheme: str
    remat: str
    tp: int = 1
    pp: int = 1
    pp_repeats: int = 1
    fsdp: int = 1
    cp: int = 1
    microbatches: int = 1
    batch: int = 4
    seq: int = 64
    model: str = "llama-tiny"
    overrides: tuple[str, ...] = ()
    tested: bool = False  # also compiled by tests/test_memory_model.py: one case per term of the model

    @property
    def label(self) -> str:
        layout = f"tp{self.tp} pp{self.pp}x{self.pp_repeats} fsdp{self.fsdp} cp{self.cp} M{self.microbatches} b{self.batch}"
        return " ".join((self.model, f"{self.arch}/{self.scheme}", self.remat, layout, *self.overrides))

    def config(self):
        return config_for(self.model, self.arch, self.scheme, tp=self.tp, pp=self.pp, pp_repeats=self.pp_repeats,
                          microbatches=self.microbatches, batch_size=self.batch, seq=self.seq, dtype="float32",
                          overrides=[f"parallel.fsdp={self.fsdp}", f"parallel.cp={self.cp}", f"train.remat={self.remat}",
                                     *self.overrides])


# The pipeline term's one constant was fitted on 36 pp=2 programs (btp and vanilla, 2 and 4 layers,
# R = 1, 2, M = 2..8, every remat mode: all within 8.3%) as 5 x M, and refitted as 3.5 x M on the 8
# pipelined rows below (all within 6.8%) once the edges' vocabulary split over pp (docs/design.md
# section 9) shrank the head's share of the compiled peak. The tested rows cover each term: the layer scan, vanilla, dense, FSDP's gathered weights,
# accumulation, LaX's latents, a loss-dominated vocabulary, pipelines with R = 1, R = 2 and Lc > 1,
# decoupled RoPE's rotary keys.
VALIDATION = (
    Case("cola", "btp", "lowrank", tp=2, tested=True),
    Case("cola", "btp", "full", tp=2, pp=2, microbatches=2, tested=True),
    Case("cola", "vanilla", "full", tp=2),
    Case("dense", "megatron", "none", tp=2, tested=True),
    Case("cola", "btp", "none", tp=1),
    Case("cola", "btp", "none", tp=4),
    Case("cola", "btp", "lowrank", tp=2, fsdp=2),
    Case("cola", "vanilla", "none", tp=2, fsdp=2, tested=True),
    Case("cola", "vanilla", "lowrank", tp=4),
    Case("dense", "megatron", "full", tp=4),
    Case("cola", "btp", "none", tp=2, pp=2, microbatches=2),
    Case("cola", "btp", "lowrank", tp=1, microbatches=2, tested=True),
    Case("lax", "btp", "lowrank", tp=2, tested=True),
    Case("cola", "btp", "none", tp=1, overrides=("model.vocab_size=4096",), tested=True),
    Case("cola", "btp", "lowrank", tp=2, pp=4, microbatches=4, batch=8, overrides=("model.n_layers=8",), tested=True),
    Case("cola", "vanilla", "full", tp=2, pp=4, pp_repeats=2, microbatches=4, batch=8, overrides=("model.n_layers=8",),
         tested=True),
    Case("cola", "btp", "lowrank", tp=1, pp=4, microbatches=4, batch=8, overrides=("model.n_layers=4",)),
    Case("cola", "btp", "lowrank", tp=2, pp=2, microbatches=8, batch=16, overrides=("model.n_layers=8",)),
    Case("cola", "vanilla", "lowrank", tp=2, pp=2, microbatches=4),
    *(Case("cola", "btp", remat, tp=2, batch=2, seq=128, model="llama-60m", overrides=("model.n_layers=2",))
      for remat in MODES),
    # Context parallelism: each attention variant, with tp, with a pipeline, at a longer sequence.
    Case("cola", "btp", "lowrank", tp=2, cp=2, seq=128, tested=True),
    Case("cola", "btp", "none", cp=4, seq=256, overrides=("parallel.cp_attention=ring",)),
    Case("cola", "btp", "full", tp=2, cp=2, seq=128, overrides=("parallel.cp_attention=latent",)),
    Case("dense", "megatron", "none", tp=2, cp=2, seq=128),
    Case("cola", "btp", "lowrank", tp=2, pp=2, cp=2, microbatches=2, seq=128),
    # decoupled RoPE split by latent heads: the rotary keys' projection and activations (model.attn_rope_dims)
    Case("cola", "btp", "lowrank", tp=2, overrides=("model.attn_latent_heads=2", "model.attn_rope_dims=4"), tested=True),
)


@dataclass(frozen=True)
class GpuCase:
    """One train step of the XLA:GPU grid: llama-60m in bf16 on 4 GPUs (GPU_BASE), under `overrides`."""

    label: str
    overrides: tuple[str, ...]
    tested: bool = False  # also compiled by tests/test_gpu_compile.py


GPU_BASE = ("model.preset=llama-60m", "model.arch=cola", "model.dtype=bfloat16", "train.batch_size=8",
            "train.seq_len=512", "train.eval_every=0", "parallel.dp=-1")
GPU_DEVICES = 4
_PIPELINE_FSDP = ("parallel.fsdp=2", "parallel.dp=1", "parallel.pp=2", "train.microbatches=4", "train.remat=lowrank")
# Where XLA:GPU lays the step out unlike XLA:CPU (analysis/memory_model.py COMPILERS), one case per term:
# FSDP (a whole-stack gather would add 3x the weights), full remat (the update's working set sets the
# peak), and pipelines under FSDP with low-rank remat: circular (each iteration keeps its chunk's FSDP
# shards, not the gathered weights: about 1.2x if counted gathered), and two where the loop's stacked
# `where` predicates, the chunk's gradients and the logits' cotangent held past the loop weigh most
# (0.85x and 0.82x without them). Measured on a100-80gb.
GPU_VALIDATION = (
    GpuCase("fsdp4", ("parallel.fsdp=4", "parallel.dp=1"), tested=True),
    GpuCase("dp4 remat=full", ("parallel.fsdp=1", "train.remat=full")),
    GpuCase("pp2x2 fsdp2 M4 lowrank", (*_PIPELINE_FSDP, "parallel.pp_repeats=2"), tested=True),
    GpuCase("pp2x2 fsdp2 M4 lowrank vocab 512 seq 1024",
            (*_PIPELINE_FSDP, "parallel.pp_repeats=2", "model.vocab_size=512", "train.seq_len=1024")),
    GpuCase("pp2 fsdp2 M4 lowrank llama-350m seq 1024", (*_PIPELINE_FSDP, "model.preset=llama-350m", "train.seq_len=1024")),
)


def validate_gpu(case: GpuCase, hw) -> dict:
    """The memory model for XLA:GPU beside the peak of the train step XLA:GPU compiles for `hw`."""
    from boost_jax.analysis.compiled import compile_all  # lazy: the GPU compiler's modules
    from boost_jax.launch.gpu_target import gpu_devices  # lazy: the GPU compiler's modules

    cfg = from_args([*GPU_BASE, *case.overrides])  # the devices are the GPU topology's, not simulated CPUs
    _, (step,), _ = compile_all(cfg, gpu_devices(hw, 1, GPU_DEVICES), only=("train_step",))
    model, compiled = step["model_memory"], step["memory"]["peak"]
    return {**asdict(case), "hardware": hw.name, "memory_model_bytes": model, "peak_bytes": compiled,
            "error": model / compiled - 1}


def validate(case: Case) -> dict:
    """The memory model's figure for one case beside its compiled peak."""
    cfg = case.config()
    model, compiled = breakdown(cfg)["step"], compiled_peak(cfg)["fwd_bwd_peak_bytes"]
    return {**asdict(case), "memory_model_bytes": model, "fwd_bwd_peak_bytes": compiled, "error": model / compiled - 1}


def validate_all(cases, as_json: bool, hw=None) -> None:
    """Each case validated (on XLA:GPU for `hw` where given, else on this CPU); exit 1 if one is off."""
    rows = []
    for case in cases:
        rows.append(validate(case) if hw is None else validate_gpu(case, hw))
        if not as_json:
            r = rows[-1]
            peak = r["fwd_bwd_peak_bytes" if hw is None else "peak_bytes"]
            print(f"{case.label:72s} compiled {peak / MIB:7.2f} MiB, model "
                  f"{r['memory_model_bytes'] / MIB:7.2f} MiB: {100 * r['error']:+5.1f}%", flush=True)
    off = [r for r in rows if abs(r["error"]) >= TOLERANCE]
    if as_json:
        print(json.dumps({"tolerance": TOLERANCE, "rows": rows}, indent=1))
    else:
        print(f"{len(rows) - len(off)} of {len(rows)} within {100 * TOLERANCE:.0f}% of the compiled peak")
    if off:
        sys.exit(1)


def compiled_peak(cfg) -> dict:
    """Peak of the train step's gradient as the step computes it: accumulated over micro-batches,
    or through the pipeline when there is one."""
    prog = build(cfg)
    grad = accumulated_grad(prog.loss, prog.plan, cfg.train.microbatches,
                            jax.tree.map(lambda p: p.sharding, prog.params))
    compiled = jax.jit(grad).lower(prog.params, prog.batch).compile()
    return {"fwd_bwd_peak_bytes": peak_bytes(compiled), "optimizer_state_bytes": compiled_optimizer_bytes(prog)}


def compiled_optimizer_bytes(prog) -> int:
    """Per-device bytes of train.optimizer's state: the output of its init compiled as the train step
    lays it out (each moment sharded like its parameter, the rest replicated)."""
    tx = make_optimizer(prog.cfg.train, prog.params)
    init = jax.jit(tx.init, out_shardings=jax.tree.map(lambda s: s.sharding, optimizer_state(prog, tx)))
    return init.lower(prog.params).compile().memory_analysis().output_size_in_bytes


def sweep_microbatches(args: Sequence[str], counts: list[int], as_json: bool) -> None:
    base = config_of(args)
    rows_per, rows = base.train.batch_size, []
    for m in counts:
        cfg = config_of(args, f"train.microbatches={m}", f"train.batch_size={rows_per * m}")
        pipe = build(cfg).plan.pipeline
        rows.append({"microbatches": m, "global_batch": cfg.train.batch_size,
                     "iterations": pipe.iterations if pipe else None,
                     "bubble_fraction": pipe.bubble_fraction if pipe else None, **compiled_peak(cfg)})
    if as_json:
        print(json.dumps({**describe(base), "rows_per_microbatch": rows_per, "rows": rows}, indent=1))
        return
    print(f"{title(base)}, {rows_per} rows per micro-batch: per-device peak of the train step's forward + backward "
          "(compiled memory analysis)")
    print(f"{'M':>4s} {'batch':>6s} {'iterations':>10s} {'bubble':>7s} {'peak MiB':>10s} {'+MiB per M':>11s}")
    for prev, r in zip([None, *rows], rows):
        grow = "-" if prev is None else format((r["fwd_bwd_peak_bytes"] - prev["fwd_bwd_peak_bytes"]) / MIB
                                               / (r["microbatches"] - prev["microbatches"]), ".2f")
        bubble = "-" if r["bubble_fraction"] is None else f"{100 * r['bubble_fraction']:.0f}%"
        print(f"{r['microbatches']:4d} {r['global_batch']:6d} {str(r['iterations'] or '-'):>10s} {bubble:>7s} "
              f"{r['fwd_bwd_peak_bytes'] / MIB:10.2f} {grow:>11s}")


def sweep_variants(args: Sequence[str], vary: Sequence[str], budget_gib: float, timed: bool, reps: int, steps: int,
                   as_json: bool) -> None:
    """Each `--vary` variant's compiled peak (and the memory model's total) against the budget; with
    `timed`, the ones within it train `reps` x `steps` steps here."""
    rows = []
    for label, cfg in variants(args, vary):
        peak = compiled_peak(cfg)
        total = peak["fwd_bwd_peak_bytes"] + peak["optimizer_state_bytes"]
        rows.append({"variant": label, "config": cfg, **peak, "total_bytes": total,
                     "memory_model_total_bytes": breakdown(cfg)["total"],
                     "fits": not budget_gib or total <= budget_gib * GIB})
    if timed:
        fitting = [r for r in rows if r["fits"]]
        for r, result in zip(fitting, measure_steps([r["config"] for r in fitting], reps, steps)):
            r.update(step_s=result["median_step_s"], last_loss=result["last_loss"])
    for r in rows:
        del r["config"]
    if as_json:
        print(json.dumps({"budget_gib": budget_gib or None, "rows": rows}, indent=1))
        return
    budget = f" against {budget_gib:g} GiB per device" if budget_gib else ""
    print(f"per-device memory of the train step (compiled memory analysis){budget}")
    print(f"{'variant':32s} {'fwd+bwd MiB':>12s} {'total MiB':>11s} {'model MiB':>10s} {'fits':>5s} {'step ms':>9s} "
          f"{'loss':>7s}")
    for r in rows:
        step = f"{1e3 * r['step_s']:9.1f}" if "step_s" in r else f"{'-':>9s}"
        loss = f"{r['last_loss']:7.3f}" if "last_loss" in r else f"{'-':>7s}"
        print(f"{r['variant'] or '(config)':32s} {r['fwd_bwd_peak_bytes'] / MIB:12.1f} {r['total_bytes'] / MIB:11.1f} "
              f"{r['memory_model_total_bytes'] / MIB:10.1f} {'yes' if r['fits'] else 'NO':>5s} {step} {loss}")


def describe(cfg: Config) -> dict:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    return {"model": m.preset, "arch": m.arch, "scheme": p.scheme, "tp": p.tp, "pp": p.pp, "pp_repeats": p.pp_repeats,
            "batch": t.batch_size, "seq": t.seq_len, "dtype": m.dtype}


def title(cfg: Config) -> str:
    d = describe(cfg)
    return (f"{d['model']} {d['arch']} tp={d['tp']} pp={d['pp']}" + (f"x{d['pp_repeats']}" if d["pp_repeats"] > 1 else "")
            + f" b={d['batch']} s={d['seq']} {d['dtype']}")


def inference(cfg: Config, cache: str) -> dict:
    """Per-device bytes of the weights and cache of a generation at cfg's batch and context, and of
    its prefill and decode programs (compiled on abstract inputs: nothing allocated)."""
    graphdef, abstract = abstract_model(cfg)
    decoder = Decoder(nnx.merge(graphdef, abstract), make_plan(cfg, mesh_devices(cfg.parallel)), cache=cache)
    t = cfg.train
    out = decoder.compiled(t.batch_size, t.seq_len, t.seq_len)
    per_device = lambda tree: sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                                  for a in jax.tree.leaves(tree))
    programs = {}
    for name in ("prefill", "decode"):
        m = out[name].memory_analysis()
        programs[name] = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
                          "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
                          "peak_bytes": peak_bytes(out[name])}
    s = cfg.serve
    pool = pool_size(s, decoder.cache_name, cfg.model, decoder.plan, t.seq_len)
    return {**describe(cfg), "cache": cache, "weights_bytes": per_device(decoder.params),
            "cache_bytes": per_device(out["cache"]), "programs": programs,
            "serve_pool": {"slots": s.slots, "page_tokens": s.page_tokens, "cache_gib": s.cache_gib, "pages": pool.pages,
                           "page_bytes": pool.page_bytes, "bytes": pool.bytes}}


def print_inference(r: dict, cfg: Config) -> None:
    print(f"{title(cfg)}, cache {r['cache']}: per-device memory of generation (compiled memory analysis)")
    print(f"weights {r['weights_bytes'] / MIB:.1f} MiB + cache {r['cache_bytes'] / MIB:.1f} MiB "
          f"(batch {r['batch']} x {r['seq']} positions) = {(r['weights_bytes'] + r['cache_bytes']) / MIB:.1f} MiB")
    print(f"{'program':8s} {'arguments MiB':>14s} {'outputs MiB':>12s} {'temp MiB':>9s} {'peak MiB':>9s}")
    for name, p in r["programs"].items():
        print(f"{name:8s} {p['argument_bytes'] / MIB:14.1f} {p['output_bytes'] / MIB:12.1f} {p['temp_bytes'] / MIB:9.1f} "
              f"{p['peak_bytes'] / MIB:9.1f}")
    s = r["serve_pool"]
    print(f"serving pool (serve.slots={s['slots']} serve.page_tokens={s['page_tokens']} serve.cache_gib={s['cache_gib']:g}): "
          f"{s['pages']} pages (the null page included) x {s['page_bytes'] / MIB:.3f} MiB per page per device = "
          f"{s['bytes'] / MIB:.1f} MiB per device")


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench memory", __doc__)
    p.add_argument("--remat", default="all", choices=["all", *MODES], help="train.remat modes compiled (none always)")
    p.add_argument("--compare", action="store_true", help="vanilla and btp side by side")
    p.add_argument("--time", action="store_true", help="also run the steps here (small models only)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatch-sweep", default="", metavar="M1,M2,...",
                   help="peak at each micro-batch count, train.batch_size rows per micro-batch (with parallel.pp: the pipeline)")
    p.add_argument("--validate", action="store_true",
                   help="the memory model against the compile on its validation grid (the config is not used)")
    p.add_argument("--gpu-compile", metavar="NAME", default=None,
                   help="with --validate: XLA:GPU's grid, compiled for 4 GPUs of NAME of the hardware file")
    p.add_argument("--inference", action="store_true", help="generation's prefill and decode programs instead")
    p.add_argument("--cache", default="full", choices=list(CACHES), help="with --inference: the decoder's cache")
    add_vary(p)
    p.add_argument("--budget-gib", type=float, default=0.0, help="with --vary: the memory each device has (0: no limit)")
    a = parse(p, argv)
    if a.reps < 1 or a.steps < 1 or a.budget_gib < 0:
        raise ConfigError(f"--reps and --steps must be at least 1 and --budget-gib >= 0, got {a.reps}, {a.steps}, "
                          f"{a.budget_gib}")
    if a.cache != "full" and not a.inference:
        raise ConfigError("--cache is the decoder's: it applies with --inference")
    if a.budget_gib and not a.vary:
        raise ConfigError("--budget-gib sizes the --vary variants: give --vary section.key=V1,V2,...")
    if a.gpu_compile and not a.validate:
        raise ConfigError("--gpu-compile NAME applies to --validate: give both")
    if a.validate:
        if a.gpu_compile:
            return validate_all(GPU_VALIDATION, a.json, one_machine(None, a.gpu_compile))
        return validate_all(VALIDATION, a.json)
    if a.inference:
        cfg = config_of(a.config, decoding=True)
        r = inference(cfg, a.cache)
        return print(json.dumps(r, indent=1)) if a.json else print_inference(r, cfg)
    if a.vary:
        return sweep_variants(a.config, a.vary, a.budget_gib, a.time, a.reps, a.steps, a.json)
    if a.microbatch_sweep:
        try:
            counts = [int(m) for m in a.microbatch_sweep.split(",")]
        except ValueError:
            raise ConfigError(f"--microbatch-sweep {a.microbatch_sweep!r}: expected comma-separated counts") from None
        if bad := [m for m in counts if m < 1]:
            raise ConfigError(f"--microbatch-sweep: each count must be at least 1, got {bad[0]}")
        return sweep_microbatches(a.config, counts, a.json)
    # remat=none is always measured: it is the baseline of the saved-memory metric.
    modes = MODES if a.remat == "all" else tuple(dict.fromkeys(("none", a.remat)))
    cfg = config_of(a.config)
    schemes = ("vanilla", "btp") if a.compare else (cfg.parallel.scheme,)
    rows = []
    for scheme in schemes:
        cfgs = [config_of(a.config, f"parallel.scheme={scheme}", f"train.remat={m}") for m in modes]
        times = [r["median_step_s"] for r in measure_steps(cfgs, a.reps, a.steps)] if a.time else [None] * len(cfgs)
        for mode, variant, t in zip(modes, cfgs, times):
            rows.append({"scheme": variant.parallel.scheme, "remat": mode, **compiled_peak(variant),
                         "memory_model_bytes": breakdown(variant)["step"], "step_s": t})
    for row in rows:  # BOOST's metric, against the same scheme without remat
        base = next(r for r in rows if r["scheme"] == row["scheme"] and r["remat"] == "none")
        saved = (base["fwd_bwd_peak_bytes"] - row["fwd_bwd_peak_bytes"]) / MIB
        row["saved_mib"] = saved
        added_ms = None if row["step_s"] is None else 1e3 * (row["step_s"] - base["step_s"])
        row["added_ms"] = added_ms
        row["mib_saved_per_ms"] = saved / added_ms if added_ms and added_ms > 0 and row["remat"] != "none" else None
    if a.json:
        print(json.dumps({**describe(cfg), "rows": rows}, indent=1))
        return
    print(f"{title(cfg)}: per-device memory (compiled memory analysis)")
    print(f"{'scheme':8s} {'remat':8s} {'fwd+bwd peak MiB':>17s} {'model MiB':>10s} {'+AdamW MiB':>11s} {'saved MiB':>10s} "
          f"{'step ms':>9s} {'MiB saved/ms':>13s}")
    for r in rows:
        fmt = lambda v, f: "-" if v is None else format(v, f)
        print(f"{r['scheme']:8s} {r['remat']:8s} {r['fwd_bwd_peak_bytes'] / MIB:17.1f} {r['memory_model_bytes'] / MIB:10.1f} "
              f"{r['optimizer_state_bytes'] / MIB:11.1f} "
              f"{r['saved_mib']:10.1f} {fmt(r['step_s'] and 1e3 * r['step_s'], '9.1f'):>9s} {fmt(r['mib_saved_per_ms'], '13.1f'):>13s}")
