"""`bench step`: measured train-step time, tokens/s and per-device peak memory on this machine.

`--compare` builds dense/megatron, <arch>/vanilla and <arch>/btp and times them in interleaved
repetitions (so machine noise hits all three alike), then prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from boost_jax.analysis.program import config_for, peak_bytes
from boost_jax.bench.common import add_model_flags, bench_config
from boost_jax.config import Config
from boost_jax.flops import count, datasheet_peak_flops, measure_matmul_peak
from boost_jax.parallel import make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.step import device_batch, setup


class Runner:
    """One config's compiled train step with its own state and a fixed random batch."""

    def __init__(self, cfg: Config):
        run, self.state = setup(cfg, make_plan(cfg, mesh_devices(cfg.parallel)))
        t = cfg.train
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len), np.int32)
        self.batch = device_batch({"inputs": tokens, "targets": tokens}, run.batch_sharding)
        self.compiled = run.train_step.lower(self.state, self.batch).compile()
        self.cfg, self.tokens, self.peak = cfg, t.batch_size * t.seq_len, peak_bytes(self.compiled)
        self.times: list[float] = []
        self.steps(2)  # warm up

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - t0) / n

    def result(self) -> dict:
        med = statistics.median(self.times)
        m, p = self.cfg.model, self.cfg.parallel
        flops = count(m, self.cfg.train.seq_len).train_flops_per_token * self.tokens
        return {"model": m.preset, "arch": m.arch, "scheme": p.scheme, "tp": p.tp, "dp": p.dp,
                "batch": self.cfg.train.batch_size, "seq": self.cfg.train.seq_len, "dtype": m.dtype,
                "median_step_s": med, "step_times_s": self.times, "tokens_per_s": self.tokens / med,
                "model_flops_per_s": flops / med,  # analytic training FLOPs (flops.py), all devices together
                "peak_bytes_per_device": self.peak}


def time_runners(runners: list[Runner], reps: int, steps: int) -> list[dict]:
    for _ in range(reps):
        for r in runners:  # interleaved: each repetition times every variant once
            r.times.append(r.steps(steps))
    return [r.result() for r in runners]


def measure(cfgs: list[Config], reps: int, steps: int) -> list[dict]:
    return time_runners([Runner(c) for c in cfgs], reps, steps)


def measure_with_peak(runners: list[Runner], reps: int, steps: int) -> tuple[list[dict], float]:
    """`time_runners`, bracketed by the 2048^3 matmul probe (`flops.measure_matmul_peak`, best of before
    and after: noise only slows); each result gets its model FLOP/s as a `fraction_of_peak` of the
    devices it ran on (simulated CPU devices share one host, so there the host's peak), and on an
    accelerator in `flops.PEAK_BF16_FLOPS` its `mfu` against the datasheet peak."""
    dtype = runners[0].cfg.model.dtype
    before = measure_matmul_peak(dtype)
    results = time_runners(runners, reps, steps)
    peak = max(before, measure_matmul_peak(dtype))
    dev = jax.devices()[0]
    sheet = datasheet_peak_flops(dev, dtype)
    for r, runner in zip(results, runners):
        n = 1 if dev.platform == "cpu" else len(mesh_devices(runner.cfg.parallel))
        r["fraction_of_peak"] = r["model_flops_per_s"] / (peak * n)
        if sheet:
            r["mfu"] = r["model_flops_per_s"] / (sheet * n)
    return results, peak


def compare_configs(model: str, arch: str, **knobs) -> list[Config]:
    """dense/megatron, <arch>/vanilla and <arch>/btp at the same knobs (`analysis.program.config_for`)."""
    return [config_for(model, "dense", "megatron", **knobs), config_for(model, arch, "vanilla", **knobs),
            config_for(model, arch, "btp", **knobs)]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m boost_jax.bench step", description=__doc__)
    add_model_flags(p)
    p.set_defaults(model="llama-60m", batch=4, seq=256, dtype="fp32")
    p.add_argument("--compare", action="store_true", help="dense/megatron vs <arch>/vanilla vs <arch>/btp")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    a = p.parse_args(argv)
    knobs = dict(tp=a.tp, dp=a.dp, batch=a.batch, seq=a.seq, dtype=a.dtype, overrides=a.overrides)
    cfgs = compare_configs(a.model, a.arch, **knobs) if a.compare else [bench_config(a)]
    results, peak = measure_with_peak([Runner(c) for c in cfgs], a.reps, a.steps)
    sheet = datasheet_peak_flops(jax.devices()[0], cfgs[0].model.dtype)
    if a.compare:
        dense, vanilla, btp = (r["median_step_s"] for r in results)
        ratios = {"btp_speedup_vs_dense": dense / btp, "btp_speedup_vs_vanilla": vanilla / btp,
                  "vanilla_speedup_vs_dense": dense / vanilla}
    if a.json:
        print(json.dumps({"matmul_peak_flops_per_s": peak, "datasheet_peak_flops_per_s": sheet, "results": results,
                          **({"ratios": ratios} if a.compare else {})}, indent=1))
        return
    mfu_head = f" {'MFU':>6s}" if sheet else ""
    print(f"{'variant':24s} {'median ms':>10s} {'tokens/s':>10s} {'of peak':>8s}{mfu_head} {'peak MiB/dev':>13s}   "
          f"({a.reps} reps x {a.steps} steps, {jax.devices()[0].device_kind}, matmul peak {peak / 1e9:,.1f} GFLOP/s"
          + (f", datasheet {sheet / 1e12:,.0f} TFLOP/s)" if sheet else ")"))
    for r in results:
        name = f"{r['arch']}/{r['scheme']} tp={r['tp']}"
        mfu = f" {100 * r['mfu']:5.1f}%" if sheet else ""
        print(f"{name:24s} {1e3 * r['median_step_s']:10.1f} {r['tokens_per_s']:10,.0f} "
              f"{100 * r['fraction_of_peak']:7.1f}%{mfu} {r['peak_bytes_per_device'] / 2**20:13.1f}")
    if a.compare:
        print("  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
