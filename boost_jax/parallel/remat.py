"""Activation checkpointing presets for the scanned decoder layer, by name (`train.remat`)."""

from __future__ import annotations

from collections.abc import Callable

import jax

# Checkpoint names the model tags its activations with (jax.ad_checkpoint.checkpoint_name):
# LATENT, the rank-r latents (under btp, each all-reduce output); RESIDUAL, the residual stream at
# a chunk boundary (after each sub-block's add).
LATENT, RESIDUAL = "latent", "residual"

REMAT_POLICIES: dict[str, Callable | None] = {
    # Keep every activation the backward pass needs (fastest, most memory).
    "none": None,
    # Keep only each layer's input (the scan carry); recompute the layer in backward.
    "full": jax.checkpoint_policies.nothing_saveable,
    # BOOST's low-rank checkpointing: keep the rank-r latents (post all-reduce under btp, so
    # recomputation never repeats a collective) and the residual at chunk boundaries.
    "lowrank": jax.checkpoint_policies.save_only_these_names(LATENT, RESIDUAL),
}
# Presets never faster than others on the same layout, only smaller: full remat recomputes every
# GEMM of a layer's forward, of which the others save at least the rank-r latents (the planner sizes
# it only where those do not fit; tests/test_planner.py checks the performance model agrees). Not
# so between "none" and "lowrank": saving an activation costs a write and a read, recomputing an
# elementwise one can cost less, and the performance model prices lowrank faster at llama-mini.
SLOWER_THAN = {"full": ("none", "lowrank")}


def remat(fn: Callable, mode: str) -> Callable:
    """`fn` under the checkpoint policy of `train.remat=mode`."""
    if mode not in REMAT_POLICIES:
        raise ValueError(f"train.remat: unknown mode {mode!r}; choose one of {sorted(REMAT_POLICIES)}")
    if mode == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[mode], prevent_cse=False)
