"""python -m boost_jax.compile [CONFIG.yaml] [section.key=value ...] --hardware NAME [--nodes N | --gpus N]
[--only PROGRAM,...] [--json] [--save DIR [--force]]

Compiles every program a run executes (the train step exactly as `train` builds it, the eval step,
on a layout that decodes the prefill and the decode loop, and with parallel.dp=1 parallel.fsdp=1 the
server's paged decode, `serve_decode`, as `python -m boost_jax.serve` runs it: `serve.slots` rows over
the pool `serve.*` sizes) with XLA's GPU compiler for N nodes of
NAME (boost_jax/configs/hardware.yaml), on this machine, with no GPU: a deviceless compile through
JAX's CUDA plugin (`pip install -e '.[gpu-compile]'`). Prints per program and per device the compiled
memory beside the memory model's prediction, the collectives per step (kind, count, bytes), the
decoder layers' collective bytes beside the scheme's formulas, the library calls and generated kernels
(cuDNN attention, cuBLAS, Triton), and the compile time. A program that does not fit the GPU's memory
is named and the command exits 1. --save DIR writes each program's optimised HLO, its serialised
executable where JAX can serialise it, and a manifest, which scripts/gpu_check.sh reads on a real GPU
(DIR is checked before compiling: a folder it can write, empty unless --force).
What a deviceless compile cannot do: autotune GEMMs (XLA's default tiles), size cuDNN's workspace, or
time anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
from pathlib import Path

from boost_jax.config import from_args
from boost_jax.config.archs import AUTO_CACHE, CACHE_KINDS
from boost_jax.config.hardware import one_machine
from boost_jax.runtime.cli import config_parser, refuse_retired_flags, run_main
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.paths import check_out_dir
from boost_jax.runtime.units import GIB, MIB

PROGRAMS = ("train_step", "eval_step", "prefill", "decode", "serve_decode")  # analysis/compiled.py's run_programs


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    p = config_parser("python -m boost_jax.compile", __doc__)
    p.add_argument("--hardware", required=True, help="one machine of the hardware file (a100-80gb, h100-80gb, ...)")
    p.add_argument("--hardware-file", default=None, help="default: boost_jax/configs/hardware.yaml")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the machine's gpus_per_node GPUs (default 1)")
    p.add_argument("--gpus", type=int, default=0, help="fewer GPUs of one node (default 0: whole nodes)")
    p.add_argument("--cache", default=AUTO_CACHE, choices=[AUTO_CACHE, *CACHE_KINDS],
                   help="the KV cache of the decoding programs (auto: as generate, the fastest modelled step)")
    p.add_argument("--only", default="", metavar="PROGRAM,...",
                   help=f"compile only these of the run's programs ({', '.join(PROGRAMS)})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", type=Path, default=None, help="write the serialised executables here (an empty folder)")
    p.add_argument("--force", action="store_true", help="--save into a non-empty folder, replacing its files")
    refuse_retired_flags(argv)
    a = p.parse_intermixed_args(argv)
    a.only = tuple(n for n in a.only.split(",") if n)
    if bad := [n for n in a.only if n not in PROGRAMS]:
        raise ConfigError(f"--only: unknown program {bad[0]!r}; choose from {', '.join(PROGRAMS)}")
    if a.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {a.nodes}")
    if a.save is not None:
        check_out_dir(a.save, "--save", a.force)  # before the compiles, which take minutes
    elif a.force:
        raise ConfigError("--force applies to --save DIR, which is not given")
    return a


def _main(argv: list[str]) -> None:
    a = parse(argv)
    hw = one_machine(a.hardware_file, a.hardware)
    cfg = from_args(a.config)
    from boost_jax.launch.gpu_target import target_config, use_cpu_backend  # lazy: keeps --help free of JAX

    target_config(hw)  # a machine without a compile target is refused before JAX starts
    use_cpu_backend()
    from boost_jax.launch.prepare import prepare_jax  # lazy: keeps --help free of JAX

    prepare_jax(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, compile_cache=False)), reuse_memory=False)
    result = compile_run(cfg, hw, a.nodes, a.cache, a.gpus, a.only)
    compiled = result.pop("_compiled")
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result)
    too_big = [p for p in result["programs"] if p["memory"]["peak"] > hw.hbm_bytes]
    if too_big:
        names = ", ".join(f"{p['name']} ({p['memory']['peak'] / GIB:.2f} GiB)" for p in too_big)
        sys.exit(f"does not fit: {names} per device, over the {hw.hbm_bytes / GIB:.2f} GiB of a {hw.name}")
    if a.save is not None:
        save(a.save, result, compiled)


def compile_run(cfg, hw, nodes: int, cache: str = "auto", gpus: int = 0, only: tuple[str, ...] = ()) -> dict:
    """Every program of `cfg`'s run (or those named in `only`) compiled for `nodes` nodes of `hw`, or `gpus` GPUs of one (JAX on the
    CPU, the CUDA plugin installed): one report each (analysis/compiled.py), the memory model's figure beside the train
    step's, and the executables themselves under "_compiled" (for --save); `only`: those programs alone."""
    from boost_jax.analysis.compiled import compile_all  # lazy: keeps --help free of JAX
    from boost_jax.launch.gpu_target import gpu_devices  # lazy: keeps --help free of JAX

    devices = gpu_devices(hw, nodes, gpus)
    plan, programs, compiled = compile_all(cfg, devices, cache, only)
    m = cfg.model
    return {"hardware": hw.name, "devices": len(devices), "nodes": nodes, "mesh": dict(plan.mesh.shape),
            "model": m.preset, "arch": m.arch, "scheme": cfg.parallel.scheme, "dtype": m.dtype, "cache": cache,
            "n_layers": m.n_layers, "attn_latent_heads": m.attn_latent_heads, "attn_rope_dims": m.attn_rope_dims,
            "attention": plan.attention, "attention_why": plan.attention_why, "kernels": m.kernels, "batch": cfg.train.batch_size,
            "seq": cfg.train.seq_len, "programs": programs, "_compiled": compiled}


