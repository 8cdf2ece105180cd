"""Pricing a layout: seconds per iteration from the performance model, on one abstract compile of
the per-device program, cached in memory and on disk (a re-run of a plan compiles nothing).

What is compiled is what determines one device's program: scheme, tp, pp, pp_repeats, cp (and its
attention), remat, the rows of a micro-batch on a device and (under a pipeline) the micro-batch
count, at dp = fsdp = 1 on tp x pp x cp simulated devices with every layer of the model. Two things are then added analytically
and said so in the output: data-parallel gradient all-reduces (over dp) and FSDP's weight
all-gathers and gradient reduce-scatters (over fsdp), whose group sizes a dp = fsdp = 1 compile
cannot show; and without a pipeline, M micro-batches cost M times one (gradient accumulation
runs the same program M times).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from boost_jax.analysis.comm import pipeline_carry_width
from boost_jax.analysis.hlo import Collective, collectives
from boost_jax.analysis.memory_model import ANALYSIS_COMPILER_OPTIONS, LayerBytes, measure_layer
from boost_jax.analysis.perf_model import ADAMW_BYTES_PER_PARAM, Work, collective_seconds, gemm_seconds, predict
from boost_jax.analysis.program import build
from boost_jax.analysis.work import Gemm, Traffic, analyze
from boost_jax.config import Config
from boost_jax.config.hardware import Hardware, ring_seconds
from boost_jax.model.counts import count
from boost_jax.parallel import abstract_plan
from boost_jax.parallel.context import query_group
from boost_jax.planner.workers import Workers
from boost_jax.runtime.cache import atomic_write, digest
from boost_jax.training.muon_layout import chosen_ways


@functools.cache
def _source_digest() -> str:
    """boost_jax's own source (and its Pallas kernels): the model, its compile and the analysis all
    shape a cached value."""
    package = Path(__file__).parents[1]
    files = sorted(p for root in (package, package.parent / "pallas_kernels") for p in root.rglob("*.py"))
    return digest(*(p.read_text() for p in files))


class DiskCache:
    """JSON values under `root`, keyed by the tuple that determines them, the JAX version, any
    XLA_FLAGS (which can change the compiled program) and boost_jax's source (a value computed by
    other code is never reused: a stale entry once priced llama-1b with an older work analysis)."""

    def __init__(self, root: Path | None):
        self.root, self.memory = root, {}

    def _name(self, key: tuple) -> str:
        flags = os.environ.get("XLA_FLAGS", "")
        return digest(jax.__version__, _source_digest(), *([flags] if flags else []), *map(str, key))

    def _path(self, name: str) -> Path | None:
        return self.root / f"{name}.json" if self.root else None

    def has(self, key: tuple) -> bool:
        name = self._name(key)
        return name in self.memory or bool((path := self._path(name)) and path.is_file())

    def get(self, key: tuple, compute: Callable[[], object]):
        name = self._name(key)
        if name in self.memory:
            return self.memory[name]
        path = self._path(name)
        if path and path.is_file():
            self.memory[name] = json.loads(path.read_text())
            return self.memory[name]
        return self.put(key, compute())

    def put(self, key: tuple, value):
        """Keeps `value` (computed elsewhere, e.g. on a worker) under `key`; returns it."""
        name = self._name(key)
        if path := self._path(name):
            atomic_write(path, lambda f: f.write(json.dumps(value).encode()))
        self.memory[name] = value
        return value


def device_program(cfg: Config) -> Config:
    """cfg at dp = fsdp = 1 with one device's rows: the same per-device program on tp x pp x cp
    devices (without a pipeline, one micro-batch of it)."""
    p, t = cfg.parallel, cfg.train
    rows = t.batch_size // t.microbatches // (p.dp * p.fsdp)
    micro = t.microbatches if p.pp > 1 else 1
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=1, fsdp=1),
                               train=dataclasses.replace(t, batch_size=rows * micro, microbatches=micro))


def measure_work(cfg: Config) -> dict:
    """The compiled gradient program's work of a `device_program` config, as JSON-able lists
    (perf_model.Work's fields)."""
    prog = build(cfg)
    lowered = jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch)
    text = lowered.compile(ANALYSIS_COMPILER_OPTIONS).as_text()
    itemsize = jnp.dtype(cfg.model.dtype).itemsize
    gemms, traffic = analyze(text, seq=cfg.train.seq_len, itemsize=itemsize, query_block=cfg.model.attention_query_block,
                             cp=cfg.parallel.cp, group=query_group(prog.plan, cfg.model))
    return {"gemms": [dataclasses.asdict(g) for g in gemms], "traffic": [dataclasses.asdict(t) for t in traffic],
            "collectives": [dataclasses.asdict(c) for c in collectives(text)], "itemsize": itemsize,
            "params_per_device": prog.params_per_device}


