"""Every program a run executes, compiled for its plan's devices, and what each compile says.

    for name, compile_ in run_programs(cfg, plan).items():   # in order: the decode loop needs the prefill's
        compiled, seconds = compile_timed(compile_)
        report = read(name, compiled, seconds, cfg, plan)   # memory, collectives, custom calls

The programs come from the builders the commands use (training/step.py `build` for the train and
eval steps; model/decode.py's Decoder for the prefill and the decode loop; serving/programs.py for the
server's paged decode), fed abstract shapes: a
plan on a GPU topology (launch/gpu_target.py) gets them compiled by XLA:GPU without a GPU
(`python -m boost_jax.compile`); a plan on CPU devices gets the CPU's.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable

import jax
from flax import nnx

from boost_jax.analysis.comm import in_layers, layer_analytic, over_axis
from boost_jax.analysis.hlo import collectives, summarize
from boost_jax.analysis.memory_model import breakdown, layer_bytes_on
from boost_jax.analysis.program import peak_bytes
from boost_jax.analysis.work import step_work
from boost_jax.config import Config
from boost_jax.config.schemes import TP
from boost_jax.launch.gpu_target import no_persistent_cache
from boost_jax.model.decode import Decoder
from boost_jax.model.weights import abstract_model
from boost_jax.parallel import Plan, make_plan
from boost_jax.runtime.errors import ConfigError
from boost_jax.serving.programs import PagedPrograms
from boost_jax.training.step import abstract_batch, build

# Fusions XLA:GPU hands to a library or code generator, by their backend_config "kind" (the rest are
# XLA's own loop and reduction fusions).
_FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"(__[^"]+)"')
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def run_programs(cfg: Config, plan: Plan, cache: str = "auto") -> dict[str, Callable[[], jax.stages.Compiled]]:
    """Each program of the run, compiled on demand: the train step (exactly as `train` builds it), the
    eval step where `train.eval_every` runs one, and on a layout that decodes (no pipeline, no cp)
    the prefill of a batch of `train.seq_len`-token prompts and one call of the decode loop on its
    `cache` KV cache (model/decode.py), and where it is one replica (no dp, no fsdp: as the server
    runs) the server's paged decode (`serve_decode`)."""
    run = build(cfg, plan)
    batch = abstract_batch(cfg, plan)
    programs = {"train_step": lambda: run.train_step.lower(run.abstract_state, batch).compile()}
    if cfg.train.eval_every > 0:
        programs["eval_step"] = lambda: run.eval_step.lower(run.abstract_state.params, batch).compile()
    if plan.pipeline is None and plan.size("seq") == 1:
        rows, seq = cfg.train.batch_size, cfg.train.seq_len
        decoding: dict = {}  # the decoder, and the prefill's cache that the decode loop compiles for

        def prefill() -> jax.stages.Compiled:
            graphdef, abstract = abstract_model(cfg)
            decoding["decoder"] = Decoder(nnx.merge(graphdef, abstract), plan, cache=cache)
            compiled, decoding["cache"] = decoding["decoder"].compiled_prefill(rows, seq, seq)
            return compiled

        def decode() -> jax.stages.Compiled:
            if "cache" not in decoding:  # the prefill not compiled (`only`): its cache's layout is
                prefill()
            return decoding["decoder"].compiled_decode(decoding["cache"], rows)

        programs["prefill"], programs["decode"] = prefill, decode
        if plan.size("batch") == 1:
            programs["serve_decode"] = lambda: serve_decode(cfg, plan, cache)
    return programs


def serve_decode(cfg: Config, plan: Plan, cache: str) -> jax.stages.Compiled:
    """The server's paged decode program at its widest shape (`serve.slots` rows over a table of the
    context's pages, `serve.decode_steps` steps), its pool and page tables as inputs, the pool sized
    by `serve.*` as the server sizes it (serving/programs.py)."""
    graphdef, abstract = abstract_model(cfg)
    programs = PagedPrograms(Decoder(nnx.merge(graphdef, abstract), plan, cache=cache), cfg.serve, cfg.train.seq_len)
    return programs.compiled_decode(cfg.serve.slots, programs.max_pages)


