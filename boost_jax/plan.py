"""python -m boost_jax.plan [CONFIG.yaml] [section.key=value ...] --gpus N [--hardware a100-80gb] [--out recipe.yaml]

The parallel layout to run, before a GPU is rented. The config (the train command's keys and
meanings: model, train.batch_size as the global batch of an iteration, train.seq_len,
model.dtype, ...) is fixed; the planner chooses the layout keys (parallel.scheme, tp, pp,
pp_repeats, dp, fsdp, cp, train.microbatches, train.remat) over every layout of --gpus devices that
divides the model and the batch (--schemes/--tp/--pp/--pp-repeats/--cp/--remat narrow the search;
context parallelism is sized only where the same devices as data parallelism do not fit, full
remat only where the lighter presets do not),
sized per device by the memory model (analysis/memory_model.py; fp32 master weights and AdamW
moments, activations at model.dtype) against the GPU's memory less --headroom, priced by the
performance model (analysis/perf_model.py) on an abstract compile of each per-device program
(planner/price.py says what is added analytically), best first. Compiles go in order of a lower
bound on each layout's time (planner/price.py) and stop where the bound cannot beat the fastest
priced (exact), or after --max-priced of them (a heuristic). --out writes the winner as a config
that `python -m boost_jax.train` and `python -m boost_jax.bench step` run as is.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from boost_jax.config import ConfigError, from_args, raw_args
from boost_jax.config.hardware import one_machine
from boost_jax.config.presets import shape_name
from boost_jax.config.schemes import SCHEMES
from boost_jax.runtime.cache import cache_root
from boost_jax.runtime.cli import config_parser, int_list, refuse_retired_flags, run_main
from boost_jax.runtime.paths import check_writable_file
from boost_jax.runtime.units import GIB

SPACE_FLAGS = ("--tp", "--pp", "--pp-repeats", "--cp")  # narrow the search (a list), unlike the config keys


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    p = config_parser("python -m boost_jax.plan", __doc__)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--hardware", default="a100-80gb", help="one machine of the hardware file")
    p.add_argument("--hardware-file", default=None, help="default: boost_jax/configs/hardware.yaml")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory left free")
    p.add_argument("--schemes", default="", help="comma-separated; default: every scheme of the arch")
    p.add_argument("--tp", type=int_list, default="", help="comma-separated sizes; default: divisors of --gpus within a node")
    p.add_argument("--pp", type=int_list, default="", help="comma-separated sizes; default: every divisor")
    p.add_argument("--pp-repeats", type=int_list, default="", help="comma-separated; default: 1,2 (pipelines only)")
    p.add_argument("--cp", type=int_list, default="",
                   help="comma-separated sizes; default: every divisor that splits train.seq_len")
    p.add_argument("--remat", default="none,lowrank,full")
    p.add_argument("--top", type=int, default=5, help="candidates printed")
    p.add_argument("--out", default="", help="write the best layout as a config YAML")
    p.add_argument("--json", action="store_true")
    p.add_argument("--overlap", action="store_true",
                   help="price with communication overlapped: the backward's TP all-reduces behind their weight-gradient "
                        "GEMMs and the data-parallel gradient all-reduce behind the backward pass (default: none)")
    p.add_argument("--max-priced", type=int, default=0,
                   help="compile at most this many layouts, lowest lower bound first (default 0: every one that can "
                        "win, exact; a cap is faster but can miss the best where overheads dominate the bound's FLOPs)")
    p.add_argument("--no-cache", action="store_true", help="compile again instead of reading the disk cache")
    p.add_argument("--workers", type=int, default=0,
                   help="processes compiling at once (default 0: one per core, at most 8; 1: in this process)")
    refuse_retired_flags(argv, keep=SPACE_FLAGS)
    a = p.parse_intermixed_args(argv)
    if a.gpus < 1 or a.max_priced < 0 or a.top < 1 or a.workers < 0 or not 0 <= a.headroom < 1:
        raise ConfigError("--gpus and --top must be at least 1, --max-priced and --workers >= 0 and --headroom in [0, 1)")
    check_no_layout_keys(a.config)
    from boost_jax.parallel.remat import REMAT_POLICIES  # lazy: keeps --help free of JAX

    if bad := [r for r in a.remat.split(",") if r not in REMAT_POLICIES]:
        raise ConfigError(f"--remat: unknown {bad}; choose from {list(REMAT_POLICIES)}")
    if bad := [s for s in a.schemes.split(",") if s and s not in SCHEMES]:
        raise ConfigError(f"--schemes: unknown {bad}; choose from {list(SCHEMES)}")
    for flag, sizes in (("--tp", a.tp), ("--pp", a.pp), ("--cp", a.cp)):
        if bad := [n for n in sizes if n < 1 or a.gpus % n]:
            raise ConfigError(f"{flag} {','.join(map(str, bad))}: each size must divide --gpus {a.gpus}")
    if bad := [n for n in a.pp_repeats if n < 1]:
        raise ConfigError(f"--pp-repeats {','.join(map(str, bad))}: each must be at least 1")
    if a.pp and max(a.pp) == 1 and a.pp_repeats and max(a.pp_repeats) > 1:
        raise ConfigError("--pp-repeats > 1 applies to pipelines: give --pp sizes above 1, or leave --pp-repeats")
    a.pp_repeats = a.pp_repeats or (1, 2)
    if a.out:
        check_writable_file(a.out, "--out")
    return a


def check_no_layout_keys(args: list[str]) -> None:
    """The layout keys are what the planner chooses: given in the config, they are refused by name."""
    from boost_jax.planner.layouts import LAYOUT_KEYS  # lazy: keeps --help free of JAX

    raw = raw_args(args)
    given = [k for k in LAYOUT_KEYS if k.split(".")[1] in (raw.get(k.split(".")[0]) or {})]
    if given:
        raise ConfigError(f"{', '.join(given)}: the planner chooses the layout keys {list(LAYOUT_KEYS)}; leave them "
                          "out of the config (narrow the search with --schemes, --tp, --pp, --pp-repeats, --remat)")


def _main(argv: list[str]) -> None:
    a = parse(argv)
    cfg = from_args(a.config)  # a bad config fails before JAX starts
    from boost_jax.launch.prepare import prepare_jax  # lazy: keeps --help free of JAX
    from boost_jax.planner.layouts import Space, enumerate_layouts  # lazy: keeps --help free of JAX

    space = Space(schemes=tuple(s for s in a.schemes.split(",") if s), tp=a.tp, pp=a.pp,
                  pp_repeats=a.pp_repeats, cp=a.cp, remat=tuple(a.remat.split(",")))
    hw = one_machine(a.hardware_file, a.hardware)
    # Compiles run on tp x pp x cp simulated devices (dp = fsdp = 1): request the most any layout
    # needs before JAX's backend starts.
    layouts = list(enumerate_layouts(cfg.model.arch, a.gpus, cfg.train.batch_size, cfg.train.seq_len,
                                     hw.gpus_per_node, space))
    if not layouts:
        raise ConfigError(no_layout(a, cfg, hw, []))
    devices = max(l.tp * l.pp * l.cp for l in layouts)
    prepare_jax(cfg, devices=devices, reuse_memory=False)  # compiles only
    from boost_jax.planner.price import DiskCache  # lazy: keeps --help free of JAX
    from boost_jax.planner.recipe import write_recipe  # lazy: keeps --help free of JAX
    from boost_jax.planner.search import rank_layouts  # lazy: keeps --help free of JAX
    from boost_jax.planner.workers import Workers, default_workers  # lazy: keeps --help free of JAX

    root = None if a.no_cache else cache_root(cfg.data.cache_dir) / "plan"
    log = lambda s: print(s, file=sys.stderr, flush=True)
    with Workers(a.workers or default_workers(), devices) as workers:
        cands = rank_layouts(a.config, gpus=a.gpus, hw=hw, space=space, headroom=a.headroom, cache=DiskCache(root), log=log,
                     max_priced=a.max_priced or None, workers=workers, overlap=a.overlap)
    priced = [c for c in cands if c.step]
    if not priced:
        raise ConfigError(no_layout(a, cfg, hw, cands))
    if a.out:
        write_recipe(a.out, a.config, priced[0].layout)
    if a.json:
        print(json.dumps({"overlap": a.overlap, "candidates": [c.row(hw, a.gpus) for c in priced]}, indent=1))
        return
    print_plan(a, cfg, hw, cands)


def no_layout(a: argparse.Namespace, cfg, hw, cands) -> str:
    """Why no layout could be priced: one example of each reason, or what no layout could divide."""
    if not cands:
        schemes = a.schemes or "every scheme"
        return (f"no layout of {a.gpus} x {hw.name} for arch {cfg.model.arch} under {schemes}: either no scheme given "
                f"takes the arch, or train.batch_size={cfg.train.batch_size} does not divide over the dp x fsdp "
                "devices any --tp/--pp/--cp leaves; change --gpus, the batch or the search flags")
    first = {}
    for c in cands:
        first.setdefault(c.why.split(":")[0], c)
    examples = "; ".join(f"{c.layout}: {c.why}" for c in first.values())
    return f"no layout of {a.gpus} x {hw.name} could be priced ({len(cands)} considered). {examples}"


def print_plan(a: argparse.Namespace, cfg, hw, cands) -> None:
    priced = [c for c in cands if c.step]
    nodes = math.ceil(a.gpus / hw.gpus_per_node)
    m, t = cfg.model, cfg.train
    print(f"{shape_name(m)} {m.arch} on {a.gpus} x {hw.name} ({nodes} node{'s' * (nodes > 1)}), global batch "
          f"{t.batch_size} x {t.seq_len} tokens, {m.dtype}; memory budget {hw.hbm_bytes * (1 - a.headroom) / GIB:.1f} GiB "
          f"per GPU ({100 * a.headroom:.0f}% headroom)")
    print(f"{len(cands)} layouts: {sum(c.cfg is None for c in cands)} do not divide, "
          f"{sum(c.memory is not None and not c.fits for c in cands)} do not fit, {len(priced)} priced\n")
    print(f"{'#':>2s} {'scheme':8s} {'tp':>3s} {'pp':>3s} {'R':>2s} {'dp':>3s} {'fsdp':>4s} {'cp':>3s} {'M':>4s} {'remat':8s} "
          f"{'s/iter':>8s} {'tok/s/GPU':>10s} {'MFU':>6s} {'GiB/GPU':>8s}  why not first")
    for i, c in enumerate(priced[:a.top]):
        r, l = c.row(hw, a.gpus), c.layout
        print(f"{i + 1:2d} {l.scheme:8s} {l.tp:3d} {l.pp:3d} {l.pp_repeats:2d} {l.dp:3d} {l.fsdp:4d} {l.cp:3d} {l.microbatches:4d} "
              f"{l.remat:8s} {r['step_s']:8.3g} {r['tokens_per_s_per_gpu']:10.0f} {100 * r['mfu']:5.1f}% "
              f"{r['memory_bytes_per_gpu'] / GIB:8.3g}  {c.why or '-'}")
    losers = [c for c in cands if not c.step]
    if losers:
        print("\nWhy the others lost (one of each reason, and how many lost for it):")
        kinds: dict[str, list] = {}
        for c in losers:  # a reason's kind: its words, numbers aside
            kinds.setdefault(re.sub(r"\d[\w.+-]*", "#", c.why)[:48], []).append(c)
        for same in kinds.values():
            print(f"  {len(same):4d} x  {same[0].layout}: {same[0].why}")
    print("\nPriced on abstract compiles at dp = fsdp = 1 (data-parallel and FSDP collectives added analytically; "
          "without a pipeline, M micro-batches = M x one); "
          + ("communication overlap assumed (--overlap: the backward's TP all-reduces behind their weight-gradient GEMMs, "
             "the data-parallel all-reduce behind the backward)." if a.overlap else
             "no communication overlap assumed (--overlap assumes it)."))
    if a.out:
        print(f"wrote {a.out}: python -m boost_jax.train {a.out}")


if __name__ == "__main__":
    main()
