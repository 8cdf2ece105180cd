"""The parallel plan: one immutable object saying how a model runs (mesh + scheme + rules +
pipeline + attention implementation).

The model receives the plan at call time and every code path that depends on the layout is
decided by it (`plan.projections`: the scheme's strategy for a block's projections;
`plan.axis("vocab")`; `plan.attention`), never by global or context state. One device is a plan
too (`single_device_plan`): the same code with a mesh of size one.

Logical axes are strict: a name outside `schemes.LOGICAL_AXES` raises, and two dimensions of one
tensor asking for the same mesh axis raise, instead of silently replicating.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from boost_jax.config.schemes import DP, FSDP, LOGICAL_AXES, MESH_AXES, PP, SCHEMES, TP, Rules, Scheme, default_scheme
from boost_jax.parallel.attention_choice import AttentionSite, checked_capability, resolve_attention
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.pipeline import Schedule
from boost_jax.parallel.projections import STRATEGIES, Projections
from boost_jax.runtime.errors import ConfigError

if TYPE_CHECKING:
    from boost_jax.config import Config, ModelConfig


@dataclass(frozen=True)
class Plan:
    """How a model runs: its mesh, its TP scheme and the scheme's rules for this model, pipeline
    stages, and the attention implementation (`model.attention` resolved for the mesh's devices, the
    model's dtype and head dim and the layout: parallel/attention_choice.py).
    The modules it builds on name its type by `view.PlanView`."""

    mesh: Mesh
    scheme: Scheme
    rules: Rules  # logical axis -> mesh axes, for this model (kv-head replication applied)
    pipeline: Schedule | None = None  # pipeline stages over the pp axis; None: one stage
    attention: str = "xla"  # xla | cudnn (ops/attention.py)
    cp_attention: str = "gather"  # how attention reaches other devices' tokens under cp (parallel/context.py)
    attention_why: str = ""  # why model.attention=auto took XLA's attention on GPUs ("" where it did not)

    def __post_init__(self):
        if self.scheme.name not in STRATEGIES:
            raise ValueError(f"scheme {self.scheme.name!r} has no projection strategy in parallel/projections.py")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention {self.attention!r}: choose one of {ATTENTION_IMPLS}")

    @property
    def projections(self) -> type[Projections]:
        """The scheme's strategy for a block's projections (parallel/projections.py)."""
        return STRATEGIES[self.scheme.name]

    @property
    def platform(self) -> str | None:
        """The platform of the mesh's devices ("gpu", "cpu", ...; None for a device-free mesh): what a
        program built for this plan runs on, which may not be `jax.default_backend()` (a deviceless
        compile for GPUs runs on a CPU-only JAX: `python -m boost_jax.compile`)."""
        return None if isinstance(self.mesh, AbstractMesh) else self.mesh.devices.flat[0].platform

    @property
    def interpret_kernels(self) -> bool:
        """Whether the Pallas kernels run emulated: everywhere but on GPUs, which compile them with Triton."""
        return self.platform != "gpu"

    @property
    def flat_tokens(self) -> bool:
        """Whether GEMMs may merge batch and sequence into one tokens axis (`lowrank.matmul`): not
        where the sequence is split over devices, which merging would gather."""
        return self.size("seq") == 1

    def spec(self, axes: Sequence[str | None]) -> P:
        """PartitionSpec for one logical name (or None) per dimension."""
        out, used = [], {}
        for dim, name in enumerate(axes):
            if name is not None and name not in LOGICAL_AXES:
                raise ValueError(f"unknown logical axis {name!r} in {tuple(axes)}; known: {sorted(LOGICAL_AXES)}")
            flat = _flat(self.rules.get(name) if name is not None else None)
            for axis in flat:
                if axis in used:
                    raise ValueError(f"logical axes {tuple(axes)}: dimensions {used[axis]} and {dim} both "
                                     f"map to mesh axis {axis!r} under scheme {self.scheme.name}")
                used[axis] = dim
            out.append(flat[0] if len(flat) == 1 else (flat or None))
        return P(*out)

    def sharding(self, axes: Sequence[str | None]) -> NamedSharding:
        """NamedSharding for one logical name (or None) per dimension."""
        return NamedSharding(self.mesh, self.spec(axes))

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        """with_sharding_constraint by logical names."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes))

    def axis(self, name: str) -> str | None:
        """The one mesh axis a logical name maps to (None if replicated); for shard_map collectives."""
        mesh_axes = self.spec((name,))[0]
        if mesh_axes is not None and not isinstance(mesh_axes, str):
            raise ValueError(f"logical axis {name!r} maps to several mesh axes {mesh_axes}")
        return mesh_axes

    def size(self, name: str) -> int:
        """How many ways a logical name is split."""
        return math.prod(self.mesh.shape[a] for a in _flat(self.spec((name,))[0]))

    def param_specs(self, params: nnx.State) -> dict:
        """PartitionSpecs, as a pure dict shaped like `params.to_pure_dict()`, from `logical_axes` metadata."""
        out: dict = {}
        for path, var in nnx.to_flat_state(params):
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            axes = var.get_metadata().get("logical_axes")
            if axes is None:
                raise ValueError(f"parameter {'.'.join(map(str, path))} has no logical_axes metadata")
            node[path[-1]] = self.spec(axes)
        return out

    def layer_order(self, n_layers: int) -> np.ndarray:
        """The model layer at each position of the stored layer stack (pipeline.Schedule.layer_order)."""
        return np.arange(n_layers) if self.pipeline is None else self.pipeline.layer_order(n_layers)

    def named(self, specs):
        """NamedShardings on this mesh for a pytree of PartitionSpecs."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


ATTENTION_IMPLS = ("xla", "cudnn")


def attention_site(model: ModelConfig, devices: Sequence[jax.Device], rules: Rules, tp: int) -> AttentionSite:
    """What decides the attention of `model` under `rules` on `devices` (none: a device-free mesh)."""
    platform, capability = (devices[0].platform, checked_capability(devices[0])) if devices else (None, None)
    return AttentionSite(platform, capability, model.dtype, model.head_dim, model.n_kv_heads, tp,
                         rules.get("act_heads") == rules.get("act_kv_heads"))


def make_plan(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Plan:
    """The plan of `cfg` on `devices` (default: all), after checking every split the scheme makes divides."""
    mesh = make_mesh(cfg.parallel, devices)
    return _plan(cfg, mesh, dict(mesh.shape), list(mesh.devices.flat))


def abstract_plan(cfg: Config) -> Plan:
    """The plan of `cfg` (`abstract_config`) on a device-free mesh of its `parallel.*` sizes, with the
    same checks: for layouts larger than the machine (the planner, the memory model)."""
    cfg = abstract_config(cfg)
    sizes = tuple(getattr(cfg.parallel, a) for a in MESH_AXES)
    return _plan(cfg, AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES)),
                 dict(zip(MESH_AXES, sizes)), [])


def abstract_config(cfg: Config) -> Config:
    """`cfg` for a device-free mesh: there are no devices to fill, so the default parallel.dp=-1 (all
    devices left over) is one, as a benchmark's simulated mesh counts it (bench/common.py)."""
    if cfg.parallel.dp != -1:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1))


