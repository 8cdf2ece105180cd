"""The optimizers `train.optimizer` chooses (docs/design.md section 14).

    adamw     AdamW on every parameter, no weight decay on norm scales and biases (the default)
    muon      optax's Muon (`scale_by_muon`) on every 2-D weight of the decoder layers, each layer's
              matrix on its own (the stacked [L, in, out] leaves' layer axis is a batch axis of
              `MuonDimensionNumbers`), AdamW on the rest (embedding, LM head, norm scales)
    spectron  Muon's orthogonalised momentum on each low-rank factor, renormalised per (A, B) pair by
              the factors' spectral norms so that the product's update dA B + A dB is bounded
    invariant_muon  each factor's orthogonalised momentum taken in the metric of the other factor, so
              a pair rescaled to (cA, B/c) gets the same update of the product AB

All three run after the global-norm clip and share the learning-rate schedule. Under a layout, muon's
and spectron's Newton-Schulz runs where training/muon_layout.py places each split matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from optax.contrib import MuonDimensionNumbers, scale_by_muon

# optax.contrib.muon's own shape scale and Newton-Schulz (not re-exported in 0.2.8)
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape

from boost_jax.config import ModelConfig, MuonConfig, OptimizerName, TrainConfig
from boost_jax.runtime.errors import ConfigError

OPTIMIZERS = get_args(OptimizerName)
# A decoder layer's weight, stacked [L, in, out]: the layer axis is a batch axis of the orthogonalisation.
LAYER_MATRIX = MuonDimensionNumbers(reduction_axis=1, output_axis=2)


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at `schedule_steps` (default: steps)."""
    horizon = t.schedule_steps or t.steps
    warmup = min(t.warmup_steps, horizon)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(horizon, warmup + 1), end_value=t.lr * t.min_lr_ratio,
    )


# {parameter path: (where its Newton-Schulz runs, its own sharding)}: training/muon_layout.placements
Placements = dict[tuple[str, ...], tuple[NamedSharding, NamedSharding]]
# {parameter path: rows of one block} of each stacked [L, r, n] that holds the blocks [r / g, n] of a
# block-diagonal [r, g n] matrix (latent heads: `latent_head_blocks`)
Blocks = dict[tuple[str, ...], int]