def _tuples(x):
    """JSON's lists back to the tuples the dataclasses hold."""
    return tuple(map(_tuples, x)) if isinstance(x, list) else x


def _collective(raw: dict) -> Collective:
    return Collective(**{k: _tuples(v) for k, v in raw.items()})


def _work(raw: dict) -> Work:
    return Work([Gemm(**g) for g in raw["gemms"]], [Traffic(**t) for t in raw["traffic"]],
                [_collective(c) for c in raw["collectives"]], raw["itemsize"], raw["params_per_device"])


def program_key(cfg: Config) -> tuple:
    """What determines cfg's per-device program: the config of its `device_program`, which holds
    every knob that shapes the compile."""
    program_cfg = device_program(cfg)
    return "step", program_cfg.model, program_cfg.parallel, program_cfg.train


def compile_programs(cfgs: list[Config], cache: DiskCache, workers: Workers) -> int:
    """The per-device programs of `cfgs` not yet cached, compiled at once on `workers`; how many."""
    todo = {program_key(c): device_program(c) for c in cfgs if not cache.has(program_key(c))}
    for key, value in zip(todo, workers.map(measure_work, list(todo.values()))):
        cache.put(key, value)
    return len(todo)


def step_seconds(cfg: Config, hw: Hardware, param_elems: int, cache: DiskCache, overlap: bool = False) -> dict:
    """Predicted seconds per iteration of cfg's train step on `hw` and its parts; `param_elems`:
    the parameters on one device (the memory model's count, FSDP shards included). `overlap`: the
    performance model's (perf_model.predict), and the data-parallel gradient all-reduce running
    beside the backward pass, hidden up to its time (two thirds of the program's: dX and dW)."""
    p, t = cfg.parallel, cfg.train
    pred = predict(_work(cache.get(program_key(cfg), lambda: measure_work(device_program(cfg)))), hw, overlap)
    repeat = 1 if p.pp > 1 else t.microbatches
    parts = {"program": (pred["seconds"] - pred["parts"]["optimizer"]) * repeat, **_analytic_parts(cfg, hw, param_elems)}
    if overlap:
        parts["dp_all_reduce"] = max(0.0, parts["dp_all_reduce"] - 2 / 3 * parts["program"])
    return {"seconds": sum(parts.values()), "parts": parts}