def _plan(cfg: Config, mesh, shape: dict[str, int], devices: Sequence[jax.Device]) -> Plan:
    scheme = SCHEMES[cfg.parallel.scheme]
    for req in scheme.requires:
        ways = math.prod(shape[a] for a in req.axes)
        value = _config_value(cfg, req.key)
        if value % ways:
            axes = " x ".join(req.axes)
            why = f" ({req.why})" if req.why else ""
            raise ConfigError(f"parallel: {req.key}={value} must divide by {axes} = {ways}{why} "
                              f"(scheme={scheme.name}, mesh {shape})")
    rows, shards = cfg.train.batch_size // cfg.train.microbatches, shape[DP] * shape[FSDP]
    if rows % shards:
        raise ConfigError(f"parallel: a micro-batch of train.batch_size / train.microbatches = {rows} rows must "
                          f"divide by dp x fsdp = {shards} (mesh {shape})")
    rules = scheme.rules_for(cfg.model.n_kv_heads, shape[TP], shape[PP], cfg.model.attn_latent_heads)
    attention, why = resolve_attention(cfg.model.attention, attention_site(cfg.model, devices, rules, shape[TP]))
    return Plan(mesh, scheme, rules, _schedule(cfg, shape[PP]), attention, cfg.parallel.cp_attention, why)


def _schedule(cfg: Config, stages: int) -> Schedule | None:
    p, layers, micro = cfg.parallel, cfg.model.n_layers, cfg.train.microbatches
    if stages == 1:
        if p.pp_repeats != 1:
            raise ConfigError(f"parallel.pp_repeats={p.pp_repeats} needs parallel.pp > 1")
        return None
    if layers % (stages * p.pp_repeats):
        raise ConfigError(f"parallel: model.n_layers={layers} must divide by parallel.pp x parallel.pp_repeats = "
                          f"{stages} x {p.pp_repeats} (each stage runs the same number of layers per repeat)")
    if micro < stages:
        raise ConfigError(f"parallel: train.microbatches={micro} must be at least parallel.pp={stages} (fewer "
                          "micro-batches than stages leave stages idle, and the circular schedule needs M >= S)")
    return Schedule(stages, p.pp_repeats, micro)


def single_device_plan(model: ModelConfig, scheme: str | None = None) -> Plan:
    """`scheme` (default: the arch's, as parallel.scheme=auto) on the first device alone: the same
    code path as any mesh, with every split one way. The reference every mesh must equal."""
    chosen = SCHEMES[scheme or default_scheme(model.arch)]
    device = jax.devices()[0]
    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=[device])
    rules = chosen.rules_for(model.n_kv_heads, 1, 1, model.attn_latent_heads)
    attention, why = resolve_attention(model.attention, attention_site(model, [device], rules, 1))
    return Plan(mesh, chosen, rules, None, attention, attention_why=why)


def _flat(mesh_axes) -> tuple[str, ...]:
    """A rule or PartitionSpec entry (None, one axis, or a tuple of them) as a tuple of axes."""
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())


def _config_value(cfg: Config, key: str) -> int:
    """A Requirement's value: `section.a*b`, a product, or `section.a*b/c`, a product over a divisor."""
    section, fields = key.split(".")
    product, _, divisor = fields.partition("/")
    value = lambda names: math.prod(getattr(getattr(cfg, section), f) for f in names.split("*"))
    return value(product) // (value(divisor) if divisor else 1)
