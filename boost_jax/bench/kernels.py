"""`bench kernels [CONFIG.yaml] [section.key=value ...]`: the Pallas kernels against their XLA twins,
forward, at one tensor-parallel rank's BTP shapes.

With a config, the shapes are one `parallel.tp` rank of its model (k = d/tp, n = 3r, r = the
attention rank, m = heads x head_dim / tp, T = a data-parallel replica's tokens, the compute dtype).
Without one, the flags give them; their defaults are one rank of LLaMA-7B at b=4, s=4096, p=4,
r=1024, bf16:
norm_down x [16384, 1024] @ a [1024, 3072] (the grouped q|k|v down-projection) and
grouped_matmul z [3, 16384, 1024] @ b [3, 1024, 1024] (B_q, B_k, B_v up-projections).
Repetitions of pallas and xla are interleaved (clock and thermal drift hit both) and the median
is reported. The backward is shared XLA code, so only the forward is timed. On CPU the kernels
run in interpret mode (orders of magnitude slower): use --small there, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from boost_jax.config import Config, ConfigError, from_args
from boost_jax.runtime.cli import CONFIG_HELP, at_least, refuse_retired_flags
from pallas_kernels import grouped_matmul, norm_down

IMPLS = ("pallas", "xla")
SMALL = {"tokens": 256, "k": 128, "n": 384, "c": 3, "r": 128, "m": 128}
CPU_FLOP_LIMIT = 2e9  # beyond this, interpret mode on CPU is a long wait


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m boost_jax.bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="*", metavar="[CONFIG.yaml] [section.key=value ...]",
                   help=f"{CONFIG_HELP}; the shapes of one parallel.tp rank of its model")
    p.add_argument("--kernel", default="all", choices=["all", "norm_down", "grouped_matmul"])
    p.add_argument("--small", action="store_true", help=f"tiny shapes {SMALL} (CPU smoke test)")
    p.add_argument("--tokens", type=int, default=4 * 4096, help="T = b*s tokens per rank")
    p.add_argument("--k", type=int, default=4096 // 4, help="norm_down: local d/p")
    p.add_argument("--n", type=int, default=3 * 1024, help="norm_down: grouped 3r (or 2r)")
    p.add_argument("--c", type=int, default=3, help="grouped_matmul: number of groups")
    p.add_argument("--r", type=int, default=1024, help="grouped_matmul: rank")
    p.add_argument("--m", type=int, default=4096 // 4, help="grouped_matmul: local output width")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="without a config")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    refuse_retired_flags(argv, keep=("--dtype",))
    a = p.parse_intermixed_args(argv)
    if a.small and a.config:
        raise ConfigError("--small and a config both give the shapes: pass one")
    at_least(a, reps=1, tokens=1, k=1, n=1, c=1, r=1, m=1)
    if a.small:
        vars(a).update(SMALL)
    if a.config:
        vars(a).update(model_shapes(from_args(a.config)))
    return a


def model_shapes(cfg: Config) -> dict:
    """norm_down's T, k, n and grouped_matmul's r, m for one `parallel.tp` rank of the config's model."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.d_model % p.tp or (m.n_heads * m.head_dim) % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide {m.preset}'s d_model {m.d_model} and heads")
    replicas = max(p.dp, 1) * p.fsdp
    return {"tokens": t.batch_size // replicas * t.seq_len, "k": m.d_model // p.tp, "n": 3 * m.attn_rank,
            "r": m.attn_rank, "m": m.n_heads * m.head_dim // p.tp, "dtype": m.dtype}


def cases(a: argparse.Namespace) -> list[dict]:
    """Each kernel's callables, inputs and the work it does (GEMM flops, compulsory bytes)."""
    dt = jnp.dtype(a.dtype)
    size = jnp.dtype(dt).itemsize
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    out = []
    if a.kernel in ("all", "norm_down"):
        t, k, n = a.tokens, a.k, a.n
        args = (jax.random.normal(k1, (t, k), dt), 1 + 0.1 * jax.random.normal(k2, (k,), dt),
                jax.random.normal(k3, (k, n), dt) * k**-0.5)
        out.append({"kernel": "norm_down", "shape": {"T": t, "k": k, "n": n}, "args": args,
                    "fn": lambda impl: lambda x, g, w: norm_down(x, g, w, eps=1e-6, d_total=4 * k, impl=impl),
                    "flops": 2 * t * k * n, "bytes": (t * k + k + k * n) * size + (t * n + t) * 4})
    if a.kernel in ("all", "grouped_matmul"):
        c, t, r, m = a.c, a.tokens, a.r, a.m
        args = (jax.random.normal(k4, (c, t, r), dt), jax.random.normal(k5, (c, r, m), dt) * r**-0.5)
        out.append({"kernel": "grouped_matmul", "shape": {"c": c, "T": t, "r": r, "m": m}, "args": args,
                    "fn": lambda impl: lambda z, w: grouped_matmul(z, w, impl=impl),
                    "flops": 2 * c * t * r * m, "bytes": c * (t * r + r * m + t * m) * size})
    return out


def time_case(case: dict, reps: int) -> dict:
    fns = {impl: jax.jit(case["fn"](impl)) for impl in IMPLS}
    for f in fns.values():  # compile and warm up
        jax.block_until_ready(f(*case["args"]))
    times = {impl: [] for impl in IMPLS}
    for _ in range(reps):
        for impl, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*case["args"]))
            times[impl].append(time.perf_counter() - t0)
    result = {"kernel": case["kernel"], "shape": case["shape"], "flops": case["flops"], "bytes": case["bytes"]}
    for impl, ts in times.items():
        sec = statistics.median(ts)
        result[impl] = {"ms": sec * 1e3, "tflops": case["flops"] / sec / 1e12, "gbps": case["bytes"] / sec / 1e9}
    result["pallas_over_xla_time"] = result["pallas"]["ms"] / result["xla"]["ms"]
    return result


def main(argv: list[str]) -> None:
    a = parse(argv)
    backend, todo = jax.default_backend(), cases(a)
    if backend == "cpu" and (big := [c["kernel"] for c in todo if c["flops"] > CPU_FLOP_LIMIT]):
        sys.exit(f"{', '.join(big)}: too big for Pallas interpret mode on CPU; "
                 "pass --small or smaller --tokens/--k/--n/--r/--m, or run on a GPU")
    results = [time_case(c, a.reps) for c in todo]
    report = {"backend": backend, "device": str(jax.devices()[0]), "dtype": a.dtype, "reps": a.reps,
              "interpret": backend == "cpu", "results": results}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    mode = " (Pallas in interpret mode: timings mean nothing)" if report["interpret"] else ""
    print(f"{report['device']} {a.dtype}, median of {a.reps}{mode}")
    print(f"{'kernel':<15} {'shape':<28} {'impl':<7} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8}")
    for r in results:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        for impl in IMPLS:
            s = r[impl]
            print(f"{r['kernel']:<15} {shape:<28} {impl:<7} {s['ms']:9.3f} {s['tflops']:8.2f} {s['gbps']:8.1f}")
        print(f"{'':<15} {'':<28} pallas/xla time {r['pallas_over_xla_time']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
