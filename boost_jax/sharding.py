"""Logical axes -> mesh axes.

Every parameter carries `logical_axes` metadata (one name per dimension, e.g. ("embed", "rank")),
and activations are constrained with `constrain(x, ("batch", "seq", "act_embed"))`. A parallel
scheme is only a table of rules mapping those names onto mesh axes; the model never names a mesh
axis itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Mesh axis names, outermost first.
DP, FSDP, TP = "dp", "fsdp", "tp"
MESH_AXES = (DP, FSDP, TP)

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Data parallelism only: the batch is split over dp and fsdp, every weight replicated.
DATA_PARALLEL_RULES: Rules = {"batch": (DP, FSDP)}

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "boost_jax_sharding", default=None
)


def spec(axes: Sequence[str | None], rules: Rules) -> P:
    """PartitionSpec for a tuple of logical axis names; unknown names stay replicated."""
    out, used = [], set()
    for name in axes:
        mesh_axes = rules.get(name) if name is not None else None
        flat = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        if used & set(flat):  # a mesh axis may shard only one dimension of a tensor
            flat = ()
        used |= set(flat)
        out.append(flat[0] if len(flat) == 1 else (flat or None))
    return P(*out)


def param_specs(params: nnx.State, rules: Rules) -> dict:
    """PartitionSpecs, as a pure dict shaped like `params.to_pure_dict()`, from `logical_axes` metadata."""
    out: dict = {}
    for path, var in nnx.to_flat_state(params):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = spec(var.get_metadata().get("logical_axes") or (), rules)
    return out


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Activate activation-sharding rules for code traced inside this block."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op when no rules are active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes, rules)))
