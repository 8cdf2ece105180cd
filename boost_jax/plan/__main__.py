"""python -m boost_jax.plan --model llama-7b --arch cola --gpus 32 --hardware a100-80gb --global-batch 512 --seq 4096 [section.key=value ...]

The parallel layout to run, before a GPU is rented: every (scheme, tp, pp, pp_repeats, dp, fsdp,
micro-batches, remat) of --gpus devices that divides the model and the batch, sized per device by
the memory model (analysis/memory_model.py; bf16 activations at 2 bytes, fp32 master weights and
AdamW moments) against the GPU's memory less --headroom, priced by the performance model
(bench/perf_model.py) on an abstract compile of each per-device program (plan/price.py says what
is added analytically), best first. Compiles go in order of a lower bound on each layout's time
(plan/price.py) and stop where the bound cannot beat the fastest priced (exact), or after
--max-priced of them (a heuristic). --out writes the winner as a config `python -m boost_jax.train`
runs as is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from boost_jax.cli import DEBUG_HELP, int_list, run_main

GIB = 2**30


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m boost_jax.plan", description=__doc__, epilog=DEBUG_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset (boost_jax/presets.py)")
    p.add_argument("--arch", default="cola")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--hardware", default="a100-80gb", help="one machine of the hardware file")
    p.add_argument("--hardware-file", default=None, help="default: configs/hardware.yaml")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per iteration")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory left free")
    p.add_argument("--schemes", default="", help="comma-separated; default: every scheme of the arch")
    p.add_argument("--tp", type=int_list, default="", help="comma-separated sizes; default: divisors of --gpus within a node")
    p.add_argument("--pp", type=int_list, default="", help="comma-separated sizes; default: every divisor")
    p.add_argument("--pp-repeats", type=int_list, default="1,2")
    p.add_argument("--remat", default="none,lowrank,full")
    p.add_argument("--top", type=int, default=5, help="candidates printed")
    p.add_argument("--out", default="", help="write the best layout as a config YAML")
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-priced", type=int, default=0,
                   help="compile at most this many layouts, lowest lower bound first (default 0: every one that can "
                        "win, exact; a cap is faster but can miss the best where overheads dominate the bound's FLOPs)")
    p.add_argument("--no-cache", action="store_true", help="compile again instead of reading the disk cache")
    p.add_argument("overrides", nargs="*", help="section.key=value, applied under every layout")
    a = p.parse_args(argv)
    if a.gpus < 1 or a.global_batch < 1 or a.seq < 1 or a.max_priced < 0 or not 0 <= a.headroom < 1:
        p.error("--gpus, --global-batch, --seq must be positive, --max-priced >= 0 and --headroom in [0, 1)")
    return a


def _main(argv: list[str]) -> None:
    a = parse(argv)
    import jax

    from boost_jax.plan.layouts import Space, enumerate_layouts

    space = Space(schemes=tuple(s for s in a.schemes.split(",") if s), tp=a.tp, pp=a.pp,
                  pp_repeats=a.pp_repeats, remat=tuple(a.remat.split(",")))
    from boost_jax.bench.perf_model import one_machine

    hw = one_machine(a.hardware_file, a.hardware)
    # Compiles run on tp x pp simulated devices (dp = fsdp = 1): request the most any layout needs
    # before JAX's backend starts.
    if jax.config.jax_platforms in (None, "", "cpu"):
        most = max((l.tp * l.pp for l in enumerate_layouts(a.arch, a.gpus, a.global_batch, hw.gpus_per_node, space)),
                   default=1)
        jax.config.update("jax_num_cpu_devices", most)
    from boost_jax.config import load_config
    from boost_jax.data.cache import cache_root
    from boost_jax.plan.price import DiskCache
    from boost_jax.plan.recipe import write_recipe
    from boost_jax.plan.search import base_overrides, plan

    base = base_overrides(a.model, a.arch, a.global_batch, a.seq, a.dtype)
    root = None if a.no_cache else cache_root(load_config(None, [*base, *a.overrides]).data) / "plan"
    log = lambda s: print(s, file=sys.stderr, flush=True)
    cands = plan(base, a.overrides, gpus=a.gpus, hw=hw, space=space, headroom=a.headroom, cache=DiskCache(root), log=log,
                 max_priced=a.max_priced or None)
    priced = [c for c in cands if c.step]
    if a.out and priced:
        write_recipe(a.out, base, a.overrides, priced[0].layout)
    if a.json:
        print(json.dumps({"candidates": [c.row(hw, a.gpus) for c in priced]}, indent=1))
        return
    print_plan(a, hw, cands)


def print_plan(a: argparse.Namespace, hw, cands) -> None:
    priced = [c for c in cands if c.step]
    nodes = math.ceil(a.gpus / hw.gpus_per_node)
    print(f"{a.model} {a.arch} on {a.gpus} x {hw.name} ({nodes} node{'s' * (nodes > 1)}), global batch "
          f"{a.global_batch} x {a.seq} tokens, {a.dtype}; memory budget {hw.hbm_bytes * (1 - a.headroom) / GIB:.1f} GiB "
          f"per GPU ({100 * a.headroom:.0f}% headroom)")
    print(f"{len(cands)} layouts: {sum(c.cfg is None for c in cands)} do not divide, "
          f"{sum(c.memory is not None and not c.fits for c in cands)} do not fit, {len(priced)} priced\n")
    print(f"{'#':>2s} {'scheme':8s} {'tp':>3s} {'pp':>3s} {'R':>2s} {'dp':>3s} {'fsdp':>4s} {'M':>4s} {'remat':8s} "
          f"{'s/iter':>8s} {'tok/s/GPU':>10s} {'MFU':>6s} {'GiB/GPU':>8s}  why not first")
    for i, c in enumerate(priced[:a.top]):
        r, l = c.row(hw, a.gpus), c.layout
        print(f"{i + 1:2d} {l.scheme:8s} {l.tp:3d} {l.pp:3d} {l.pp_repeats:2d} {l.dp:3d} {l.fsdp:4d} {l.microbatches:4d} "
              f"{l.remat:8s} {r['step_s']:8.3g} {r['tokens_per_s_per_gpu']:10.0f} {100 * r['mfu']:5.1f}% "
              f"{r['memory_bytes_per_gpu'] / GIB:8.3g}  {c.why or '-'}")
    losers = [c for c in cands if not c.step]
    if losers:
        print("\nWhy the others lost (one of each reason):")
        seen = set()
        for c in losers:
            kind = c.why.split(":")[0]
            if kind not in seen:
                seen.add(kind)
                print(f"  {c.layout}: {c.why}")
    print("\nPriced on abstract compiles at dp = fsdp = 1 (data-parallel and FSDP collectives added analytically; "
          "without a pipeline, M micro-batches = M x one).")
    if a.out and priced:
        print(f"wrote {a.out}: python -m boost_jax.train {a.out}")


if __name__ == "__main__":
    main()
