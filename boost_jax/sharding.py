"""Logical axes -> mesh axes: where each tensor-parallel scheme lives.

Every parameter carries `logical_axes` metadata (one name per dimension, e.g. ("embed", "rank")),
and activations are constrained with `constrain(x, ("batch", "seq", "act_embed"))`. A parallel
scheme is a table of rules mapping those names onto mesh axes (`scheme_rules`); the model never
names a mesh axis itself, and XLA's SPMD partitioner inserts the collectives the layouts imply.

Parameter names: vocab, table_embed (d of the embedding table and LM head), embed (d inside the
blocks), heads, kv_heads, mlp (d_ff), rank (r), norm, layers. Activation names: batch, seq,
act_embed (the residual stream), act_heads, act_kv_heads, act_mlp, act_latent ([T, r]), act_vocab.
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

SCHEMES = ("megatron", "vanilla", "btp")


def scheme_rules(scheme: str, *, shard_kv_heads: bool = True) -> Rules:
    """The rules of a TP scheme (BOOST.md sections 2-3). Every scheme splits the batch over dp and
    fsdp and shards each weight over fsdp on a dimension tp leaves alone (FSDP/ZeRO-3).
    `shard_kv_heads=False` replicates kv heads when there are fewer than tp of them (GQA)."""
    kv = TP if shard_kv_heads else None
    common = {"batch": (DP, FSDP), "vocab": TP, "table_embed": FSDP, "act_vocab": TP}
    if scheme == "megatron":
        # Column-parallel q/k/v/gate/up (split heads, d_ff), row-parallel o/down: attention and the
        # SwiGLU product run on local heads/columns, two [T, d] all-reduces per layer.
        return {**common, "embed": FSDP, "heads": TP, "kv_heads": kv, "mlp": TP,
                "act_heads": TP, "act_kv_heads": kv, "act_mlp": TP}
    if scheme == "vanilla":
        # Megatron applied to each (A, B) pair: A split on r, B split on r, an all-reduce of the full
        # width output after every B; attention and the MLP product run replicated.
        return {**common, "rank": TP, "embed": FSDP, "heads": FSDP, "kv_heads": FSDP, "mlp": FSDP,
                "act_latent": TP}
    if scheme == "btp":
        # Bottleneck-aware TP: the residual stream stays sharded on d; every A is row-parallel (one
        # [T, r] all-reduce), every B column-parallel; latents replicated; r is never split.
        return {**common, "embed": TP, "heads": TP, "kv_heads": kv, "mlp": TP, "norm": TP, "rank": FSDP,
                "act_embed": TP, "act_heads": TP, "act_kv_heads": kv, "act_mlp": TP}
    raise ValueError(f"unknown TP scheme {scheme!r}; choose one of {SCHEMES}")

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


def active() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) activated by `use_rules`, if any."""
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op when no rules are active."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes, rules)))
