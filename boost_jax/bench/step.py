"""`bench step [CONFIG.yaml] [section.key=value ...]`: measured train-step time, tokens/s and
per-device peak memory on this machine, for the config as `train` would run it (a planner's recipe
as is: `bench step recipe.yaml`).

`--compare` builds dense/megatron, <arch>/vanilla and <arch>/btp of the same config and times them
in interleaved repetitions (so machine noise hits all three alike), then prints the ratios;
`--vary section.key=V1,V2,...` does the same for any config key's values, each variant's time also
as a ratio to the first's (`--vary parallel.cp=1,2,4`: the cost of context parallelism here;
`--vary train.optimizer=adamw,muon,spectron`: each optimizer's added time and share of the step,
beside what its Newton-Schulz FLOPs predict at the adamw step's own rate).
`--hf` times, in the same interleaved repetitions, the training step a PyTorch user would write for
the (first) config's dense LLaMA in Hugging Face transformers, on the same initial weights and batch
(`boost_jax/bench/hf.py`), and prints both sides' first and last losses: the two train the same model.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence

import jax
import numpy as np

from boost_jax.analysis.program import peak_bytes
from boost_jax.bench import hf
from boost_jax.bench.common import add_vary, config_of, parse, parser, variants
from boost_jax.config import Config, ConfigError
from boost_jax.launch.peaks import datasheet_peak_flops, measure_matmul_peak
from boost_jax.model.counts import count
from boost_jax.parallel import make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.runtime.units import MIB
from boost_jax.training.optimizers import newton_schulz_flops
from boost_jax.training.step import batch_keys, device_batch, setup


class Runner:
    """One config's compiled train step with its own state and a fixed random batch."""

    def __init__(self, cfg: Config):
        plan = make_plan(cfg, mesh_devices(cfg.parallel))
        run, self.state = setup(cfg, plan)
        self.mesh_shape = dict(plan.mesh.shape)
        t = cfg.train
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len), np.int32)
        # With data.document_mask: one document per row (the mask's cost, not a particular corpus's).
        # Instruction data's: every position a target of weight 1, positions 0.. (one document a row).
        filled = {"segment_ids": np.zeros_like(tokens), "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32),
                                                                                     tokens.shape),
                  "weights": np.ones(tokens.shape, np.float32)}
        self.host_batch = {k: filled.get(k, tokens) for k in batch_keys(cfg)}
        self.batch = device_batch(self.host_batch, run.batch_sharding)
        self.compiled = run.train_step.lower(self.state, self.batch).compile()
        self.cfg, self.tokens, self.peak = cfg, t.batch_size * t.seq_len, peak_bytes(self.compiled)
        self.times: list[float] = []
        self.steps(1)
        self.first_loss = float(self.metrics["loss"])  # of the initial weights (`--hf` compares it)
        self.steps(1)  # warm up

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.state, self.metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready(self.metrics)
        return (time.perf_counter() - t0) / n

    def result(self) -> dict:
        med = statistics.median(self.times)
        m, p, mesh = self.cfg.model, self.cfg.parallel, self.mesh_shape
        flops = count(m, self.cfg.train.seq_len).train_flops_per_token * self.tokens
        return {"model": m.preset, "arch": m.arch, "scheme": p.scheme, "tp": mesh["tp"], "dp": mesh["dp"],
                "fsdp": mesh["fsdp"], "pp": mesh["pp"], "cp": mesh["cp"],
                "batch": self.cfg.train.batch_size, "seq": self.cfg.train.seq_len, "dtype": m.dtype,
                "median_step_s": med, "step_times_s": self.times, "tokens_per_s": self.tokens / med,
                "model_flops_per_s": flops / med,  # analytic training FLOPs (model/counts.py), all devices together
                "peak_bytes_per_device": self.peak, "first_loss": self.first_loss,
                "last_loss": float(self.metrics["loss"]), "optimizer": self.cfg.train.optimizer,
                "newton_schulz_flops": newton_schulz_flops(self.cfg.train, self.state["params"])}


def optimizer_overheads(results: list[dict]) -> list[str]:
    """Beside the first variant (AdamW), each Muon-family variant's added step time, measured and as
    its Newton-Schulz FLOPs would cost at the first variant's own rate (training FLOPs / step time):
    the orthogonalisation runs as GEMMs when the two agree."""
    base = results[0]
    if base.get("optimizer") != "adamw":
        return []
    lines = []
    for r in results[1:]:
        if r.get("newton_schulz_flops"):
            measured = r["median_step_s"] - base["median_step_s"]
            predicted = r["newton_schulz_flops"] / base["model_flops_per_s"]
            r["optimizer_overhead_s"], r["predicted_optimizer_overhead_s"] = measured, predicted
            lines.append(f"{r['variant'] or r['optimizer']}: {r['optimizer']} adds {1e3 * measured:.1f} ms per step "
                         f"({100 * measured / r['median_step_s']:.0f}% of it); its Newton-Schulz "
                         f"{r['newton_schulz_flops'] / 1e9:.2f} GFLOP at adamw's step rate "
                         f"({base['model_flops_per_s'] / 1e9:.1f} GFLOP/s) predict {1e3 * predicted:.1f} ms "
                         f"(measured / predicted {measured / predicted:.2f})")
    return lines


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
        n = 1 if dev.platform == "cpu" else math.prod(runner.mesh_shape.values())
        r["fraction_of_peak"] = r["model_flops_per_s"] / (peak * n)
        if sheet:
            r["mfu"] = r["model_flops_per_s"] / (sheet * n)
    return results, peak


