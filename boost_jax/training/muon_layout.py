"""Where each decoder matrix is orthogonalised under a layout (docs/design.md section 14).

A stacked matrix [L, m, n] whose m or n side is split over a group of g devices (tp, fsdp) can be
orthogonalised by Newton-Schulz three ways (k = min(m, n), K = max(m, n), fp32, per device):

    gram        in place: XLA all-reduces the k x k Gram matrix X X^T at every iteration; only where
                the split side is the long one (split on k, X X^T would need all of X)
    gather      the matrix gathered once onto every rank of the group, iterated redundantly there,
                each rank keeping its own slice
    distribute  the layer axis split over the group instead (an all-to-all): each rank orthogonalises
                L / g whole layers and an all-to-all sends them back (DistMuon / Dion)

Each way is a sharding constraint on the momentum before optax's Newton-Schulz and one back to the
parameter's layout after it (training/optimizers.py); its collectives and FLOPs are written here once,
priced on a machine of configs/hardware.yaml, and `train.muon.comm=auto` takes the cheapest per matrix.
tests/test_muon_layout.py checks each way's collectives against the compiled update's HLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.config import Config, ConfigError, MuonConfig
from boost_jax.config.hardware import Hardware, one_machine, ring_seconds
from boost_jax.model.weights import abstract_model
from boost_jax.parallel.plan import Plan
from boost_jax.training.optimizers import is_layer_matrix, latent_head_blocks, matrix_ns_flops

WAYS = ("gram", "gather", "distribute")
WHY_NOT = {"gram": "its Gram matrix is a sum over shards only where the long side is split, and its short side is",
           "distribute": "its layers on a device do not divide over the group"}
FP32 = 4  # Muon's momentum and its Newton-Schulz run in fp32


@dataclass(frozen=True)
class Way:
    """One way to orthogonalise one stacked matrix, per device: where Newton-Schulz runs (`at`) and
    where the parameter lives (`home`), the collectives it adds as (kind, bytes of one per device, how
    many), its FLOPs, and the group."""

    name: str  # "local" for a matrix no device splits, else one of WAYS
    at: P
    home: P  # the parameter's own layout, where the update returns
    collectives: tuple[tuple[str, int, int], ...]
    flops: float
    group: int
    crosses_nodes: bool

    def seconds(self, hw: Hardware) -> float:
        comm = sum(n * ring_seconds(kind, self.group, nbytes, self.crosses_nodes, hw)
                   for kind, nbytes, n in self.collectives)
        # fp32 GEMMs run as TF32 on tensor cores at JAX's default precision: half the bf16 peak
        return comm + self.flops / (hw.peak_flops / 2 * hw.gemm_efficiency)

    @property
    def bytes(self) -> int:
        return sum(nbytes * n for _, nbytes, n in self.collectives)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def ways(shape: tuple[int, int, int], spec: P, mesh_shape: dict[str, int], ns_steps: int,
         gpus_per_node: int | None = None, block_rows: int | None = None) -> dict[str, Way]:
    """The ways open to one stacked [L, m, n] matrix laid out by `spec` on a mesh of `mesh_shape`
    (axis name -> size, outermost first): {"local": ...} if no device splits m or n. `block_rows`: the
    matrix is block-diagonal, m / block_rows blocks [block_rows, n] stacked (latent heads'
    B, `optimizers.latent_head_blocks`), each orthogonalised on its own wherever it is, and a split of
    m keeps whole blocks on each device."""
    layers, m, n = shape
    split = [tuple(a for a in _axes(e) if mesh_shape[a] > 1) for e in (*spec, None, None, None)[:3]]
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)
    layers //= size(split[0])  # this device's layers (pp splits the stack)
    group_axes = split[1] + split[2]
    g = size(group_axes)
    rows = block_rows or m
    blocks = layers * (m // rows)  # matrices Newton-Schulz iterates, all of this device's layers
    k, big = min(rows, n), max(rows, n)
    full = blocks * matrix_ns_flops(k, big, ns_steps)
    if g == 1:
        return {"local": Way("local", spec, spec, (), full, 1, False)}
    # Mesh order is outermost first: a group over an axis spans it and every axis inside it.
    names = list(mesh_shape)
    span = size(names[min(names.index(a) for a in group_axes):])
    crosses = gpus_per_node is not None and span > gpus_per_node
    way = lambda name, at, cols, flops: Way(name, at, spec, cols, flops, g, crosses)
    out = {}
    if block_rows and not split[2]:  # whole blocks on each device: each iterated where it lies
        out["gram"] = way("gram", spec, (), full / g)
    elif not (split[1] if rows <= n else split[2]):  # only the long side split: a Gram matrix sums its shards
        kept = blocks // size(split[1]) if block_rows else blocks  # a split of m splits the blocks
        out["gram"] = way("gram", spec, (("all-reduce", FP32 * kept * k * k, ns_steps),),
                          kept * ns_steps * (4 * k * k * big / size(split[2] if block_rows else group_axes)
                                             + 2 * k ** 3))
    whole = FP32 * layers * m * n
    out["gather"] = way("gather", P(spec[0], None, None), (("all-gather", whole, 1),), full)
    if layers % g == 0:
        at = P((*_axes(spec[0]), *group_axes), None, None)
        out["distribute"] = way("distribute", at, (("all-to-all", whole // g, 2),), full / g)
    return out


def choose(options: dict[str, Way], comm: str, hw: Hardware, where: str) -> Way:
    """`comm`'s way among `options`, or with "auto" the cheapest on `hw`; a way the matrix's split does
    not allow names the matrix and the ways it allows."""
    if "local" in options:
        return options["local"]
    if comm == "auto":
        return min(options.values(), key=lambda w: w.seconds(hw))
    if comm not in options:
        raise ConfigError(f"train.muon.comm: {comm} cannot orthogonalise {where}: {WHY_NOT[comm]} (its split "
                          f"allows {', '.join(options)}; docs/design.md section 14)")
    return options[comm]


def layer_matrices(cfg: Config, plan: Plan) -> dict[tuple[str, ...], tuple[tuple[int, ...], P]]:
    """{path: (shape, spec)} of every stacked decoder matrix ([L, in, out] under "layers") on `plan`."""
    state = abstract_model(cfg)[1]
    params, specs = nnx.to_pure_dict(state), plan.param_specs(state)
    out = {}
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, P))):
        if is_layer_matrix(path, x):
            out[tuple(str(getattr(k, "key", k)) for k in path)] = (tuple(x.shape), spec)
    return out


def chosen_ways(cfg: Config, plan: Plan, gpus_per_node: int | None) -> dict[tuple[str, ...], Way]:
    """Each decoder matrix's way under `plan`: `train.muon.comm`, auto priced on `train.muon.hardware`;
    a group of more than `gpus_per_node` devices crosses nodes (None: never)."""
    u: MuonConfig = cfg.train.muon
    hw = one_machine(None, u.hardware)
    mesh_shape = dict(plan.mesh.shape)
    blocks = latent_head_blocks(cfg.model)
    return {path: choose(ways(shape, spec, mesh_shape, u.ns_steps, gpus_per_node, blocks.get(path)), u.comm, hw,
                         f"{'.'.join(path)} {list(shape)} laid out {spec}")
            for path, (shape, spec) in layer_matrices(cfg, plan).items()}


Placements = dict[tuple[str, ...], tuple[NamedSharding, NamedSharding]]


def placements(cfg: Config, plan: Plan) -> Placements:
    """{path: (where its Newton-Schulz runs, the parameter's own sharding)} of each split decoder
    matrix whose way moves it (gather, distribute); gram and unsplit matrices stay where they are."""
    if cfg.train.optimizer == "adamw":
        return {}
    # A group leaves the node where it spans more devices than one process holds.
    chosen = chosen_ways(cfg, plan, jax.local_device_count())
    return {path: (NamedSharding(plan.mesh, w.at), NamedSharding(plan.mesh, w.home))
            for path, w in chosen.items() if w.name in ("gather", "distribute")}


def way_seconds(cfg: Config, plan: Plan, hw: Hardware) -> dict[str, float]:
    """Seconds per step on `hw` of orthogonalising every decoder matrix one way, for each way every
    split matrix allows (unsplit matrices count as they run, in place)."""
    mesh_shape = dict(plan.mesh.shape)
    blocks = latent_head_blocks(cfg.model)
    options = [ways(shape, spec, mesh_shape, cfg.train.muon.ns_steps, hw.gpus_per_node, blocks.get(path))
               for path, (shape, spec) in layer_matrices(cfg, plan).items()]
    picks = {name: [o.get(name, o.get("local")) for o in options] for name in WAYS}
    return {name: sum(w.seconds(hw) for w in ws) for name, ws in picks.items() if all(ws)}
