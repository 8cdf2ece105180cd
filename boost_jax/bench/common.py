"""What every benchmark builds: a config from flags + overrides, the mesh, and the sharded program."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from boost_jax.config import Config, load_config
from boost_jax.mesh import make_mesh, sharding_rules
from boost_jax.sharding import Rules, named, param_specs, spec
from boost_jax.step import abstract_model, sharded_loss


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-7b", help="preset (boost_jax/presets.py)")
    p.add_argument("--arch", default="cola", choices=["dense", "svd", "cola", "lax"])
    p.add_argument("--scheme", default="auto", choices=["auto", "megatron", "vanilla", "btp"])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per data-parallel replica")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")


def bench_flags(model: str, arch: str, scheme: str = "auto", *, tp: int, batch: int, seq: int, dtype: str,
                dp: int = 1, overrides: tuple[str, ...] = ()) -> argparse.Namespace:
    """The flags of `add_model_flags`, for benchmarks that build configs in code."""
    return argparse.Namespace(model=model, arch=arch, scheme=scheme, tp=tp, dp=dp, batch=batch, seq=seq, dtype=dtype,
                              overrides=list(overrides))


def bench_config(a: argparse.Namespace, **changes) -> Config:
    v = {**vars(a), **changes}
    return load_config(None, [
        f"model.preset={v['model']}", f"model.arch={v['arch']}", f"parallel.scheme={v['scheme']}",
        f"parallel.tp={v['tp']}", f"parallel.dp={v['dp']}", "parallel.fsdp=1",
        f"train.batch_size={v['batch'] * v['dp']}", f"train.seq_len={v['seq']}",
        f"model.dtype={'bfloat16' if v['dtype'] == 'bf16' else 'float32'}", *v["overrides"],
    ])


@dataclass(frozen=True)
class Program:
    """The sharded loss of a config on a mesh, with abstract (allocation-free) inputs."""

    cfg: Config
    mesh: Mesh
    rules: Rules
    graphdef: nnx.GraphDef
    params: dict  # ShapeDtypeStructs carrying their shardings
    batch: dict
    loss: Callable

    @property
    def params_per_device(self) -> int:
        """Parameter elements each device holds (its shard of every weight)."""
        return sum(math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(self.params))


def build(cfg: Config) -> Program:
    n = cfg.parallel.dp * cfg.parallel.fsdp * cfg.parallel.tp
    if jax.device_count() < n:
        raise SystemExit(f"need {n} devices, JAX sees {jax.device_count()} (on CPU: parallel.cpu_devices={n})")
    mesh = make_mesh(cfg.parallel, jax.devices()[:n])
    rules = sharding_rules(cfg, mesh)
    graphdef, abstract = abstract_model(cfg)
    shardings = named(mesh, param_specs(abstract, rules))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract), shardings)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32,
                                  sharding=NamedSharding(mesh, spec(("batch", None), rules)))
    batch = {"inputs": tokens, "targets": tokens}
    return Program(cfg, mesh, rules, graphdef, params, batch, sharded_loss(graphdef, mesh, rules, cfg.train.remat))
