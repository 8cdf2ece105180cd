"""The device mesh from `parallel.*` (its axes are named in `boost_jax/schemes.py`); simulated CPU
devices; multi-process init."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from jax.sharding import AxisType, Mesh

from boost_jax.errors import ConfigError
from boost_jax.schemes import CP, DP, FSDP, MESH_AXES, PP, TP

if TYPE_CHECKING:
    from boost_jax.config import ParallelConfig

__all__ = ["CP", "DP", "FSDP", "MESH_AXES", "PP", "TP", "init_distributed", "make_mesh", "mesh_devices", "mesh_shape",
           "simulate_cpu_devices"]


def simulate_cpu_devices(n: int) -> None:
    """Ask for n host devices; must run before JAX's backend starts (a no-op for n == 0)."""
    if n <= 0:
        return
    jax.config.update("jax_num_cpu_devices", n)


def init_distributed(p: ParallelConfig) -> None:
    """Join a multi-process run (before any other JAX call). Each process loads only its rows of
    every batch; the mesh spans all processes' devices."""
    coordinator = p.coordinator or os.environ.get("BOOST_JAX_COORDINATOR", "")
    if not coordinator:
        return
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator == "auto":
        jax.distributed.initialize()
        return
    n = p.num_processes or int(os.environ.get("BOOST_JAX_NUM_PROCESSES", "0"))
    pid = p.process_id if p.process_id >= 0 else int(os.environ.get("BOOST_JAX_PROCESS_ID", "-1"))
    if n < 1 or not 0 <= pid < n:
        raise ConfigError(f"parallel.coordinator={coordinator} needs parallel.num_processes >= 1 and "
                          f"0 <= parallel.process_id < num_processes (got {n}, {pid})")
    jax.distributed.initialize(coordinator, num_processes=n, process_id=pid)


def mesh_shape(p: ParallelConfig, n_devices: int) -> tuple[int, ...]:
    """The size of each of MESH_AXES; one of them may be -1 (fill with the devices left over)."""
    sizes = [getattr(p, axis) for axis in MESH_AXES]
    names = " x ".join(MESH_AXES)
    known = math.prod(s for s in sizes if s != -1)
    if n_devices % known:
        raise ConfigError(
            f"parallel: {names} = {' x '.join(map(str, sizes))} does not divide the {n_devices} devices"
        )
    sizes = [n_devices // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != n_devices:
        raise ConfigError(
            f"parallel: {names} = {' x '.join(map(str, sizes))} = {math.prod(sizes)}, "
            f"but there are {n_devices} devices"
        )
    return tuple(sizes)


def mesh_devices(p: ParallelConfig) -> list[jax.Device]:
    """The devices a config's mesh spans: the first product-of-sizes of them, or all of them when
    an axis is -1 (fill)."""
    sizes = [getattr(p, axis) for axis in MESH_AXES]
    n = len(jax.devices()) if -1 in sizes else math.prod(sizes)
    if n > len(jax.devices()):
        raise ConfigError(f"parallel: the mesh needs {n} devices, JAX sees {len(jax.devices())} "
                          f"(on CPU: parallel.cpu_devices={n})")
    return jax.devices()[:n]


def make_mesh(p: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The MESH_AXES mesh over `devices` (default: all of them)."""
    devices = list(devices or jax.devices())
    shape = mesh_shape(p, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
