"""Per-layer-group norms of gradients, parameters and updates: where a run goes wrong shows first as
one layer's gradients or updates growing apart from the rest.

Groups: `embed`, `final_norm`, `lm_head`, and per decoder layer `layer_NN/attn`, `layer_NN/mlp` and
`layer_NN/norms` (its two RMSNorm scales), NN the model's layer (the stored stack's order, which a
pipeline permutes, is undone). Computed inside the compiled train step, on the steps that log.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

KINDS = ("grad", "param", "update")


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


def health_norms(grads: dict, params: dict, updates: dict, layer_order: Sequence[int]) -> dict[str, jax.Array]:
    """{`<kind>_norm/<group>`: norm} for the gradients, the parameters after the update and the updates."""
    return {f"{kind}_norm/{name}": v for kind, tree in zip(KINDS, (grads, params, updates))
            for name, v in group_norms(tree, layer_order).items()}