def _analytic_parts(cfg: Config, hw: Hardware, param_elems: int) -> dict:
    """What a dp = fsdp = 1 compile cannot show, priced analytically: the optimizer's update (AdamW's
    HBM traffic, plus the Newton-Schulz GEMMs and collectives of train.optimizer=muon/spectron), the
    data-parallel gradient all-reduce and FSDP's weight all-gathers and gradient reduce-scatter."""
    p, t = cfg.parallel, cfg.train
    optimizer = param_elems * ADAMW_BYTES_PER_PARAM / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    grad_bytes = param_elems * jnp.dtype(cfg.model.param_dtype).itemsize
    # Mesh order pp, dp, fsdp, cp, tp (tp innermost): a group over fsdp spans fsdp x cp x tp
    # neighbouring devices, one over dp spans dp x fsdp x cp x tp. (Context parallelism's own
    # gradient all-reduce is in the compiled program, which keeps cp.)
    inner = p.cp * p.tp
    dp_s = ring_seconds("all-reduce", p.dp, grad_bytes, p.dp * p.fsdp * inner > hw.gpus_per_node, hw) if p.dp > 1 else 0.0
    fsdp_s = 0.0
    if p.fsdp > 1:  # each micro-batch gathers the weights forward and backward; gradients scatter once
        gathered = param_elems * p.fsdp * jnp.dtype(cfg.model.dtype).itemsize
        crosses = p.fsdp * inner > hw.gpus_per_node
        fsdp_s = (2 * t.microbatches * ring_seconds("all-gather", p.fsdp, gathered, crosses, hw)
                  + ring_seconds("reduce-scatter", p.fsdp, grad_bytes * p.fsdp, crosses, hw))
    # Muon's and spectron's Newton-Schulz: each matrix's FLOPs and collectives on this device, the way
    # the run orthogonalises it (training/muon_layout.py).
    newton_schulz = 0.0 if t.optimizer == "adamw" else sum(
        w.seconds(hw) for w in chosen_ways(cfg, abstract_plan(cfg), hw.gpus_per_node).values())
    return {"optimizer": optimizer + newton_schulz, "dp_all_reduce": dp_s, "fsdp": fsdp_s}


def _either_way(g: Gemm, hw: Hardware, itemsize: int) -> float:
    """A GEMM's seconds at the better of its two output orientations (a layer compiled alone may
    lay out a product transposed from the train step's, which changes only its tiles' waves)."""
    return min(gemm_seconds(g, hw, itemsize), gemm_seconds(dataclasses.replace(g, m=g.n, n=g.m), hw, itemsize))


class LayerWork(NamedTuple):
    """What one decoder layer's forward and backward run, compiled alone (`Layers`)."""

    gemms: list[Gemm]
    collectives: list[Collective]


