"""The one thing every command does between reading its config and starting JAX's backend: the CPU
devices to simulate, the persistent compilation cache and the host memory setting. Each must be set
before the backend starts; `prepare_jax` is where they are, for every command (train, eval, generate,
lm_eval, export, convert, plan, bench)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
from typing import TYPE_CHECKING

import jax

from boost_jax.launch import compile_cache, host_memory
from boost_jax.launch.gpu_target import PLUGINS as CUDA_PLUGINS

if TYPE_CHECKING:
    from boost_jax.config import Config


def prepare_jax(cfg: Config, *, devices: int = 0, reuse_memory: bool = True) -> None:
    """Set, from `cfg`, what JAX reads when its backend starts (and the CPU alone on a machine with
    JAX's CUDA plugin but no GPU driver: `cpu_without_a_driver`):
    - CPU devices: `parallel.cpu_devices`, else `devices` (the mesh a benchmark or the planner
      compiles for; 0 leaves JAX's own), so that a run trained on simulated devices is evaluated and
      decoded on its layout;
    - the persistent compilation cache (`data.compile_cache`, launch/compile_cache.py);
    - `parallel.cpu_reuse_memory` (launch/host_memory.py), unless `reuse_memory` is False: decoding
      and compile-only commands keep glibc's defaults."""
    cpu_without_a_driver()
    simulate_cpu_devices(cfg.parallel.cpu_devices or devices)
    compile_cache.enable(cfg.data)
    if reuse_memory:
        host_memory.apply_setting(cfg.parallel.cpu_reuse_memory)


def cpu_without_a_driver() -> None:
    """JAX on the CPU where JAX's CUDA plugin is installed (the gpu-compile extra) but no NVIDIA driver
    is: JAX would try the plugin first and print its failure (cuInit error 303) as a traceback before
    falling back to the CPU. A platform the user chose (JAX_PLATFORMS) is left alone."""
    if jax.config.jax_platforms or not any(importlib.util.find_spec(p) for p in CUDA_PLUGINS):
        return
    try:
        ctypes.CDLL("libcuda.so.1")  # what the plugin's cuInit loads
    except OSError:
        with contextlib.suppress(RuntimeError):  # the backend has started: too late, and it already chose
            jax.config.update("jax_platforms", "cpu")


def simulate_cpu_devices(n: int) -> None:
    """Ask JAX for at least n host devices (never fewer than already asked for; n <= 0: nothing). On
    an accelerator, or once the backend has started (a test, a notebook), the devices it has stay."""
    if n <= 0 or jax.config.jax_platforms not in (None, "", "cpu"):
        return
    try:
        jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
    except RuntimeError:  # the backend has started
        pass