def compile_all(cfg: Config, devices: list[jax.Device], cache: str = "auto",
                only: tuple[str, ...] = ()) -> tuple[Plan, list[dict], dict[str, jax.stages.Compiled]]:
    """Every program of `cfg`'s run (or those named in `only`) compiled for `devices` (a GPU topology's:
    launch/gpu_target.py): the plan, one report each (`read`; the train step's with the memory
    model's figure beside it, its one measured term, a decoder layer, compiled for the same devices),
    and the executables."""
    plan = make_plan(cfg, devices)
    sized = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **dict(plan.mesh.shape)))
    reports, compiled = [], {}
    programs = run_programs(sized, plan, cache)
    if missing := [name for name in only if name not in programs]:
        raise ConfigError(f"{', '.join(missing)}: not a program of this run, which has {', '.join(programs)} "
                          "(prefill and decode need no pipeline and no cp; serve_decode also parallel.dp=1 parallel.fsdp=1)")
    with no_persistent_cache():
        for name, compile_ in programs.items():  # in order: decode needs the prefill's cache
            if only and name not in only:
                continue
            compiled[name], seconds = compile_timed(compile_)
            reports.append(read(name, compiled[name], seconds, sized, plan))
            if name == "train_step":
                compiler = "gpu" if plan.platform == "gpu" else "cpu"  # the program's own compiler
                reports[-1]["model_memory"] = breakdown(sized, layer_bytes_on(devices), compiler)["total"]
    return plan, reports, compiled


def compile_timed(compile_: Callable[[], jax.stages.Compiled]) -> tuple[jax.stages.Compiled, float]:
    """The compiled program and the seconds its tracing, lowering and compile took."""
    t0 = time.perf_counter()
    compiled = compile_()
    return compiled, time.perf_counter() - t0


def custom_calls(hlo_text: str) -> dict[str, int]:
    """How many of each library call and generated kernel the optimised HLO holds: custom calls by
    target (cuDNN's attention `__cudnn$fmha...`, cuBLAS `__cublas$...`, Pallas' Triton kernels
    `__gpu$xla.gpu.triton`) and library fusions by kind (`__triton_gemm`, `__cudnn$fusion`, ...)."""
    found = Counter(_CUSTOM_CALL.findall(hlo_text))
    found.update(_FUSION_KIND.findall(hlo_text))
    return dict(sorted(found.items()))


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes of the compiled memory analysis: arguments, outputs, temporaries, and the peak
    (donated arguments counted once)."""
    m = compiled.memory_analysis()
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
            "temp": m.temp_size_in_bytes, "peak": peak_bytes(compiled)}


def read(name: str, compiled: jax.stages.Compiled, seconds: float, cfg: Config, plan: Plan) -> dict:
    """One program's report: compile time, memory, every collective per step (kind: count, bytes per
    device; those in a conditional's branches apart, as they run on some steps only), custom calls; for the train step also its decoder layers' collectives beside the
    scheme's analytic formulas (config/schemes.py), per layer, forward and backward."""
    text = compiled.as_text()
    cols = collectives(text)
    # A conditional's collectives (the health metrics' power iterations, on logging steps only) apart.
    per_step = summarize([c for c in cols if not c.conditional])
    on_some = summarize([c for c in cols if c.conditional])
    report = {"name": name, "compile_s": seconds, "memory": memory(compiled),
              "collectives": per_step["by_kind"], "collective_bytes": per_step["bytes"],
              "conditional_collectives": on_some["by_kind"], "conditional_collective_bytes": on_some["bytes"],
              "custom_calls": custom_calls(text), "while_loops": text.count(" while("),
              "analytic_collective_bytes": None}
    if name == "decode":  # a step's work, the loop's trip count unknown to the program
        report["step_work"] = step_work(text, itemsize=jax.numpy.dtype(cfg.model.dtype).itemsize)
    if name in ("train_step", "eval_step") and plan.mesh.shape[TP] > 1:
        # Per decoder layer, the collectives over tp inside the layer scan (a data-parallel gradient
        # reduction XLA:GPU moves into the backward loop is not the scheme's). Forward and backward
        # together: XLA:GPU's combined collectives and the kernels' custom VJPs do not keep JAX's
        # transpose(...) names, so the eval step (the forward alone) is what splits them.
        _, _, fwd_bytes, bwd_parts = layer_analytic(cfg, plan)
        shape = dict(plan.mesh.shape)
        layers = [c for c in in_layers(cols, plan.pipeline is not None) if over_axis(c, shape, TP)]
        report["layer_collective_bytes"] = summarize(layers, in_loop=True)["bytes"]
        backward = 0 if name == "eval_step" else None if bwd_parts is None else sum(bwd_parts)
        report["analytic_collective_bytes"] = None if backward is None else fwd_bytes + backward
    return report
