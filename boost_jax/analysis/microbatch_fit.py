"""A resume on fewer devices keeps the global batch, so each device holds a larger share of it. Where
that share no longer fits in a device's memory, more micro-batches (train.microbatches: exact gradient
accumulation) take its place, as few as fit by the memory model (analysis/memory_model.py), against
parallel.device_memory_gib or else a GPU's own memory. The data position, schedule and RNG depend
on the step alone, so the trajectory goes on within fp32 reduction order.

    fit = fewest_microbatches(cfg, mesh, limit, source)  # Fit(microbatches, need, limit), or ConfigError
    cfg, note = fit_resume(cfg, plan)                    # in train, before the step is built
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.experimental import multihost_utils

from boost_jax.analysis.memory_model import COMPILERS, LayerBytes, breakdown, layer_bytes, layer_bytes_on
from boost_jax.config import Config
from boost_jax.parallel import Plan
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.units import GIB, MIB


class Fit(NamedTuple):
    microbatches: int
    need: int  # bytes per device of the train step at that count
    limit: int  # bytes per device available


def devices(n: int) -> str:
    return f"{n} device" + ("s" if n > 1 else "")


def size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def fewest_microbatches(cfg: Config, mesh: dict[str, int], limit: int, source: str,
                        layer: Callable[[Config], LayerBytes] = layer_bytes, compiler: str = "cpu") -> Fit:
    """The fewest micro-batches, from cfg's train.microbatches up, that split train.batch_size over
    the mesh's dp x fsdp and whose train step fits in `limit` bytes per device (as `compiler` lays it
    out; `source`: where `limit` comes from); a ConfigError with the bytes needed and available where
    none does."""
    t = cfg.train
    shards = mesh["dp"] * mesh["fsdp"]
    sized = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **mesh))
    need = tried = None
    for m in range(t.microbatches, t.batch_size + 1):
        if t.batch_size % m or (t.batch_size // m) % shards:  # the plan refuses a micro-batch it cannot split
            continue
        tried = m
        need = breakdown(dataclasses.replace(sized, train=dataclasses.replace(t, microbatches=m)), layer,
                         compiler)["total"]
        if need <= limit:
            return Fit(m, need, limit)
    raise ConfigError(
        f"parallel: {devices(math.prod(mesh.values()))} (mesh {mesh}) cannot hold the train step of "
        f"train.batch_size={t.batch_size}: {size(need)} ({need:,} bytes) per device even at "
        f"train.microbatches={tried}, the most that split the batch over dp x fsdp = {shards}; {size(limit)} "
        f"({limit:,} bytes) is available per device ({source}). Resume on more devices (or set "
        "parallel.device_memory_gib to what they hold); the checkpoints are untouched")


def device_limit(cfg: Config, device: jax.Device) -> tuple[int | None, str]:
    """The bytes a device holds for the train step, and where that figure comes from; None on a CPU
    without parallel.device_memory_gib (host memory has no meaningful limit)."""
    if cfg.parallel.device_memory_gib > 0:
        return int(cfg.parallel.device_memory_gib * GIB), "parallel.device_memory_gib"
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    return None, ""


def fit_resume(cfg: Config, plan: Plan) -> tuple[Config, str | None]:
    """cfg with as many micro-batches as this resume's devices need (cfg itself where they hold their
    share, there is no limit, or the memory model has no figures for the platform), and a note of what
    was added."""
    device = jax.local_devices()[0]
    limit, source = device_limit(cfg, device)
    compiler = device.platform  # how XLA lays the step out: "cpu" or "gpu" (the memory model's COMPILERS)
    if limit is None or compiler not in COMPILERS:
        return cfg, None
    if jax.process_count() > 1:  # every process must build the same step: the smallest device decides
        limit = int(multihost_utils.process_allgather(limit).min())
    mesh = dict(plan.mesh.shape)
    local = jax.local_devices()  # each process measures the layer on its own devices where they hold its tp x cp
    layer = layer_bytes_on(local if len(local) >= mesh["tp"] * mesh["cp"] else jax.devices())
    fit = fewest_microbatches(cfg, mesh, limit, source, layer, compiler)
    if fit.microbatches == cfg.train.microbatches:
        return cfg, None
    note = (f"train.microbatches {cfg.train.microbatches} -> {fit.microbatches} to fit {devices(plan.mesh.size)}: "
            f"{size(fit.need)} of {size(fit.limit)} per device ({source})")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=fit.microbatches)), note
