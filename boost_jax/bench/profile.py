"""`bench profile [CONFIG.yaml] [section.key=value ...]`: where a compiled train step's time goes,
read from a JAX profiler trace.

Traces --steps compiled, warmed-up steps of one config (as `bench step` builds it), puts
each XLA op's time in a category (`boost_jax/analysis/timeline.py` says which op goes where) and
prints each category's ms per step and share of the step, then the top ops. The trace directory
is kept: TensorBoard's profile plugin (`tensorboard --logdir DIR`) or ui.perfetto.dev (the
`*.trace.json.gz` file) shows it.

Step time is the wall time of the traced steps (profiler overhead included; the untraced step is
printed beside it). Op times are per device: with several devices (simulated ones share this
host's cores) each figure is the mean over the devices. Host gaps are measured in the trace: the
time a device ran no op between the start of its first traced step and the end of its last. The
accounted fraction is the categorised op time (not `other`) plus those gaps, over the step time
(the ops alone: `ops_fraction`); the rest lies outside the devices' traced span (the first
dispatch, the wait for the last result).

The roofline account sets each category's measured time beside its ideal: every op at the roofline,
max(its FLOPs / the matmul peak, the bytes it reads and writes / the memory bandwidth), both measured
in the same process (`flops.measure_matmul_peak`, `flops.measure_read_bandwidth`, each the best of a
probe before and after the trace). GEMMs are split by layout (forward, input gradient, weight
gradient: `timeline.gemm_layout`); host gaps are ideally 0. FLOPs are the dots' (`analysis/work.py`),
bytes the compiled dtypes' (`timeline.op_bytes`), both per device.

`--hf` (a dense LLaMA on one device, as `bench step --hf`) then profiles Hugging Face transformers +
PyTorch's step on the same weights and batch with torch's profiler and sets both side by side in
rows both can be split into (`hf.PROFILE_ROWS`: GEMMs, attention, optimizer, the rest), with HF's
step over our step's roofline ideal: what no implementation of the same work can beat.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

from boost_jax.analysis.timeline import (
    CATEGORIES,
    Op,
    classify,
    gemm_layout,
    module_name,
    op_bytes,
    op_seconds,
    read_trace,
)
from boost_jax.analysis.work import analyze
from boost_jax.bench import hf
from boost_jax.bench.common import config_of, parse, parser
from boost_jax.bench.step import Runner
from boost_jax.config import Config
from boost_jax.launch.peaks import measure_matmul_peak, measure_read_bandwidth
from boost_jax.parallel import make_plan
from boost_jax.parallel.context import query_group
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.paths import check_writable_dir

# The roofline's rows: the categories, those holding dots split into their dots by layout (the
# layer GEMMs, the LM head's) or attention's dots, and the rest. Layouts are read from dot
# instructions: a matmul custom call (a GPU's) has none, and is `gemm.other` or the rest.
ROOFLINE_ROWS = ("gemm.forward", "gemm.input_grad", "gemm.weight_grad", "gemm.other", "attention.dots",
                 "attention.rest", "elementwise", "loss.forward", "loss.input_grad", "loss.weight_grad", "loss.rest",
                 "optimizer", "collectives", "copies", "other", "host_gaps")


def profile(cfg: Config, steps: int, trace_dir: Path, top: int, runner: Runner | None = None) -> dict:
    """Trace `steps` train steps of cfg; `runner`: cfg's compiled step if the caller has one already
    (`bench report` profiles the runners it has just timed)."""
    p = cfg.parallel
    if p.pp > 1 or cfg.train.microbatches > 1 or cfg.train.loss_chunk:  # their loops would read as the layers' (timeline.py)
        raise ConfigError("bench profile: pipelines, micro-batch accumulation and a chunked loss are not supported "
                          "(pp=1, microbatches=1, loss_chunk=0)")
    if runner is None:
        runner = Runner(cfg)
    elif runner.cfg != cfg:
        raise ValueError("profile: the runner was compiled for another config")
    untraced = runner.steps(steps)
    peak, bandwidth = measure_matmul_peak(cfg.model.dtype), measure_read_bandwidth()
    with jax.profiler.trace(str(trace_dir)):
        step_s = runner.steps(steps)
    peak, bandwidth = max(peak, measure_matmul_peak(cfg.model.dtype)), max(bandwidth, measure_read_bandwidth())
    trace_file, events = read_trace(trace_dir)
    hlo = runner.compiled.as_text()
    ops = classify(hlo)
    devices = op_seconds(events, module_name(hlo), ops)
    if not devices:
        raise RuntimeError(f"{trace_file}: no op of {module_name(hlo)} in the trace")
    n = len(devices)
    per_op: dict[str, float] = {}  # seconds per step, mean over devices
    for d in devices.values():
        for name, sec in d.ops.items():
            per_op[name] = per_op.get(name, 0.0) + sec / steps / n
    categories = dict.fromkeys(CATEGORIES, 0.0)
    for name, sec in per_op.items():
        categories[ops[name].category if name in ops else "other"] += sec
    categories["host_gaps"] = sum(d.span_s - d.busy_s for d in devices.values()) / steps / n
    flops, layouts = gemm_work(hlo, cfg, ops)
    roof = roofline(per_op, ops, layouts, flops, op_bytes(hlo), peak, bandwidth, categories["host_gaps"])
    ops_s = sum(v for k, v in categories.items() if k not in ("other", "host_gaps"))
    accounted = (ops_s + categories["host_gaps"]) / step_s
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
    top_ops = [{"name": name, "category": ops[name].category if name in ops else "other",
                "op_name": ops[name].op_name if name in ops else "", "s_per_step": sec, "fraction": sec / step_s}
               for name, sec in ranked]
    m = cfg.model
    return {"model": m.preset, "arch": m.arch, "scheme": p.scheme, "tp": runner.mesh_shape["tp"],
            "dp": runner.mesh_shape["dp"],
            "batch": cfg.train.batch_size, "seq": cfg.train.seq_len, "dtype": m.dtype, "steps": steps,
            "devices": n, "device_kind": jax.devices()[0].device_kind, "step_s": step_s, "untraced_step_s": untraced,
            "categories": categories, "accounted_fraction": accounted, "ops_fraction": ops_s / step_s, "top_ops": top_ops,
            "matmul_peak_flops": peak, "bandwidth_bytes_per_s": bandwidth, "roofline": roof,
            "trace_dir": str(trace_dir), "trace_file": str(trace_file)}


def gemm_work(hlo: str, cfg: Config, ops: dict[str, Op]) -> tuple[dict[str, int], dict[str, str]]:
    """FLOPs per program run and layout (its first dot's: XLA:CPU fuses one) of each executed
    instruction that runs dots; `ops`: the module's `classify`."""
    plan = make_plan(cfg, mesh_devices(cfg.parallel))
    gemms, _ = analyze(hlo, seq=cfg.train.seq_len, itemsize=jnp.dtype(cfg.model.dtype).itemsize,
                       query_block=cfg.model.attention_query_block, cp=cfg.parallel.cp, group=query_group(plan, cfg.model))
    # The rows a layer sees per device: its share of the batch and of the sequence.
    tokens = cfg.train.batch_size // plan.size("batch") * cfg.train.seq_len // plan.size("seq")
    flops: dict[str, int] = defaultdict(int)
    layouts: dict[str, str] = {}
    for g in gemms:
        flops[g.op] += g.flops * g.trip_count
        layouts.setdefault(g.op, gemm_layout(ops[g.op].op_name, g, tokens))
    return dict(flops), layouts


def roofline_row(op: Op | None, layout: str | None) -> str:
    """The roofline row of an op (None: not the module's) and its layout (None: it runs no dot)."""
    if op is None:
        return "other"
    if op.category == "gemm":
        return f"gemm.{layout or 'other'}"
    if op.category == "attention":
        return "attention.dots" if layout else "attention.rest"
    if op.category == "loss":
        return f"loss.{layout or 'rest'}"
    return op.category


def roofline(per_op: dict[str, float], ops: dict[str, Op], layouts: dict[str, str], flops: dict[str, int],
             moved: dict[str, int], peak: float, bandwidth: float, host_gaps_s: float) -> dict[str, dict]:
    """Per row of ROOFLINE_ROWS: measured seconds per step, FLOPs and bytes per step of the ops
    measured, the ideal (each op at max(FLOPs / peak, bytes / bandwidth)), the waste (measured -
    ideal) and measured / ideal (None where the ideal is 0)."""
    rows = {k: {"s_per_step": 0.0, "flops": 0, "bytes": 0, "ideal_s": 0.0} for k in ROOFLINE_ROWS}
    for name, sec in per_op.items():
        row = rows[roofline_row(ops.get(name), layouts.get(name))]
        f, b = flops.get(name, 0), moved.get(name, 0)
        row["s_per_step"] += sec
        row["flops"] += f
        row["bytes"] += b
        row["ideal_s"] += max(f / peak, b / bandwidth)
    rows["host_gaps"]["s_per_step"] = host_gaps_s
    for row in rows.values():
        row["waste_s"] = row["s_per_step"] - row["ideal_s"]
        row["x_ideal"] = row["s_per_step"] / row["ideal_s"] if row["ideal_s"] else None
    return rows


def print_table(r: dict) -> None:
    ms = lambda s: f"{1e3 * s:9.2f}"
    pct = lambda s: f"{100 * s / r['step_s']:7.1f}%"
    print(f"{r['model']} {r['arch']}/{r['scheme']} tp={r['tp']} dp={r['dp']}, batch {r['batch']} x {r['seq']}, "
          f"{r['dtype']}, {r['steps']} traced steps on {r['device_kind']}")
    print(f"step {1e3 * r['step_s']:.1f} ms traced ({1e3 * r['untraced_step_s']:.1f} ms untraced); op times per device"
          + (f" (mean of {r['devices']} devices)" if r["devices"] > 1 else ""))
    print(f"{'category':14s} {'ms/step':>9s} {'of step':>8s}")
    for k, v in r["categories"].items():
        print(f"{k:14s} {ms(v)} {pct(v)}")
    print(f"{'accounted':14s} {'':9s} {100 * r['accounted_fraction']:7.1f}%  (categorised ops + host gaps; "
          f"the ops alone {100 * r['ops_fraction']:.1f}%)")
    print_roofline(r)
    print(f"\ntop {len(r['top_ops'])} ops")
    print(f"{'op':36s} {'category':12s} {'ms/step':>9s} {'of step':>8s}  jax name")
    for o in r["top_ops"]:
        name = o["op_name"].removeprefix("jit(train_step)/")
        print(f"{o['name'][:36]:36s} {o['category']:12s} {ms(o['s_per_step'])} {pct(o['s_per_step'])}  {name[-70:]}")
    print(f"\ntrace kept in {r['trace_dir']} (tensorboard --logdir, or {Path(r['trace_file']).name} in ui.perfetto.dev)")


def print_roofline(r: dict) -> None:
    print(f"\nroofline: each op at max(FLOPs / {r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s matmul peak, "
          f"bytes / {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s read bandwidth), both measured in this run")
    print(f"{'row':18s} {'ms/step':>9s} {'ideal ms':>9s} {'waste ms':>9s} {'x ideal':>8s} {'GFLOP':>8s} {'MB':>9s}")
    rows = r["roofline"]
    for k, v in rows.items():
        if v["s_per_step"] or v["ideal_s"]:
            x = f"{v['x_ideal']:8.1f}" if v["x_ideal"] is not None else f"{'-':>8s}"
            print(f"{k:18s} {1e3 * v['s_per_step']:9.2f} {1e3 * v['ideal_s']:9.2f} {1e3 * v['waste_s']:9.2f} {x} "
                  f"{v['flops'] / 1e9:8.2f} {v['bytes'] / 1e6:9.1f}")
    measured, ideal = (sum(v[k] for v in rows.values()) for k in ("s_per_step", "ideal_s"))
    print(f"{'total':18s} {1e3 * measured:9.2f} {1e3 * ideal:9.2f} {1e3 * (measured - ideal):9.2f} "
          f"{measured / ideal:8.1f}")


def coarse_rows(r: dict) -> dict[str, float]:
    """Our profile in `hf.PROFILE_ROWS`, seconds per step: the GEMMs (the layers' and the LM head's),
    attention, the optimizer, and the rest of the step's wall time."""
    roof = r["roofline"]
    rows = {"gemm": r["categories"]["gemm"] + sum(roof[f"loss.{k}"]["s_per_step"] for k in ("forward", "input_grad", "weight_grad")),
            "attention": r["categories"]["attention"], "optimizer": r["categories"]["optimizer"]}
    return {**rows, "rest": r["step_s"] - sum(rows.values())}


def print_side_by_side(r: dict) -> None:
    theirs, ours = r["hf"]["rows"], r["hf"]["ours"]
    print(f"\nbeside {hf.NAME} (torch {r['hf']['torch']}, {r['hf']['threads']} threads; torch's profiler, the same "
          f"weights and batch), ms per step")
    print(f"{'row':10s} {'boost_jax':>10s} {'HF':>10s} {'HF / ours':>10s}")
    for k in hf.PROFILE_ROWS:
        print(f"{k:10s} {1e3 * ours[k]:10.2f} {1e3 * theirs[k]:10.2f} {theirs[k] / ours[k]:9.2f}x")
    step = r["hf"]["step_s"]
    print(f"{'step':10s} {1e3 * r['step_s']:10.2f} {1e3 * step:10.2f} {step / r['step_s']:9.2f}x   (HF's step is "
          f"{step / sum(v['ideal_s'] for v in r['roofline'].values()):.2f}x our step's roofline ideal)")


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench profile", __doc__)
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--trace-dir", type=Path, help="where the trace goes (default: a new runs/profile/<run>)")
    p.add_argument("--top", type=int, default=10, help="ops listed")
    p.add_argument("--hf", action="store_true", help="also profile the same dense LLaMA's step in Hugging Face "
                                                     "transformers + PyTorch (torch's profiler), side by side")
    a = parse(p, argv)
    if a.steps < 1 or a.top < 0:
        raise ConfigError(f"--steps must be at least 1 and --top at least 0, got {a.steps} and {a.top}")
    cfg = config_of(a.config)
    m = cfg.model
    trace_dir = a.trace_dir or Path("runs/profile") / (
        f"{m.preset}-{m.arch}-{cfg.parallel.scheme}-tp{cfg.parallel.tp}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_writable_dir(trace_dir, "--trace-dir")  # before the steps run, not when the trace is written
    if a.hf:
        hf.check_train(cfg)
    runner = Runner(cfg)
    r = profile(cfg, a.steps, trace_dir, a.top, runner)
    if a.hf:  # the same weights and batch, profiled after ours in this process
        theirs = hf.TrainStep(cfg, runner.host_batch["inputs"], runner.host_batch["targets"]).profile(a.steps)
        r["hf"] = {**theirs, "ours": coarse_rows(r)}
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print_table(r)
        if a.hf:
            print_side_by_side(r)