def print_result(r: dict) -> None:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "one device"
    why = f" ({r['attention_why']})" if r["attention_why"] else ""
    print(f"{r['model']} {r['arch']}/{r['scheme']} {r['dtype']}, batch {r['batch']} x {r['seq']}, attention "
          f"{r['attention']}{why}, kernels {r['kernels']}: compiled by XLA:GPU for {r['nodes']} x {r['hardware']} "
          f"({r['devices']} GPUs, {mesh}); per device:")
    for p in r["programs"]:
        mem = p["memory"]
        model = f", memory model {p['model_memory'] / MIB:,.0f} MiB ({p['model_memory'] / mem['peak']:.2f}x)" \
            if p.get("model_memory") else ""
        print(f"\n{p['name']}: compiled in {p['compile_s']:.1f} s; peak {mem['peak'] / MIB:,.0f} MiB (arguments "
              f"{mem['argument'] / MIB:,.0f}, outputs {mem['output'] / MIB:,.0f}, aliased {mem['alias'] / MIB:,.0f}, "
              f"temp {mem['temp'] / MIB:,.0f}){model}")
        kinds = ", ".join(f"{k} {v['count']} ({v['bytes'] / MIB:,.2f} MiB)" for k, v in p["collectives"].items())
        print(f"  collectives per step: {kinds or 'none'}")
        if p["conditional_collectives"]:
            kinds = ", ".join(f"{k} {v['count']} ({v['bytes'] / MIB:,.2f} MiB)"
                              for k, v in p["conditional_collectives"].items())
            print(f"  and on the steps that take a conditional's branch (log.health on logging steps): {kinds}")
        if (analytic := p["analytic_collective_bytes"]) is not None:
            passes = "forward and backward" if p["name"] == "train_step" else "forward"
            got = p["layer_collective_bytes"]
            print(f"  per decoder layer over tp, {passes}: {got / MIB:,.3f} MiB = {got / analytic:.3f}x the scheme's "
                  f"formula, {analytic / MIB:,.3f} MiB")
        if work := p.get("step_work"):
            print(f"  a step of the decode loop: {work['flops'] / 1e9:,.2f} GFLOP, its GEMMs read "
                  f"{work['gemm_read_bytes'] / MIB:,.1f} MiB, memory-bound instructions move "
                  f"{work['memory_bound_bytes'] / MIB:,.1f} MiB (analysis/work.step_work)")
        calls = ", ".join(f"{k} {n}" for k, n in p["custom_calls"].items())
        print(f"  library calls and generated kernels: {calls or 'none'}")


def save(folder: Path, result: dict, compiled: dict) -> None:
    """Each program's optimised HLO as <program>.hlo.txt and, where JAX can serialise it
    (jax.experimental.serialize_executable), the executable as <program>.bin with its argument and
    result trees as <program>.trees (pickled: a PyTreeDef has no other form); manifest.json is this
    command's report with, per program, the executable's file or why there is none. A program with
    cuDNN's attention has none today: its custom partitioner's callbacks cannot be pickled."""
    from jax.experimental.serialize_executable import serialize  # lazy: keeps --help free of JAX

    folder.mkdir(parents=True, exist_ok=True)
    for report in result["programs"]:
        name, executable = report["name"], compiled[report["name"]]
        (folder / f"{name}.hlo.txt").write_text(executable.as_text())
        try:
            payload, in_tree, out_tree = serialize(executable)
            trees = pickle.dumps((in_tree, out_tree))
        except (AttributeError, TypeError, pickle.PicklingError) as e:  # what pickle raises for a local object
            report["executable"], report["not_serialised"] = None, f"{type(e).__name__}: {e}"
            continue
        (folder / f"{name}.bin").write_bytes(payload)
        (folder / f"{name}.trees").write_bytes(trees)
        report["executable"] = f"{name}.bin"
    (folder / "manifest.json").write_text(json.dumps(result, indent=1))
    saved = [p["name"] for p in result["programs"] if p["executable"]]
    print(f"saved in {folder}: every program's optimised HLO, the executables of {', '.join(saved) or 'none'}, "
          "manifest.json", file=sys.stderr)


if __name__ == "__main__":
    main()
