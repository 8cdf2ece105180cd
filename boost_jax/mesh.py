"""The device mesh from `parallel.*`: axes (dp, fsdp, tp); simulated CPU devices; multi-process init."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from boost_jax.config import Config, ConfigError, ParallelConfig
from boost_jax.sharding import DP, FSDP, MESH_AXES, TP, Rules, scheme_rules


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
    """A (dp, fsdp, tp) mesh over `devices` (default: all of them); tp innermost, so a TP group
    sits on neighbouring devices (one NVLink island on a GPU node)."""
    devices = list(devices or jax.devices())
    shape = mesh_shape(p, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def sharding_rules(cfg: Config, mesh: Mesh) -> Rules:
    """The scheme's rules for this model on this mesh, after checking every split divides."""
    m, scheme, tp, fsdp = cfg.model, cfg.parallel.scheme, mesh.shape[TP], mesh.shape[FSDP]
    batch_shards = mesh.shape[DP] * fsdp

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"parallel: {what} (scheme={scheme}, dp={mesh.shape[DP]}, fsdp={fsdp}, tp={tp})")

    need(cfg.train.batch_size % batch_shards == 0,
         f"train.batch_size={cfg.train.batch_size} must divide by dp x fsdp = {batch_shards}")
    need(m.vocab_size % tp == 0, f"model.vocab_size={m.vocab_size} must divide by tp={tp} (vocab-parallel head)")
    need(m.vocab_size % fsdp == 0 and m.d_model % fsdp == 0,
         f"model.vocab_size={m.vocab_size} and model.d_model={m.d_model} must divide by fsdp={fsdp}")
    if scheme in ("megatron", "btp"):
        need(m.n_heads % tp == 0, f"model.n_heads={m.n_heads} must divide by tp={tp}")
        need(m.d_ff % tp == 0, f"model.d_ff={m.d_ff} must divide by tp={tp}")
    if scheme == "btp":
        need(m.d_model % tp == 0, f"model.d_model={m.d_model} must divide by tp={tp} (the residual is split on d)")
    ranks = (m.attn_rank, m.mlp_rank)
    if scheme == "vanilla":
        need(all(r % tp == 0 for r in ranks), f"model.attn_rank/mlp_rank={ranks} must divide by tp={tp}")
        need(all(n % fsdp == 0 for n in (m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.d_ff)),
             f"model head widths and d_ff={m.d_ff} must divide by fsdp={fsdp}")
    if scheme == "btp" and m.arch != "dense":
        need(all(r % fsdp == 0 for r in ranks), f"model.attn_rank/mlp_rank={ranks} must divide by fsdp={fsdp}")
    return scheme_rules(scheme, shard_kv_heads=m.n_kv_heads % tp == 0)
