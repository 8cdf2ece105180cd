"""The one thing every command does between reading its config and starting JAX's backend: the CPU
devices to simulate, the persistent compilation cache and the host memory setting. Each must be set
before the backend starts; `prepare_jax` is where they are, for every command (train, eval, generate,
lm_eval, export, convert, plan, bench)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from boost_jax.launch import compile_cache, host_memory

if TYPE_CHECKING:
    from boost_jax.config import Config


def prepare_jax(cfg: Config, *, devices: int = 0, reuse_memory: bool = True) -> None:
    """Set, from `cfg`, what JAX reads when its backend starts:
    - CPU devices: `parallel.cpu_devices`, else `devices` (the mesh a benchmark or the planner
      compiles for; 0 leaves JAX's own), so that a run trained on simulated devices is evaluated and
      decoded on its layout;
    - the persistent compilation cache (`data.compile_cache`, launch/compile_cache.py);
    - `parallel.cpu_reuse_memory` (launch/host_memory.py), unless `reuse_memory` is False: decoding
      and compile-only commands keep glibc's defaults."""
    simulate_cpu_devices(cfg.parallel.cpu_devices or devices)
    compile_cache.enable(cfg.data)
    if reuse_memory:
        host_memory.apply_setting(cfg.parallel.cpu_reuse_memory)


def simulate_cpu_devices(n: int) -> None:
    """Ask JAX for at least n host devices (never fewer than already asked for; n <= 0: nothing). On
    an accelerator, or once the backend has started (a test, a notebook), the devices it has stay."""
    if n <= 0 or jax.config.jax_platforms not in (None, "", "cpu"):
        return
    try:
        jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
    except RuntimeError:  # the backend has started
        pass
