"""`bench planner [section.key=value ...]`: `python -m boost_jax.plan` on each row of the paper's
table, beside the paper's own layout.

For each model, on the paper's GPU count (TP x PP A100-80GB) and at its settings (cola, bf16,
seq 4096; an iteration of PP micro-batches of 4 sequences, as `bench paper` compiles it, then the
command line's overrides), the
planner enumerates every layout, sizes it with the memory model and prices those that fit with the
performance model. The paper's own layout (BTP at its TP and PP, dp = fsdp = 1, M = PP) is one of
the candidates and is priced in every remat mode that fits (the others only when their lower bound
can beat the fastest so far); it is shown at its fastest, next to the planner's choice.

The memory budget defaults to the whole GPU (--headroom 0): the paper ran its layouts in 80 GB, and
the comparison asks what fits there; `python -m boost_jax.plan` keeps 10% free by default.
Compiles are cached on disk (planner/price.py), so a second run prices from the cache.
"""

from __future__ import annotations

import json
import sys
import time

import jax

from boost_jax.analysis.compiled import compile_all
from boost_jax.bench.common import parse, parser
from boost_jax.bench.paper import PAPER, gpu_topology, row_config
from boost_jax.config.hardware import HARDWARE_FILE, Hardware, one_machine
from boost_jax.launch.gpu_target import gpu_devices, target_config
from boost_jax.planner.layouts import Space
from boost_jax.planner.price import DiskCache
from boost_jax.planner.search import rank_layouts
from boost_jax.planner.workers import Workers, default_workers
from boost_jax.runtime.cache import cache_root
from boost_jax.runtime.cli import int_list
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.units import GIB

# What a planner row fixes of the paper's protocol (the layout keys are the planner's to choose).
ROW_KEYS = ("model.preset", "model.arch", "model.dtype", "train.batch_size", "train.seq_len")

ARCH, SCHEME = "cola", "btp"  # the paper's BOOST column
PAPER_HARDWARE = "a100-80gb"
MAX_PRICED = 8  # 13B and 30B pipelined compiles take minutes each on a laptop


def paper_hardware() -> Hardware:
    return one_machine(None, PAPER_HARDWARE)


def is_paper_layout(layout, model: str) -> bool:
    tp, pp = PAPER[model]["tp"], PAPER[model]["pp"]
    return (layout.scheme, layout.tp, layout.pp, layout.pp_repeats, layout.dp, layout.fsdp, layout.cp,
            layout.microbatches) == (SCHEME, tp, pp, 1, 1, 1, 1, pp)


def row_overrides(model: str, overrides: tuple[str, ...]) -> list[str]:
    """The paper's row (`bench paper`'s protocol, then `overrides`) as the keys a planner keeps fixed."""
    cfg = row_config(model, f"{ARCH}/{SCHEME}", overrides)
    values = {"model.preset": cfg.model.preset, "model.arch": cfg.model.arch, "model.dtype": cfg.model.dtype,
              "train.batch_size": cfg.train.batch_size, "train.seq_len": cfg.train.seq_len}
    return [f"{k}={values[k]}" for k in ROW_KEYS] + [o for o in overrides if o.split("=")[0] not in ROW_KEYS]


def gpu_check(cfg, hw: Hardware, gpus: int) -> dict:
    """A layout's train step compiled by XLA:GPU for its `gpus` GPUs of `hw` (deviceless:
    launch/gpu_target.py): its peak per GPU from the real compiler, whether that fits the GPU, and the
    memory model's total (its layer term measured by the same compiler) beside it."""
    t0 = time.perf_counter()
    _, (report,), _ = compile_all(cfg, gpu_devices(hw, *gpu_topology(gpus, hw)), only=("train_step",))
    peak = report["memory"]["peak"]
    return {"hardware": hw.name, "peak_bytes": peak, "fits": peak <= hw.hbm_bytes, "memory_model_bytes":
            report["model_memory"], "attention": report["custom_calls"].get("__cudnn$fmhaSoftmax", 0) > 0,
            "compile_s": time.perf_counter() - t0}


