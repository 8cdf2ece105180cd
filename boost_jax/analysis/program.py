"""Abstract programs: a config's sharded loss under its plan, with allocation-free inputs.

    cfg = config_for("llama-7b", "cola", tp=4, batch_size=4, seq=4096, dtype="bfloat16")
    prog = build(cfg)                              # jax.ShapeDtypeStructs: nothing is allocated
    compiled = jax.jit(jax.grad(prog.loss)).lower(prog.params, prog.batch).compile()

Used by `bench`, the tests and the notebooks to compile 7B-30B models on a laptop and read their
collectives (`comm.py`, `hlo.py`), GEMMs (`work.py`) and memory (`peak_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
from flax import nnx

from boost_jax.config import Config, load_config
from boost_jax.model.weights import abstract_model, abstract_params
from boost_jax.parallel import Plan, make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.training.loss import sharded_loss
from boost_jax.training.step import abstract_batch, abstract_optimizer_state


def config_for(model: str, arch: str, scheme: str = "auto", *, tp: int, batch_size: int, seq: int, dtype: str,
               dp: int = 1, pp: int = 1, pp_repeats: int = 1, microbatches: int = 1,
               overrides: Sequence[str] = ()) -> Config:
    """A config from the usual analysis knobs, each the config key of its name (`batch_size`: global,
    `dtype`: model.dtype), fsdp 1; `overrides` are `section.key=value` strings applied last."""
    return load_config(None, [
        f"model.preset={model}", f"model.arch={arch}", f"parallel.scheme={scheme}",
        f"parallel.tp={tp}", f"parallel.dp={dp}", "parallel.fsdp=1", f"parallel.pp={pp}",
        f"parallel.pp_repeats={pp_repeats}", f"train.microbatches={microbatches}",
        f"train.batch_size={batch_size}", f"train.seq_len={seq}", f"model.dtype={dtype}", *overrides,
    ])


@dataclass(frozen=True)
class Program:
    """The sharded loss of a config under its plan, with abstract (allocation-free) inputs."""

    cfg: Config
    plan: Plan
    graphdef: nnx.GraphDef
    params: dict  # ShapeDtypeStructs carrying their shardings
    batch: dict
    loss: Callable

    @property
    def params_per_device(self) -> int:
        """Parameter elements each device holds (its shard of every weight)."""
        return sum(math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(self.params))


def build(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Program:
    """The program of `cfg` on `devices` (default: the simulated CPU devices its mesh needs; a GPU
    topology's, launch/gpu_target.py, compiles it with XLA:GPU)."""
    plan = make_plan(cfg, mesh_devices(cfg.parallel) if devices is None else devices)
    graphdef, _ = abstract_model(cfg)
    return Program(cfg, plan, graphdef, abstract_params(cfg, plan), abstract_batch(cfg, plan),
                   sharded_loss(graphdef, plan, cfg.train))


def optimizer_state(prog: Program, tx) -> dict:
    """The abstract state of optimizer `tx` on the program's parameters, laid out as the train step
    lays it out (each moment sharded like its parameter, the rest replicated)."""
    return abstract_optimizer_state(tx, prog.params, prog.plan)


def peak_bytes(compiled) -> int:
    """Per-device peak from XLA's compiled memory analysis: live arguments + outputs + temporaries
    (donated arguments counted once)."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
