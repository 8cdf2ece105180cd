"""`bench planner`: `python -m boost_jax.plan` on each row of the paper's table, beside the paper's own layout.

For each model, on the paper's GPU count (TP x PP A100-80GB) and at its settings (cola, bf16,
seq 4096; an iteration of PP micro-batches of 4 sequences, as `bench paper` compiles it), the
planner enumerates every layout, sizes it with the memory model and prices those that fit with the
performance model. The paper's own layout (BTP at its TP and PP, dp = fsdp = 1, M = PP) is one of
the candidates and is priced in every remat mode that fits (the others only when their lower bound
can beat the fastest so far); it is shown at its fastest, next to the planner's choice.

The memory budget defaults to the whole GPU (--headroom 0): the paper ran its layouts in 80 GB, and
the comparison asks what fits there; `python -m boost_jax.plan` keeps 10% free by default.
Compiles are cached on disk (plan/price.py), so a second run prices from the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from boost_jax.analysis.program import DTYPES
from boost_jax.bench.paper import PAPER
from boost_jax.bench.perf_model import HARDWARE_FILE, Hardware, one_machine
from boost_jax.cli import int_list
from boost_jax.errors import ConfigError

GIB = 2**30
ARCH, SCHEME = "cola", "btp"  # the paper's BOOST column
PAPER_HARDWARE = "a100-80gb"
MAX_PRICED = 8  # 13B and 30B pipelined compiles take minutes each on a laptop


def paper_hardware() -> Hardware:
    return one_machine(None, PAPER_HARDWARE)


def is_paper_layout(layout, model: str) -> bool:
    tp, pp = PAPER[model]["tp"], PAPER[model]["pp"]
    return (layout.scheme, layout.tp, layout.pp, layout.pp_repeats, layout.dp, layout.fsdp, layout.microbatches) \
        == (SCHEME, tp, pp, 1, 1, 1, pp)


def compare(model: str, hw: Hardware, *, batch: int, seq: int, dtype: str, schemes: tuple[str, ...],
            pp_repeats: tuple[int, ...], headroom: float, max_priced: int | None, cache, log) -> dict:
    """The planner's choice and the paper's layout for one row of the paper's table."""
    from boost_jax.plan.layouts import Space
    from boost_jax.plan.search import base_overrides, plan

    setting = PAPER[model]
    gpus, pp = setting["tp"] * setting["pp"], setting["pp"]
    t0 = time.perf_counter()
    cands = plan(base_overrides(model, ARCH, batch * pp, seq, DTYPES[dtype]), [], gpus=gpus, hw=hw,
                 space=Space(schemes=schemes, pp_repeats=pp_repeats), headroom=headroom, cache=cache, log=log,
                 must_price=lambda layout: is_paper_layout(layout, model), max_priced=max_priced)
    priced = [c for c in cands if c.step]
    if not priced:
        raise ConfigError(f"{model}: no layout of {gpus} GPUs fits in {hw.name} with {headroom:.0%} headroom")
    theirs = [c for c in cands if is_paper_layout(c.layout, model)]
    best_theirs = next((c for c in priced if is_paper_layout(c.layout, model)), None)
    return {
        "model": model, "gpus": gpus, "global_batch": batch * pp, "seq": seq, "dtype": dtype,
        "layouts": len(cands), "priced": len(priced), "seconds_to_plan": time.perf_counter() - t0,
        "choice": priced[0].row(hw, gpus),
        "paper_layout": best_theirs.row(hw, gpus) if best_theirs else None,
        # The paper's layout in every remat mode: what the memory model says it needs, and why it lost.
        "paper_layout_by_remat": {c.layout.remat: {"memory_bytes_per_gpu": c.memory["total"], "why": c.why or "chosen"}
                                  for c in theirs if c.memory},
    }


def run(models: list[str], hw: Hardware, *, batch: int, seq: int, dtype: str, schemes: tuple[str, ...] = (SCHEME,),
        pp_repeats: tuple[int, ...] = (1, 2), headroom: float = 0.0, max_priced: int | None = MAX_PRICED,
        log=print) -> dict:
    from boost_jax.config import load_config
    from boost_jax.data.cache import cache_root
    from boost_jax.plan.price import DiskCache

    cache = DiskCache(cache_root(load_config(None, []).data) / "plan")
    rows = [compare(m, hw, batch=batch, seq=seq, dtype=dtype, schemes=schemes, pp_repeats=pp_repeats,
                    headroom=headroom, max_priced=max_priced, cache=cache, log=log) for m in models]
    return {"settings": {"hardware": hw.name, "hbm_bytes": hw.hbm_bytes, "headroom": headroom, "arch": ARCH,
                         "schemes": list(schemes), "pp_repeats": list(pp_repeats), "max_priced": max_priced,
                         "batch": batch, "seq": seq, "dtype": dtype},
            "rows": rows}


