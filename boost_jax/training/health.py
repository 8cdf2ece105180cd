"""Per-layer-group norms of gradients, parameters and updates: where a run goes wrong shows first as
one layer's gradients or updates growing apart from the rest.

Groups: `embed`, `final_norm`, `lm_head`, and per decoder layer `layer_NN/attn`, `layer_NN/mlp` and
`layer_NN/norms` (its two RMSNorm scales), NN the model's layer (the stored stack's order, which a
pipeline permutes, is undone). Computed inside the compiled train step, on the steps that log.

For the low-rank archs, per decoder layer group also the spectral growth Spectron (arXiv
2602.12429) blames for low-rank loss spikes: the largest spectral norm among the group's A factors
and among its B factors, the same for their latest updates, and the smallest stable rank
||A B||_F^2 / ||A B||_2^2 among its pairs, all from r x r matrices and power iterations on the factors
(never the d x d product). A latent-heads B (`optimizers.latent_head_blocks`) counts as the
block-diagonal matrix its stacked blocks stand for.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.training.optimizers import Blocks, factor_pairs, power_iterate, top_singular

KINDS = ("grad", "param", "update")
POWER_STEPS = 100  # power iterations from a fixed start, on the steps that log (matrix-vector products: cheap)


def group_of(key: str) -> str:
    """The group of a decoder layer's submodule: its attention, its MLP, or its norms."""
    return "norms" if key.endswith("_norm") else key


def group_norms(tree: dict, layer_order: Sequence[int]) -> dict[str, jax.Array]:
    """{group: fp32 L2 norm} of a parameter-shaped pure dict (`nnx.to_pure_dict` of the model)."""
    square = lambda x, axes: jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axes)
    sums: dict[str, jax.Array] = {}
    for top, sub in tree.items():
        if top != "layers":
            sums[top] = sum(square(x, None) for x in jax.tree.leaves(sub))
            continue
        for key, module in sub.items():  # stacked [L, ...]: one sum per stored layer
            per_layer = sum(square(x, tuple(range(1, x.ndim))) for x in jax.tree.leaves(module))
            for position, layer in enumerate(layer_order):
                name = f"layer_{layer:02d}/{group_of(key)}"
                sums[name] = sums.get(name, 0.0) + per_layer[position]
    return {name: jnp.sqrt(v) for name, v in sorted(sums.items())}


def health_norms(grads: dict, params: dict, updates: dict, layer_order: Sequence[int],
                 blocks: Blocks | None = None) -> dict[str, jax.Array]:
    """{`<kind>_norm/<group>`: norm} for the gradients, the parameters after the update and the updates,
    and the factor pairs' spectra (`factor_spectra`; `blocks`: the block-diagonal B's)."""
    return {**{f"{kind}_norm/{name}": v for kind, tree in zip(KINDS, (grads, params, updates))
               for name, v in group_norms(tree, layer_order).items()},
            **factor_spectra(params, updates, layer_order, blocks or {})}


def spectral_norm(m: jax.Array) -> jax.Array:
    """[L] largest singular value of each [p, r] matrix of `m` [L, p, r] (power iterations)."""
    start = jnp.full((m.shape[0], m.shape[2]), m.shape[2] ** -0.5, jnp.float32)
    return top_singular(m, start, POWER_STEPS)[0]


def b_spectral_norm(b: jax.Array, rows: int | None) -> jax.Array:
    """[L] largest singular value of each B of `b` [L, r, n]; with `rows` (latent heads: blocks of
    `rows` stacked rows, the block-diagonal B they stand for) its largest block's, which the stacked
    matrix's only bounds from above (a block-diagonal matrix's SVD is its blocks')."""
    if rows is None:
        return spectral_norm(jnp.swapaxes(b, 1, 2))  # through r-vectors
    layers, r, n = b.shape
    per_block = spectral_norm(jnp.swapaxes(b.reshape(layers * (r // rows), rows, n), 1, 2))
    return jnp.max(per_block.reshape(layers, r // rows), axis=1)


def largest_eigenvalue(m: jax.Array) -> jax.Array:
    """[L] largest eigenvalue of each [r, r] matrix of `m` [L, r, r] whose eigenvalues are real and
    non-negative (a product of two PSD matrices), by power iteration."""
    apply = lambda v: jnp.einsum("lrs,ls->lr", m, v)
    v = power_iterate(apply, jnp.full(m.shape[:2], m.shape[1] ** -0.5, m.dtype), POWER_STEPS)
    return jnp.linalg.norm(apply(v), axis=-1)


def factor_spectra(params: dict, updates: dict, layer_order: Sequence[int], blocks: Blocks) -> dict[str, jax.Array]:
    """Per layer group with factor pairs: `spectral_a|b/<group>` (largest sigma among its A | B factors),
    `update_spectral_a|b/<group>` (the same of their updates) and `stable_rank/<group>` (smallest among
    its products A B: with G = A^T A and H = B B^T (r x r), ||A B||_F^2 = tr(G H) and ||A B||_2^2 the
    largest eigenvalue of G H, by power iteration. No QR: LAPACK's, inside the step's cond on a
    tp=4 mesh, deadlocked XLA's CPU runtime). A B in `blocks` is its block-diagonal matrix: H keeps
    only its blocks' B_j B_j^T."""
    found: dict[str, list[jax.Array]] = {}
    steps = factor_pairs(updates)
    for path, pair in factor_pairs(params).items():
        if path[0] != "layers":
            continue
        a, b = (pair[k].astype(jnp.float32) for k in ("a", "b"))
        rows = blocks.get((*path, "b"))
        g, h = jnp.einsum("lir,lis->lrs", a, a), jnp.einsum("lro,lso->lrs", b, b)
        if rows is not None:  # the stacked blocks' cross terms B_i B_j^T are no part of the matrix
            h = h * np.kron(np.eye(b.shape[1] // rows, dtype=np.float32), np.ones((rows, rows), np.float32))
        values = {"spectral_a": spectral_norm(a), "spectral_b": b_spectral_norm(b, rows),
                  "update_spectral_a": spectral_norm(steps[path]["a"].astype(jnp.float32)),
                  "update_spectral_b": b_spectral_norm(steps[path]["b"].astype(jnp.float32), rows),
                  "stable_rank": jnp.sum(g * h, axis=(1, 2)) / largest_eigenvalue(jnp.einsum("lrs,lst->lrt", g, h))}
        for position, layer in enumerate(layer_order):
            for kind, v in values.items():
                found.setdefault(f"{kind}/layer_{layer:02d}/{group_of(path[1])}", []).append(v[position])
    pick = lambda name: jnp.min if name.startswith("stable_rank") else jnp.max
    return {name: pick(name)(jnp.stack(vs)) for name, vs in sorted(found.items())}