def compare(model: str, hw: Hardware, *, overrides: tuple[str, ...], schemes: tuple[str, ...],
            pp_repeats: tuple[int, ...], headroom: float, max_priced: int | None, cache, workers, log,
            gpu_compile: Hardware | None = None) -> dict:
    """The planner's choice and the paper's layout for one row of the paper's table; with `gpu_compile`,
    each compiled by XLA:GPU for that GPU (`gpu_check`)."""
    setting = PAPER[model]
    gpus = setting["tp"] * setting["pp"]
    t0 = time.perf_counter()
    base = row_overrides(model, overrides)
    cands = rank_layouts(base, gpus=gpus, hw=hw,
                 space=Space(schemes=schemes, pp_repeats=pp_repeats), headroom=headroom, cache=cache, log=log,
                 must_price=lambda layout: is_paper_layout(layout, model), max_priced=max_priced, workers=workers)
    priced = [c for c in cands if c.step]
    if not priced:
        raise ConfigError(f"{model}: no layout of {gpus} GPUs fits in {hw.name} with {headroom:.0%} headroom")
    theirs = [c for c in cands if is_paper_layout(c.layout, model)]
    best_theirs = next((c for c in priced if is_paper_layout(c.layout, model)), None)
    cfg = priced[0].cfg
    checked = {}
    if gpu_compile is not None:
        for name, c in (("choice", priced[0]), ("paper_layout", best_theirs)):
            if c is not None:
                checked[name] = gpu_check(c.cfg, gpu_compile, gpus)
                log(f"  {model} {name} compiled by XLA:GPU in {checked[name]['compile_s']:.0f} s")
    return {
        "model": model, "gpus": gpus, "global_batch": cfg.train.batch_size, "seq": cfg.train.seq_len,
        "dtype": cfg.model.dtype,
        "layouts": len(cands), "priced": len(priced), "seconds_to_plan": time.perf_counter() - t0,
        "choice": priced[0].row(hw, gpus),
        "paper_layout": best_theirs.row(hw, gpus) if best_theirs else None,
        # The paper's layout in every remat mode: what the memory model says it needs, and why it lost.
        "paper_layout_by_remat": {c.layout.remat: {"memory_bytes_per_gpu": c.memory["total"], "why": c.why or "chosen"}
                                  for c in theirs if c.memory},
        **({"gpu_compile": checked} if checked else {}),
    }


def run(models: list[str], hw: Hardware, *, overrides: tuple[str, ...] = (), schemes: tuple[str, ...] = (SCHEME,),
        pp_repeats: tuple[int, ...] = (1, 2), headroom: float = 0.0, max_priced: int | None = MAX_PRICED,
        log=print, gpu_compile: Hardware | None = None) -> dict:
    first = row_config(models[0], f"{ARCH}/{SCHEME}", overrides)
    cache = DiskCache(cache_root(first.data.cache_dir) / "plan")
    cold = not any(cache.root.glob("*.json"))  # the rows' wall times then include every compile
    with Workers(default_workers(), jax.device_count()) as workers:
        rows = [compare(m, hw, overrides=overrides, schemes=schemes, pp_repeats=pp_repeats, headroom=headroom,
                        max_priced=max_priced, cache=cache, workers=workers, log=log, gpu_compile=gpu_compile)
                for m in models]
    return {"settings": {"hardware": hw.name, "hbm_bytes": hw.hbm_bytes, "headroom": headroom, "arch": ARCH,
                         "schemes": list(schemes), "pp_repeats": list(pp_repeats), "max_priced": max_priced,
                         "workers": workers.n, "cold_cache": cold,
                         "gpu_compile": gpu_compile.name if gpu_compile else None,
                         "batch": first.train.batch_size // first.train.microbatches, "seq": first.train.seq_len,
                         "dtype": first.model.dtype, "overrides": list(overrides)},
            "rows": rows}


def _layout(l: dict) -> str:
    return (f"{l['scheme']} tp{l['tp']} pp{l['pp']}" + (f"x{l['pp_repeats']}" if l["pp_repeats"] > 1 else "")
            + f" dp{l['dp']} fsdp{l['fsdp']} M{l['microbatches']} {l['remat']}")


