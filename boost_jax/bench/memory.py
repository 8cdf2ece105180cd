"""`bench memory`: per-device peak memory of the train step under each remat mode, from XLA's
compiled memory analysis of an abstract compile (nothing allocated: llama-7b works on a laptop),
beside the memory model's figure for it (`analysis/memory_model.py`: what the planner uses; at the
compute dtype, so in bf16 it is a GPU's figure and below the CPU compile's, which keeps f32 copies),
and, with `--time`, the measured step time and BOOST's efficiency metric: memory saved per
millisecond of recomputation, against remat=none (docs/design.md section 6).

`--microbatch-sweep 2,4,8` instead compiles the step at each micro-batch count with `--batch` rows
per micro-batch (so the global batch grows with M): without a pipeline, gradient accumulation keeps
one micro-batch's activations (flat); with `--pp`, what the pipeline keeps per micro-batch in
flight (its iterations' saved activations and the stage buffers).
"""

from __future__ import annotations

import argparse
import json

import jax

from boost_jax.analysis.memory_model import breakdown
from boost_jax.analysis.program import build, peak_bytes
from boost_jax.bench.common import add_model_flags, bench_config
from boost_jax.bench.step import measure as measure_steps
from boost_jax.step import accumulated_grad

MODES = ("none", "full", "lowrank")
MIB = 2**20


def compiled_peak(cfg) -> dict:
    """Peak of the train step's gradient as the step computes it: accumulated over micro-batches,
    or through the pipeline when there is one."""
    prog = build(cfg)
    grad = accumulated_grad(prog.loss, prog.plan, cfg.train.microbatches,
                            jax.tree.map(lambda p: p.sharding, prog.params))
    compiled = jax.jit(grad).lower(prog.params, prog.batch).compile()
    # AdamW keeps two fp32 moments per parameter, sharded like the parameter.
    return {"fwd_bwd_peak_bytes": peak_bytes(compiled), "optimizer_state_bytes": 2 * 4 * prog.params_per_device}


def sweep_microbatches(a: argparse.Namespace, counts: list[int]) -> None:
    rows = []
    for m in counts:
        cfg = bench_config(a, microbatches=m, batch=a.batch * m)
        pipe = build(cfg).plan.pipeline
        rows.append({"microbatches": m, "global_batch": cfg.train.batch_size,
                     "iterations": pipe.iterations if pipe else None,
                     "bubble_fraction": pipe.bubble_fraction if pipe else None, **compiled_peak(cfg)})
    if a.json:
        print(json.dumps({"model": a.model, "arch": a.arch, "scheme": a.scheme, "tp": a.tp, "pp": a.pp,
                          "rows_per_microbatch": a.batch, "seq": a.seq, "dtype": a.dtype, "rows": rows}, indent=1))
        return
    print(f"{a.model} {a.arch} tp={a.tp} pp={a.pp} x{a.pp_repeats} {a.batch} rows/micro-batch s={a.seq} {a.dtype}: "
          "per-device peak of the train step's forward + backward (compiled memory analysis)")
    print(f"{'M':>4s} {'batch':>6s} {'iterations':>10s} {'bubble':>7s} {'peak MiB':>10s} {'+MiB per M':>11s}")
    for prev, r in zip([None, *rows], rows):
        grow = "-" if prev is None else format((r["fwd_bwd_peak_bytes"] - prev["fwd_bwd_peak_bytes"]) / MIB
                                               / (r["microbatches"] - prev["microbatches"]), ".2f")
        bubble = "-" if r["bubble_fraction"] is None else f"{100 * r['bubble_fraction']:.0f}%"
        print(f"{r['microbatches']:4d} {r['global_batch']:6d} {str(r['iterations'] or '-'):>10s} {bubble:>7s} "
              f"{r['fwd_bwd_peak_bytes'] / MIB:10.2f} {grow:>11s}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m boost_jax.bench memory", description=__doc__)
    add_model_flags(p)
    p.add_argument("--remat", default="all", choices=["all", *MODES])
    p.add_argument("--compare", action="store_true", help="vanilla and btp side by side")
    p.add_argument("--time", action="store_true", help="also run the steps here (small models only)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatch-sweep", default="", metavar="M1,M2,...",
                   help="peak at each micro-batch count, --batch rows per micro-batch (with --pp: the pipeline)")
    a = p.parse_args(argv)
    if a.microbatch_sweep:
        return sweep_microbatches(a, [int(m) for m in a.microbatch_sweep.split(",")])
    # remat=none is always measured: it is the baseline of the saved-memory metric.
    modes = MODES if a.remat == "all" else tuple(dict.fromkeys(("none", a.remat)))
    schemes = ("vanilla", "btp") if a.compare else (a.scheme,)
    rows = []
    for scheme in schemes:
        cfgs = [bench_config(a, scheme=scheme, overrides=[*a.overrides, f"train.remat={m}"]) for m in modes]
        times = [r["median_step_s"] for r in measure_steps(cfgs, a.reps, a.steps)] if a.time else [None] * len(cfgs)
        for mode, cfg, t in zip(modes, cfgs, times):
            rows.append({"scheme": cfg.parallel.scheme, "remat": mode, **compiled_peak(cfg),
                         "memory_model_bytes": breakdown(cfg)["step"], "step_s": t})
    for row in rows:  # BOOST's metric, against the same scheme without remat
        base = next(r for r in rows if r["scheme"] == row["scheme"] and r["remat"] == "none")
        saved = (base["fwd_bwd_peak_bytes"] - row["fwd_bwd_peak_bytes"]) / MIB
        row["saved_mib"] = saved
        added_ms = None if row["step_s"] is None else 1e3 * (row["step_s"] - base["step_s"])
        row["added_ms"] = added_ms
        row["mib_saved_per_ms"] = saved / added_ms if added_ms and added_ms > 0 and row["remat"] != "none" else None
    if a.json:
        print(json.dumps({"model": a.model, "arch": a.arch, "tp": a.tp, "batch": a.batch, "seq": a.seq,
                          "dtype": a.dtype, "rows": rows}, indent=1))
        return
    print(f"{a.model} {a.arch} tp={a.tp} pp={a.pp} b={a.batch} s={a.seq} {a.dtype}: per-device memory (compiled memory analysis)")
    print(f"{'scheme':8s} {'remat':8s} {'fwd+bwd peak MiB':>17s} {'model MiB':>10s} {'+AdamW MiB':>11s} {'saved MiB':>10s} "
          f"{'step ms':>9s} {'MiB saved/ms':>13s}")
    for r in rows:
        fmt = lambda v, f: "-" if v is None else format(v, f)
        print(f"{r['scheme']:8s} {r['remat']:8s} {r['fwd_bwd_peak_bytes'] / MIB:17.1f} {r['memory_model_bytes'] / MIB:10.1f} "
              f"{r['optimizer_state_bytes'] / MIB:11.1f} "
              f"{r['saved_mib']:10.1f} {fmt(r['step_s'] and 1e3 * r['step_s'], '9.1f'):>9s} {fmt(r['mib_saved_per_ms'], '13.1f'):>13s}")