def _layout(l: dict) -> str:
    return (f"{l['scheme']} tp{l['tp']} pp{l['pp']}" + (f"x{l['pp_repeats']}" if l["pp_repeats"] > 1 else "")
            + f" dp{l['dp']} fsdp{l['fsdp']} M{l['microbatches']} {l['remat']}")


def table(result: dict) -> list[str]:
    """Markdown: per paper row, the paper's layout and the planner's choice, both priced on the same model."""
    lines = ["| model | GPUs | batch | paper's layout (fastest remat that fits) | s/iter | GiB/GPU "
             "| planner's choice | s/iter | GiB/GPU | speedup of the choice | layouts (priced) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, p = r["choice"], r["paper_layout"]
        if p:
            theirs = (f"{_layout(p['layout'])} | {p['step_s']:.3f} | {p['memory_bytes_per_gpu'] / GIB:.1f}")
            speed = "same layout" if p["layout"] == c["layout"] else f"{p['step_s'] / c['step_s']:.2f}x"
        else:
            need = min(v["memory_bytes_per_gpu"] for v in r["paper_layout_by_remat"].values())
            theirs, speed = f"does not fit in any remat mode (least {need / GIB:.1f} GiB) | - | -", "-"
        lines.append(f"| {r['model']} | {r['gpus']} | {r['global_batch']} x {r['seq']} | {theirs} | {_layout(c['layout'])} "
                     f"| {c['step_s']:.3f} | {c['memory_bytes_per_gpu'] / GIB:.1f} | {speed} | {r['layouts']} ({r['priced']}) |")
    return lines


def paper_layout_lines(result: dict) -> list[str]:
    """Markdown bullets: the paper's layout in each remat mode, its memory and its fate."""
    return [f"- {r['model']}: " + "; ".join(f"{remat} {v['memory_bytes_per_gpu'] / GIB:.1f} GiB ({v['why']})"
                                           for remat, v in r["paper_layout_by_remat"].items())
            for r in result["rows"]]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m boost_jax.bench planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(PAPER), help=f"comma-separated, from {', '.join(PAPER)}")
    p.add_argument("--hardware", default=PAPER_HARDWARE, help=f"one machine of the hardware file (the paper's: {PAPER_HARDWARE})")
    p.add_argument("--hardware-file", default=str(HARDWARE_FILE))
    p.add_argument("--schemes", default=SCHEME, help="schemes the planner may choose (comma-separated)")
    p.add_argument("--pp-repeats", type=int_list, default="1,2")
    p.add_argument("--headroom", type=float, default=0.0, help="fraction of GPU memory left free")
    p.add_argument("--max-priced", type=int, default=MAX_PRICED,
                   help="layouts priced per row besides the paper's, lowest lower bound first (0: every one that can win)")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch of the paper's layout")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    models = a.models.split(",")
    if bad := [m for m in models if m not in PAPER]:
        raise ConfigError(f"--models: unknown {bad}; the paper's are {list(PAPER)}")
    if not 0 <= a.headroom < 1 or a.batch < 1 or a.seq < 1 or a.max_priced < 0:
        raise ConfigError("--headroom must be in [0, 1), --batch and --seq positive, --max-priced >= 0")
    hw = one_machine(a.hardware_file, a.hardware)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    result = run(models, hw, batch=a.batch, seq=a.seq, dtype=a.dtype, schemes=tuple(a.schemes.split(",")),
                 pp_repeats=a.pp_repeats, headroom=a.headroom, max_priced=a.max_priced or None, log=log)
    result["settings"]["command"] = " ".join(["python -m boost_jax.bench planner", *argv])
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print(f"The planner on the paper's rows: {ARCH}, {hw.name}, budget {hw.hbm_bytes * (1 - a.headroom) / GIB:.1f} GiB "
          f"per GPU ({a.headroom:.0%} headroom), the same performance model for both layouts:", *table(result), sep="\n")