def latent_head_blocks(model: ModelConfig) -> Blocks:
    """k's and v's B with `model.attn_latent_heads` = g > 1: each is the block-diagonal matrix of its g
    stacked blocks of r / g rows (layers/lowrank.py), whose polar factor is its blocks' own polar
    factors (a block-diagonal matrix's SVD is its blocks'): Muon orthogonalises each block, Spectron
    takes the largest block's spectral norm. None at g = 1."""
    g = model.attn_latent_heads
    return {} if g == 1 else {("layers", "attn", name, "b"): model.attn_rank // g for name in ("k", "v")}


def make_optimizer(t: TrainConfig, params: dict, placements: Placements | None = None,
                   split: bool = False, blocks: Blocks | None = None) -> optax.GradientTransformation:
    """`t.optimizer` after the global-norm clip (`params`: the model's pure dict, for its structure;
    `placements`: where the split decoder matrices are orthogonalised, none on one device; `split`:
    whether the parameters are laid out over more than one device; `blocks`: the block-diagonal
    matrices, `latent_head_blocks` of the model)."""
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    if t.optimizer == "adamw":
        return optax.chain(clip, adamw(t))
    if t.optimizer not in ("muon", "spectron", "invariant_muon"):
        raise ValueError(f"train.optimizer: unknown optimizer {t.optimizer!r}; choose one of {OPTIMIZERS}")
    matrix = orthogonalised(t, placements or {}, split, blocks or {})
    return optax.chain(clip, optax.partition({"matrix": matrix, "adamw": adamw(t)}, labels(params)))


def adamw(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW with `train.b1/b2/weight_decay`; no weight decay on norm scales and biases."""
    decays = lambda tree: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in ("scale", "bias"), tree)
    return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decays)


def is_layer_matrix(path: tuple, leaf: Any) -> bool:
    """A 2-D weight of a decoder layer: a stacked [L, in, out] leaf under `layers`."""
    return any(getattr(k, "key", None) == "layers" for k in path) and leaf.ndim == 3


def labels(params: dict) -> dict:
    """Each leaf's group: "matrix" (orthogonalised) or "adamw"."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: "matrix" if is_layer_matrix(path, x) else "adamw", params)


def orthogonalised(t: TrainConfig, placements: Placements, split: bool = False,
                   blocks: Blocks | None = None) -> optax.GradientTransformation:
    """The decoder matrices' side: optax's Muon momentum, its Newton-Schulz per layer (per block of
    the `blocks` matrices) where `placements` put each matrix, then Muon's shape scale (muon) or the factor pairs'
    renormalisation (spectron), decoupled weight decay, the learning rate."""
    m = t.muon
    dims = lambda tree: jax.tree.map(lambda _: LAYER_MATRIX, tree)
    if t.optimizer == "invariant_muon":
        if split or blocks:  # its r x r eigendecompositions have no placed form (training/muon_layout.py) yet
            raise ConfigError("train.optimizer=invariant_muon runs on one device (parameters not split over devices) "
                              "and without latent heads (model.attn_latent_heads=1); use muon or spectron")
        steps = [invariant_factor_steps(m, t.weight_decay)]  # its weight decay is its own (split per pair)
    else:
        steps = [newton_schulz(m, placements, blocks),
                 scale_by_shape(dims, m.consistent_rms) if t.optimizer == "muon"
                 else scale_by_factor_pairs(m.consistent_rms, t.spectron.power_steps, unroll=split, blocks=blocks),
                 optax.add_decayed_weights(t.weight_decay)]
    return optax.chain(
        # optax's Muon with no Newton-Schulz iteration is its momentum and Nesterov step alone ("aol"
        # pre-scales inside the first iteration, so none happens): the iterations follow, placed.
        scale_by_muon(ns_steps=0, preconditioning="aol", beta=m.momentum, nesterov=m.nesterov,
                      weight_dimension_numbers=dims),
        *steps,
        optax.scale_by_learning_rate(lr_schedule(t)),
    )


def newton_schulz(m: MuonConfig, placements: Placements, blocks: Blocks | None = None) -> optax.GradientTransformation:
    """optax's Newton-Schulz (Frobenius pre-scaling, `m.ns_steps` iterations of `m.ns_coeffs`) on each
    layer of each stacked matrix (each block of a `blocks` one), constrained to run where `placements`
    says and to return to the parameter's sharding (training/muon_layout.py); a matrix not in
    `placements` stays where it is."""
    coeffs = jnp.asarray(m.ns_coeffs if len(m.ns_coeffs) == 3 else np.reshape(m.ns_coeffs, (-1, 3)))
    blocks = blocks or {}

    def one(path, x):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        orthogonalise = partial(_orthogonalise, coeffs=coeffs, steps=m.ns_steps, rows=blocks.get(keys))
        if keys not in placements:
            return orthogonalise(x)
        # A shard_map, so every iteration runs on the blocks `at` gives each device, with no collective
        # inside (left to itself, XLA pulls the iterations back to the parameter's layout); the momentum
        # is pinned to the parameter's layout before it, so one array moves, not the two it is made of.
        at, home = placements[keys]
        x = jax.lax.with_sharding_constraint(x, home)
        x = jax.shard_map(orthogonalise, mesh=at.mesh, in_specs=at.spec, out_specs=at.spec, check_vma=False)(x)
        return jax.lax.with_sharding_constraint(x, home)

    return optax.stateless(lambda updates, _: jax.tree_util.tree_map_with_path(one, updates))


def _orthogonalise(x: jax.Array, *, coeffs: jax.Array, steps: int, rows: int | None) -> jax.Array:
    """Newton-Schulz of each layer of x [L, m, n], or (`rows`) of each block [rows, n] of its m rows:
    a device's share of a block-diagonal B holds whole blocks, so the same reshape serves it."""
    if rows is None:
        return orthogonalize_via_newton_schulz(x, coeffs, steps, dimension_numbers=LAYER_MATRIX)
    # [blocks, L, rows, n]: the blocks outermost, so that where tp splits B's rows (whole blocks per
    # device) the batch optax flattens stays split as they are, with no collective to regroup it.
    per_block = jnp.moveaxis(x.reshape(x.shape[0], -1, rows, x.shape[-1]), 1, 0)
    dims = MuonDimensionNumbers(reduction_axis=2, output_axis=3)
    out = orthogonalize_via_newton_schulz(per_block, coeffs, steps, dimension_numbers=dims)
    return jnp.moveaxis(out, 0, 1).reshape(x.shape)


def newton_schulz_flops(t: TrainConfig, params: dict) -> float:
    """FLOPs of one step's orthogonalisation (muon, spectron; 0 for adamw) over all of `params` (shapes
    suffice), on one device: `matrix_ns_flops` of each layer's m x n matrix, k = min(m, n), K = max(m, n)."""
    if t.optimizer == "adamw":
        return 0.0
    return float(sum(x.shape[0] * matrix_ns_flops(min(x.shape[1:]), max(x.shape[1:]), t.muon.ns_steps)
                     for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if is_layer_matrix(path, x)))


def matrix_ns_flops(k: int, big: int, steps: int) -> float:
    """One k x K matrix's Newton-Schulz (k <= K): per iteration X X^T (2 k^2 K), its square (2 k^3) and
    the product with X (2 k^2 K)."""
    return steps * (4 * k * k * big + 2 * k ** 3)


# ----------------------------------------------------------------------------- spectron


def shape_scale(fan_in: int, fan_out: int, consistent_rms: float | None) -> float:
    """Muon's update scale of a fan_in x fan_out matrix (optax's `scale_by_shape`): consistent_rms x
    sqrt(max(fan_in, fan_out)) (AdamW's update RMS, Moonlight), or sqrt(max(1, fan_out / fan_in))."""
    if consistent_rms is None:
        return max(1.0, fan_out / fan_in) ** 0.5
    return consistent_rms * max(fan_in, fan_out) ** 0.5


def top_singular(m: jax.Array, v: jax.Array, steps: int, unroll: bool = False) -> tuple[jax.Array, jax.Array]:
    """(sigma [L], v [L, r]): the largest singular value of each [p, r] matrix of `m` [L, p, r] and its
    right singular vector, by `steps` power iterations on m^T m from `v` (`unroll`: see
    `power_iterate`). Only matrix-vector products: sigma is a lower bound that tightens as v is
    carried from step to step."""
    f32 = m.astype(jnp.float32)
    v = power_iterate(lambda v: jnp.einsum("lpr,lp->lr", f32, jnp.einsum("lpr,lr->lp", f32, v)), v, steps, unroll)
    return jnp.linalg.norm(jnp.einsum("lpr,lr->lp", f32, v), axis=-1), v


def power_iterate(apply: Callable[[jax.Array], jax.Array], v: jax.Array, steps: int,
                  unroll: bool = False) -> jax.Array:
    """`steps` power iterations of the linear map `apply` from the vectors `v` [L, n], each
    renormalised to unit length: the dominant eigenvector of each of the L maps. `unroll`: as
    straight-line code, no while loop (`scale_by_factor_pairs` says why)."""
    def iterate(_, v):
        w = apply(v)
        return w / (jnp.linalg.norm(w, axis=-1, keepdims=True) + 1e-30)

    return jax.lax.fori_loop(0, steps, iterate, v, unroll=unroll)


def factor_pairs(tree: Any, prefix: tuple = ()) -> dict[tuple, dict]:
    """{path: {"a": A, "b": B}} of every low-rank projection (a dict with arrays "a" [L, in, r] and
    "b" [L, r, out]) in a nested dict."""
    if not isinstance(tree, dict):
        return {}
    if isinstance(tree.get("a"), jax.Array) and isinstance(tree.get("b"), jax.Array):
        return {prefix: tree}
    return {path: pair for k, sub in tree.items() for path, pair in factor_pairs(sub, (*prefix, k)).items()}


class FactorPairState(NamedTuple):
    """Per factor pair, nested like the parameters: the power iterations' right singular vectors of
    A and of B^T, each [L, r]."""

    vectors: dict


def _nested(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def scale_by_factor_pairs(consistent_rms: float | None, power_steps: int, unroll: bool = False,
                          blocks: Blocks | None = None) -> optax.GradientTransformation:
    """Spectron's renormalisation of orthogonalised factor updates (O_A, O_B) of each pair W = A B:
    both times s = c(d_in, d_out) / (sigma(A) + sigma(B)), so that
        ||dA B + A dB||_2 <= s (||O_A|| sigma(B) + sigma(A) ||O_B||) <= c max(||O_A||, ||O_B||),
    the spectral norm Muon gives a dense d_in x d_out update (c: `shape_scale` of the product).
    A block-diagonal B (`blocks`) has its largest block's spectral norm, each block's power iteration
    its own (its vector is that block's rows of B^T's [L, r] vector).

    `unroll`: the power iterations as straight-line code, for factors split over devices. Each
    iteration all-reduces there, and a while loop of collectives runs asynchronously on XLA's CPU
    runtime, which then starts the step's later collectives beside the loop's later iterations in an
    order that differs by device: fsdp=2 x dp=2 deadlocked (issue 62). Unrolled, the iterations'
    collectives are the step's own, in program order; on one device the loop stays (power_steps=300
    unrolled compiles for minutes)."""

    def init(params):
        def start(pair):  # the same unit vector of length r for every layer, A's and B^T's
            layers, rank = pair["a"].shape[0], pair["a"].shape[2]
            return jnp.full((layers, rank), rank ** -0.5, jnp.float32)

        return FactorPairState(_nested({path: {"a": start(pair), "b": start(pair)}
                                        for path, pair in factor_pairs(params).items()}))

    def update(updates, state, params):
        if params is None:
            raise ValueError("spectron's renormalisation reads the factors: pass params to update()")
        scaled, vectors = jax.tree.map(lambda x: x, updates), {}
        for path, pair in factor_pairs(params).items():
            v = _at(state.vectors, path)
            a, b = pair["a"], pair["b"]
            sigma_a, va = top_singular(a, v["a"], power_steps, unroll)
            sigma_b, vb = _top_singular_of_b(b, v["b"], power_steps, unroll, (blocks or {}).get((*path, "b")))
            s = shape_scale(a.shape[1], b.shape[2], consistent_rms) / (sigma_a + sigma_b + 1e-12)
            node = _at(scaled, path)
            for k in ("a", "b"):
                node[k] = (node[k] * s[:, None, None]).astype(node[k].dtype)
            vectors[path] = {"a": va, "b": vb}
        return scaled, FactorPairState(_nested(vectors))

    return optax.GradientTransformation(init, update)


def _top_singular_of_b(b: jax.Array, v: jax.Array, steps: int, unroll: bool,
                       rows: int | None) -> tuple[jax.Array, jax.Array]:
    """`top_singular` of B^T for b [L, r, n]; with `rows`, of the block-diagonal matrix whose blocks
    [rows, n] b stacks: each block's, the largest per layer."""
    if rows is None:
        return top_singular(jnp.swapaxes(b, 1, 2), v, steps, unroll)
    layers, r, n = b.shape
    per_block = jnp.swapaxes(b.reshape(-1, rows, n), 1, 2)  # [L r / rows, n, rows]
    sigma, v = top_singular(per_block, v.reshape(-1, rows), steps, unroll)
    return sigma.reshape(layers, -1).max(axis=-1), v.reshape(layers, r)


def _at(tree: dict, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree



# ----------------------------------------------------------------------------- invariant_muon

# Damping of the factors' r x r Gram matrices, relative to their mean eigenvalue: relative, so it
# scales with the pair's split (c^2 for cA) and leaves the update exactly invariant.
GRAM_DAMPING = 1e-5


def inverse_sqrt(gram: jax.Array) -> jax.Array:
    """(G + damping)^(-1/2) of each symmetric [r, r] matrix of `gram` [L, r, r], by its eigendecomposition."""
    r = gram.shape[-1]
    damping = GRAM_DAMPING * jnp.trace(gram, axis1=-2, axis2=-1)[:, None, None] / r
    w, v = jnp.linalg.eigh(gram + damping * jnp.eye(r, dtype=gram.dtype))
    return jnp.einsum("lij,lj,lkj->lik", v, jnp.maximum(w, 1e-30) ** -0.5, v)


def invariant_factor_steps(m: MuonConfig, weight_decay: float) -> optax.GradientTransformation:
    """LoRA-Muon's step (arXiv 2606.12921) of each factor of a pair W = A B: Muon's step taken in the
    metric the other factor induces (docs/design.md section 14), with M_A, M_B the factors' Nesterov
    momenta and P_A = (A^T A)^(-1/2), P_B = (B B^T)^(-1/2):

        O_A = NS(M_A P_B) P_B,    O_B = P_A NS(P_A M_B),    both times c(d_in, d_out) / 2,

    plus weight_decay / 2 times each factor (the paper's split decay: W decays by weight_decay, to
    first order, as a dense matrix under Muon would; other matrices take the whole weight_decay).

    Under (A, B) -> (cA, B/c) the momenta scale as (M_A / c, c M_B) and P_A, P_B as (P_A / c, c P_B),
    so NS's arguments are unchanged and O_A B + A O_B, the product's update, is the same. P_B B has
    orthonormal rows, so ||O_A B||_2 = ||NS(.)||_2 ~ 1 and the product moves by at most c, Muon's
    step of a dense d_in x d_out matrix. A matrix of no pair gets Muon's step."""
    shape = lambda fan_in, fan_out: shape_scale(fan_in, fan_out, m.consistent_rms)
    coeffs = jnp.asarray(m.ns_coeffs if len(m.ns_coeffs) == 3 else np.reshape(m.ns_coeffs, (-1, 3)))
    ns = lambda x: orthogonalize_via_newton_schulz(x, coeffs, m.ns_steps, dimension_numbers=LAYER_MATRIX)

    def update(updates, state, params):
        if params is None:
            raise ValueError("invariant_muon's step reads the factors: pass params to update()")
        pairs = factor_pairs(params)
        in_pair = lambda path: tuple(str(getattr(k, "key", k)) for k in path[:-1]) in pairs
        out = jax.tree_util.tree_map_with_path(
            lambda path, x, p: x if in_pair(path) else ns(x) * shape(x.shape[1], x.shape[2]) + weight_decay * p,
            updates, params)
        for path, pair in pairs.items():
            a, b = pair["a"].astype(jnp.float32), pair["b"].astype(jnp.float32)
            p_a = inverse_sqrt(jnp.einsum("lir,lis->lrs", a, a))
            p_b = inverse_sqrt(jnp.einsum("lro,lso->lrs", b, b))
            node = _at(out, path)
            s = shape(a.shape[1], b.shape[2]) / 2
            o_a = jnp.einsum("lir,lrs->lis", ns(jnp.einsum("lir,lrs->lis", node["a"].astype(jnp.float32), p_b)), p_b)
            o_b = jnp.einsum("lrs,lso->lro", p_a, ns(jnp.einsum("lrs,lso->lro", p_a, node["b"].astype(jnp.float32))))
            node["a"] = (s * o_a + weight_decay / 2 * a).astype(node["a"].dtype)
            node["b"] = (s * o_b + weight_decay / 2 * b).astype(node["b"].dtype)
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