def lower_bound(cfg: Config, hw: Hardware, param_elems: int, layer: LayerWork, overlap: bool = False) -> float:
    """Seconds that `step_seconds` cannot undercut, without compiling the step: the GEMMs (but
    attention's score and value matmuls) and collectives of one decoder layer's forward and backward
    as compiled alone (`layer`, from the memory model's compile of the layer) priced as the
    performance model prices them, once per layer run (micro-batches x the stage's layers, a
    pipeline's bubble iterations included); the LM head's useful FLOPs at the GEMM efficiency with
    no wave loss and its three GEMMs' kernel overhead per run; the causal attention FLOPs at the
    attention efficiency; a pipeline iteration's two stage-to-stage permutes of one micro-batch's
    carry (forward and backward loops); plus the analytic parts exactly (memory-bound traffic and
    copies are left out). The train step runs every GEMM and collective of the layer in each layer
    run, so a layout whose bound exceeds a priced layout's seconds cannot be faster
    (tests/test_planner.py checks the bound under the price on a grid). With `overlap` the layer's
    backward collectives and the data-parallel all-reduce, which overlap may hide whole, are left out."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    c = count(m, t.seq_len)
    itemsize = jnp.dtype(m.dtype).itemsize
    stretch = 1.0
    if p.pp > 1:
        runs = t.microbatches * p.pp_repeats
        stretch = (runs + p.pp - 1) / runs
    layer_runs = t.microbatches * m.n_layers // p.pp * stretch  # a pipeline's bubble iterations run too
    layer_s = (sum(_either_way(g, hw, itemsize) * g.trip_count for g in layer.gemms if not g.attention)
               + sum(collective_seconds(x, hw) * x.trip_count for x in layer.collectives if not (overlap and x.backward)))
    tokens = t.batch_size * t.seq_len / (p.dp * p.fsdp * p.cp * p.tp * p.pp)
    rows = t.batch_size // (p.dp * p.fsdp * t.microbatches)  # of one micro-batch on one device
    head_runs = 1 if p.pp > 1 else t.microbatches  # a pipeline's head sees its micro-batches merged
    head = 6.0 * m.d_model * m.vocab_size * tokens / (hw.peak_flops * hw.gemm_efficiency)
    attention = (c.train_flops_per_token - 6.0 * c.matmul_params) * tokens * stretch
    program = (layer_runs * layer_s + head + 3 * head_runs * hw.kernel_overhead_s
               + attention / (hw.peak_flops * hw.attention_efficiency))
    if p.pp > 1:  # M * R + S - 1 iterations of the forward loop and of the backward loop, each
        # shifting one micro-batch's carry round the ring of stages (of the compiled tp x pp x cp mesh)
        carry = rows * t.seq_len // p.cp * pipeline_carry_width(abstract_plan(cfg), m) * itemsize
        shift = ring_seconds("collective-permute", 2, carry, p.pp * p.cp * p.tp > hw.gpus_per_node, hw)
        program += 2 * (t.microbatches * p.pp_repeats + p.pp - 1) * shift
    analytic = _analytic_parts(cfg, hw, param_elems)
    return program + sum(v for k, v in analytic.items() if not (overlap and k == "dp_all_reduce"))


def measure_layer_work(layer_cfg: Config) -> dict:
    """One layer's bytes (the memory model's), GEMMs and collectives, as JSON-able lists."""
    p, t = layer_cfg.parallel, layer_cfg.train
    layer = measure_layer(layer_cfg)
    itemsize = jnp.dtype(layer_cfg.model.dtype).itemsize
    group = query_group(abstract_plan(layer_cfg), layer_cfg.model)
    gemms = [g for text in layer.hlo for g in analyze(text, seq=t.seq_len, itemsize=itemsize, cp=p.cp, group=group,
                                                     query_block=layer_cfg.model.attention_query_block)[0]]
    return {"bytes": list(layer.bytes), "gemms": [dataclasses.asdict(g) for g in gemms],
            "collectives": [dataclasses.asdict(c) for text in layer.hlo for c in collectives(text)]}


class Layers:
    """One decoder layer per `one_layer_config`, compiled once (and cached) for both of its uses:
    the memory model's bytes and the lower bound's GEMMs and collectives."""

    def __init__(self, cache: DiskCache):
        self.cache = cache

    @staticmethod
    def key(layer_cfg: Config) -> tuple:
        p, t = layer_cfg.parallel, layer_cfg.train
        return "layer", layer_cfg.model, p.scheme, p.tp, p.cp, p.cp_attention, t.batch_size, t.seq_len, t.remat

    def has(self, layer_cfg: Config) -> bool:
        return self.cache.has(self.key(layer_cfg))

    def compile(self, layer_cfgs: list[Config], workers: Workers, done: Callable[[int, int], None]) -> None:
        """The layers of `layer_cfgs` not yet cached, compiled at once on `workers`; `done(k, n)`
        after each of the n."""
        todo = {self.key(c): c for c in layer_cfgs if not self.has(c)}
        for k, (key, value) in enumerate(zip(todo, workers.map(measure_layer_work, list(todo.values()))), 1):
            self.cache.put(key, value)
            done(k, len(todo))

    def _measure(self, layer_cfg: Config) -> dict:
        return self.cache.get(self.key(layer_cfg), lambda: measure_layer_work(layer_cfg))

    def bytes(self, layer_cfg: Config) -> LayerBytes:
        return LayerBytes(*self._measure(layer_cfg)["bytes"])

    def work(self, layer_cfg: Config) -> LayerWork:
        raw = self._measure(layer_cfg)
        return LayerWork([Gemm(**g) for g in raw["gemms"]], [_collective(c) for c in raw["collectives"]])