def table(result: dict) -> list[str]:
    """Markdown: per paper row, the paper's layout and the planner's choice, both priced on the same model."""
    lines = ["| model | GPUs | batch | paper's layout (fastest remat that fits) | s/iter | GiB/GPU "
             "| planner's choice | s/iter | GiB/GPU | speedup of the choice | layouts (priced) | time to plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, p = r["choice"], r["paper_layout"]
        if p:
            theirs = (f"{_layout(p['layout'])} | {p['step_s']:.3f} | {p['memory_bytes_per_gpu'] / GIB:.1f}")
            speed = "same layout" if p["layout"] == c["layout"] else f"{p['step_s'] / c['step_s']:.2f}x"
        else:
            need = min(v["memory_bytes_per_gpu"] for v in r["paper_layout_by_remat"].values())
            theirs, speed = f"does not fit in any remat mode (least {need / GIB:.1f} GiB) | - | -", "-"
        lines.append(f"| {r['model']} | {r['gpus']} | {r['global_batch']} x {r['seq']} | {theirs} | {_layout(c['layout'])} "
                     f"| {c['step_s']:.3f} | {c['memory_bytes_per_gpu'] / GIB:.1f} | {speed} | {r['layouts']} ({r['priced']}) "
                     f"| {r['seconds_to_plan']:.0f} s |")
    return lines


def gpu_lines(result: dict) -> list[str]:
    """Markdown: each row's chosen (and paper's) layout compiled by XLA:GPU: fits or not from the real
    compiler, its peak beside the memory model's total."""
    rows = [r for r in result["rows"] if "gpu_compile" in r]
    if not rows:
        return []
    lines = ["| model | layout | XLA:GPU peak GiB per GPU | fits | memory model GiB (ratio) | compile s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for name, g in r["gpu_compile"].items():
            layout = _layout(r[name]["layout"]) + (" (the paper's)" if name == "paper_layout" else "")
            lines.append(f"| {r['model']} | {layout} | {g['peak_bytes'] / GIB:.1f} | {'yes' if g['fits'] else 'NO'} "
                         f"| {g['memory_model_bytes'] / GIB:.1f} ({g['memory_model_bytes'] / g['peak_bytes']:.2f}x) "
                         f"| {g['compile_s']:.0f} |")
    return lines


def paper_layout_lines(result: dict) -> list[str]:
    """Markdown bullets: the paper's layout in each remat mode, its memory and its fate."""
    return [f"- {r['model']}: " + "; ".join(f"{remat} {v['memory_bytes_per_gpu'] / GIB:.1f} GiB ({v['why']})"
                                           for remat, v in r["paper_layout_by_remat"].items())
            for r in result["rows"]]


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench planner", __doc__, retired_kept=("--pp-repeats",))
    p.add_argument("--models", default=",".join(PAPER), help=f"comma-separated, from {', '.join(PAPER)}")
    p.add_argument("--hardware", default=PAPER_HARDWARE, help=f"one machine of the hardware file (the paper's: {PAPER_HARDWARE})")
    p.add_argument("--hardware-file", default=str(HARDWARE_FILE))
    p.add_argument("--schemes", default=SCHEME, help="schemes the planner may choose (comma-separated)")
    p.add_argument("--pp-repeats", type=int_list, default="1,2")
    p.add_argument("--headroom", type=float, default=0.0, help="fraction of GPU memory left free")
    p.add_argument("--gpu-compile", default="", metavar="NAME",
                   help="also compile each chosen layout with XLA:GPU for this machine (deviceless: "
                        "pip install -e '.[gpu-compile]'): fits or not from the real compiler")
    p.add_argument("--max-priced", type=int, default=MAX_PRICED,
                   help="layouts priced per row besides the paper's, lowest lower bound first (0: every one that can win)")
    a = parse(p, argv)
    models = a.models.split(",")
    if bad := [m for m in models if m not in PAPER]:
        raise ConfigError(f"--models: unknown {bad}; the paper's are {list(PAPER)}")
    if bad := [n for n in a.pp_repeats if n < 1]:
        raise ConfigError(f"--pp-repeats {','.join(map(str, bad))}: each must be at least 1")
    if not 0 <= a.headroom < 1 or a.max_priced < 0:
        raise ConfigError("--headroom must be in [0, 1) and --max-priced >= 0")
    hw = one_machine(a.hardware_file, a.hardware)
    gpu = one_machine(a.hardware_file, a.gpu_compile) if a.gpu_compile else None
    if gpu is not None:
        target_config(gpu)  # a machine without a compile target, or a missing extra, before any work
    log = lambda s: print(s, file=sys.stderr, flush=True)
    result = run(models, hw, overrides=tuple(a.config), schemes=tuple(a.schemes.split(",")),
                 pp_repeats=a.pp_repeats, headroom=a.headroom, max_priced=a.max_priced or None, log=log,
                 gpu_compile=gpu)
    result["settings"]["command"] = " ".join(["python -m boost_jax.bench planner", *argv])
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print(f"The planner on the paper's rows: {ARCH}, {hw.name}, budget {hw.hbm_bytes * (1 - a.headroom) / GIB:.1f} GiB "
          f"per GPU ({a.headroom:.0%} headroom), the same performance model for both layouts:", *table(result), sep="\n")
    if lines := gpu_lines(result):
        print(f"\nThe layouts compiled by XLA:GPU for {gpu.name} (no GPU): the train step as `train` builds it",
              *lines, sep="\n")