def compare_configs(args: Sequence[str]) -> list[Config]:
    """dense/megatron, <arch>/vanilla and <arch>/btp of one config (its arch: the low-rank one compared)."""
    arch = config_of(args).model.arch
    if arch == "dense":
        raise ConfigError("--compare sets the arch of each variant: give the low-rank one (model.arch=cola, svd or lax)")
    return [config_of(args, "model.arch=dense", "parallel.scheme=megatron"),
            config_of(args, "parallel.scheme=vanilla"), config_of(args, "parallel.scheme=btp")]


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench step", __doc__)
    p.add_argument("--compare", action="store_true", help="dense/megatron vs <arch>/vanilla vs <arch>/btp")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (the median is reported)")
    p.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    p.add_argument("--hf", action="store_true",
                   help="also time the same dense LLaMA's training step in Hugging Face transformers + PyTorch "
                        "(same weights and batch; needs torch and transformers)")
    add_vary(p)
    a = parse(p, argv)
    if a.reps < 1 or a.steps < 1:
        raise ConfigError(f"--reps and --steps must be at least 1, got {a.reps} and {a.steps}")
    if a.compare and a.vary:
        raise ConfigError("--compare and --vary each make the variants: give one")
    labelled = variants(a.config, a.vary) if not a.compare else [("", c) for c in compare_configs(a.config)]
    cfgs = [c for _, c in labelled]
    if a.hf:
        hf.check_train(cfgs[0])
    runners = [Runner(c) for c in cfgs]
    if a.hf:  # timed beside the others, on the first one's weights and batch
        runners.append(hf.TrainStep(cfgs[0], runners[0].host_batch["inputs"], runners[0].host_batch["targets"]))
        labelled.append((hf.NAME, cfgs[0]))
    results, peak = measure_with_peak(runners, a.reps, a.steps)
    for r, (label, _) in zip(results, labelled):
        r["variant"] = label
        r["time_vs_first"] = r["median_step_s"] / results[0]["median_step_s"]
    overheads = optimizer_overheads(results)
    sheet = datasheet_peak_flops(jax.devices()[0], cfgs[0].model.dtype)
    if a.compare:
        dense, vanilla, btp = (r["median_step_s"] for r in results[:3])
        ratios = {"btp_speedup_vs_dense": dense / btp, "btp_speedup_vs_vanilla": vanilla / btp,
                  "vanilla_speedup_vs_dense": dense / vanilla}
    if a.json:
        print(json.dumps({"matmul_peak_flops_per_s": peak, "datasheet_peak_flops_per_s": sheet, "results": results,
                          **({"ratios": ratios} if a.compare else {})}, indent=1))
        return
    mfu_head = f" {'MFU':>6s}" if sheet else ""
    width = max(24, *(len(r["variant"]) + 2 for r in results))
    print(f"{'variant':{width}s} {'median ms':>10s} {'x first':>8s} {'tokens/s':>10s} {'of peak':>8s}{mfu_head} "
          f"{'peak MiB/dev':>13s}   "
          f"({a.reps} reps x {a.steps} steps, {jax.devices()[0].device_kind}, matmul peak {peak / 1e9:,.1f} GFLOP/s"
          + (f", datasheet {sheet / 1e12:,.0f} TFLOP/s)" if sheet else ")"))
    for r in results:
        name = r["variant"] or f"{r['arch']}/{r['scheme']} tp={r['tp']}"
        mfu = f" {100 * r['mfu']:5.1f}%" if sheet else ""
        peak_mib = f"{r['peak_bytes_per_device'] / MIB:13.1f}" if r["peak_bytes_per_device"] else f"{'-':>13s}"
        print(f"{name:{width}s} {1e3 * r['median_step_s']:10.1f} {r['time_vs_first']:7.2f}x {r['tokens_per_s']:10,.0f} "
              f"{100 * r['fraction_of_peak']:7.1f}%{mfu} {peak_mib}")
    if a.hf:
        ours, theirs = results[0], results[-1]
        print(f"{hf.NAME} (transformers {theirs['transformers']}, torch {theirs['torch']}, {theirs['threads']} threads): "
              f"its step takes {theirs['median_step_s'] / ours['median_step_s']:.2f}x boost_jax's; the same weights, batch "
              f"and optimizer: loss {ours['first_loss']:.5f} -> {ours['last_loss']:.5f} (boost_jax), "
              f"{theirs['first_loss']:.5f} -> {theirs['last_loss']:.5f}")
    for line in overheads:
        print(line)
    if a.compare:
        print("  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
