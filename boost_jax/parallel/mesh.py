"""The device mesh from `parallel.*` (its axes are named in `boost_jax/config/schemes.py`); simulated CPU
devices and the rest of a command's set-up before JAX starts; multi-process init."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from jax.sharding import AxisType, Mesh

from boost_jax.config.schemes import CP, DP, FSDP, MESH_AXES, PP, TP
from boost_jax.parallel.peers import backstop_s
from boost_jax.runtime.errors import ConfigError

if TYPE_CHECKING:
    from boost_jax.config import ParallelConfig

__all__ = ["CP", "DP", "FSDP", "MESH_AXES", "PP", "TP", "init_distributed", "make_mesh", "mesh_devices", "mesh_shape"]


def init_distributed(p: ParallelConfig) -> None:
    """Join a multi-process run (before any other JAX call). Each process loads only its rows of
    every batch; the mesh spans all processes' devices. The settings are checked first, and a
    rendezvous that does not complete in parallel.coordinator_timeout_s ends the process with one
    message (JAX's own timeout, kept longer, would abort it with a C++ stack)."""
    coordinator = p.coordinator or os.environ.get("BOOST_JAX_COORDINATOR", "")
    if not coordinator:
        return
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator == "auto":
        with _watchdog(coordinator, p.coordinator_timeout_s):
            _initialize(p)
        return
    host, port = _address(coordinator)
    n = p.num_processes or _env_int("BOOST_JAX_NUM_PROCESSES", 0)
    pid = p.process_id if p.process_id >= 0 else _env_int("BOOST_JAX_PROCESS_ID", -1)
    if n < 1 or not 0 <= pid < n:
        raise ConfigError(f"parallel.coordinator={coordinator} needs parallel.num_processes >= 1 and "
                          f"0 <= parallel.process_id < num_processes (got {n}, {pid})")
    if pid == 0:  # process 0 serves the coordinator on this port
        with socket.socket() as s:
            # as the coordinator's server binds: a port in TIME_WAIT after a previous run is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                raise ConfigError(f"parallel.coordinator={coordinator}: process 0 cannot serve on port {port} "
                                  f"({e.strerror}); choose a free port") from None
    with _watchdog(coordinator, p.coordinator_timeout_s):
        _initialize(p, f"{host}:{port}", num_processes=n, process_id=pid)


def _initialize(p: ParallelConfig, *args, **kwargs) -> None:
    """jax.distributed.initialize, then `peers.Watchdog` (parallel.heartbeat_timeout_s). JAX's own
    heartbeat, kept longer, is the backstop: what it reports is a fatal log with a C++ stack."""
    backstop = backstop_s(p.heartbeat_timeout_s)
    jax.distributed.initialize(*args, initialization_timeout=p.coordinator_timeout_s + 60,
                               heartbeat_timeout_seconds=backstop, shutdown_timeout_seconds=backstop, **kwargs)


def _address(coordinator: str) -> tuple[str, int]:
    """host and port of a `host:port` coordinator ([v6 address]:port too)."""
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"parallel.coordinator={coordinator!r}: expected host:port with a port in 1..65535, "
                          "or 'auto'")
    return host, int(port)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} is not an integer") from None


@contextlib.contextmanager
def _watchdog(coordinator: str, seconds: int):
    """Stop the process with one message if the block has not finished within `seconds`."""
    def expire():
        print(f"config error: parallel.coordinator={coordinator}: the coordinator and all processes did not "
              f"join within {seconds} s (parallel.coordinator_timeout_s); check that the address is reachable "
              "and every process runs with it", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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
