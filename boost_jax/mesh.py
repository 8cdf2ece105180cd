"""The device mesh from `parallel.*`: axes (dp, fsdp, tp); simulated CPU devices; multi-process init."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from boost_jax.config import ConfigError, ParallelConfig
from boost_jax.sharding import MESH_AXES


def simulate_cpu_devices(n: int) -> None:
    """Ask for n host devices; must run before JAX's backend starts (a no-op for n == 0)."""
    if n <= 0:
        return
    jax.config.update("jax_num_cpu_devices", n)


def mesh_shape(p: ParallelConfig, n_devices: int) -> tuple[int, int, int]:
    sizes = [p.dp, p.fsdp, p.tp]
    known = math.prod(s for s in sizes if s != -1)
    if n_devices % known:
        raise ConfigError(
            f"parallel: dp x fsdp x tp = {p.dp} x {p.fsdp} x {p.tp} does not divide the {n_devices} devices"
        )
    sizes = [n_devices // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != n_devices:
        raise ConfigError(
            f"parallel: dp x fsdp x tp = {' x '.join(map(str, sizes))} = {math.prod(sizes)}, "
            f"but there are {n_devices} devices"
        )
    return tuple(sizes)


def make_mesh(p: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (dp, fsdp, tp) mesh over `devices` (default: all of them)."""
    if p.tp != 1:
        raise ConfigError("parallel.tp: tensor parallelism is not available yet; use parallel.tp=1")
    devices = list(devices or jax.devices())
    shape = mesh_shape(p, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
