"""The device peaks behind MFU: a table of datasheet peaks, and the matmul peak and read bandwidth
measured on the device (cached on CPU). The model FLOPs they divide are model/counts.py's."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from boost_jax.runtime.cache import atomic_write

# Dense bf16 tensor-core peak per device (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


CPU_PEAKS = "cpu_peak.json"  # the measured CPU peaks, in the data cache's root


def device_peak_flops(dtype: str, cache_dir: Path) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from). On CPU a matmul peak is measured once and
    cached in `cache_dir`."""
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        if sheet := datasheet_peak_flops(dev, dtype):
            return sheet, f"table:{dev.device_kind}"
        return measure_matmul_peak(dtype), f"measured:{dev.device_kind}"
    key = cpu_peak_key(dtype)
    cache = _read_peaks(Path(cache_dir) / CPU_PEAKS)
    if key not in cache:
        cache[key] = _store_cpu_peak(dtype, cache_dir, measure_matmul_peak(dtype))
    return cache[key], "measured:cpu"


def remeasured_cpu_peak(dtype: str, cache_dir: Path, cached: float) -> float:
    """The CPU's matmul peak measured again (`cached`: the one measured before, which a throughput
    above it shows to have been measured low, on a busy host): the higher of the two, which replaces
    the cached one for the runs after this."""
    peak = measure_matmul_peak(dtype)
    return cached if peak <= cached else _store_cpu_peak(dtype, cache_dir, peak)


def _store_cpu_peak(dtype: str, cache_dir: Path, peak: float) -> float:
    path = Path(cache_dir) / CPU_PEAKS
    cache = {**_read_peaks(path), cpu_peak_key(dtype): peak}
    with contextlib.suppress(OSError):  # an unwritable cache: this run still uses the peak
        atomic_write(path, lambda f: f.write(json.dumps(cache).encode()))
    return peak


def datasheet_peak_flops(dev: jax.Device, dtype: str) -> float | None:
    """The datasheet peak FLOP/s of an accelerator in PEAK_BF16_FLOPS; None if it is not there."""
    for name, peak in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if dev.platform != "cpu" and name.lower() in dev.device_kind.lower():
            # fp32 matmuls run as TF32 on tensor cores at JAX's default precision: half the bf16 peak.
            return peak if dtype == "bfloat16" else peak / 2
    return None


def cpu_peak_key(dtype: str) -> str:
    return f"{platform.processor() or platform.machine()}-{os.cpu_count()}-{jax.__version__}-{dtype}"


def _read_peaks(path: Path) -> dict[str, float]:
    """The cached peaks; an unreadable file or entry (damaged, hand-edited) is measured again."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cache, dict):
        return {}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
    return {k: float(v) for k, v in cache.items() if number(v)}


def measure_matmul_peak(dtype: str, n: int = 2048, reps: int = 10) -> float:
    """Best observed FLOP/s of an n x n matmul on the first device (best-of: noise only slows)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def measure_read_bandwidth(megabytes: int = 256, reps: int = 15) -> float:
    """Bytes per second a compiled matrix-vector product reads from a `megabytes` fp32 matrix (the best
    of `reps`): the access pattern of a decode step, which reads each weight once per token. (A
    compiled elementwise copy is a worse yardstick on CPU: XLA runs it on one thread.)"""
    w = jnp.ones((megabytes << 8, 1024), jnp.float32)
    v = jnp.ones((1024,), jnp.float32)
    gemv = jax.jit(lambda w, v: w @ v)
    jax.block_until_ready(gemv(w, v))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(gemv(w, v))
        best = min(best, time.perf_counter() - t)
    return w.nbytes / best
