"""Latent heads (`model.attn_latent_heads`) as weights: the block-diagonal B of k and v written dense
for an export and read back, and a low-rank model's k/v factors refactored into g latent heads
(`python -m boost_jax.convert import ... model.attn_latent_heads=G`), the nearest block-diagonal
factorisation with its relative error per layer.

The nearest factorisation depends on the latent function (docs/design.md section 11):
- svd (identity latent): k = x A B, so group j's outputs are x (A B_j) with B_j = B[:, cols_j]; the
  best rank-r/g factors of A B_j are its truncated SVD (Eckart-Young), and the groups' outputs are
  disjoint, so the per-group optimum is the whole one. Error: ||A B - A' B'|| / ||A B||.
- cola, lax (SiLU latent): silu(x A) commutes with permuting A's columns and with nothing else that
  mixes them, so the latents themselves are kept: each goes to one group, B'_j = B[S_j, cols_j] (the
  least-squares B' for latents of equal scale) and the rest of B is dropped. The latents are assigned
  greedily by the energy ||B[i, cols_j]||^2 each would keep (exact at g = 1); LaX adds each layer's
  latent to the next one's, so it uses one assignment for all layers (the energies summed).
  Error: ||B - P B'|| / ||B|| (P the assignment), the output's error for latents of equal scale.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from boost_jax.config import ModelConfig
from boost_jax.config.archs import ARCHS

PROJECTIONS = ("k", "v")


def dense_b(b: np.ndarray, groups: int) -> np.ndarray:
    """[..., r, n] stacked blocks [r / g, n] -> the [..., r, g n] block-diagonal B they stand for."""
    *lead, r, n = b.shape
    out = np.zeros((*lead, r, groups * n), b.dtype)
    k = r // groups
    for j in range(groups):
        out[..., j * k:(j + 1) * k, j * n:(j + 1) * n] = b[..., j * k:(j + 1) * k, :]
    return out


def stacked_b(dense: np.ndarray, groups: int) -> tuple[np.ndarray, float]:
    """(the g blocks of a [..., r, g n] B stacked as [..., r, n], the largest |entry| off the blocks):
    `dense_b`'s inverse where that is 0."""
    r, cols = dense.shape[-2:]
    k, n = r // groups, cols // groups
    blocks = np.concatenate([dense[..., j * k:(j + 1) * k, j * n:(j + 1) * n] for j in range(groups)], axis=-2)
    off = np.abs(dense - dense_b(blocks, groups)).max(initial=0.0)
    return blocks, float(off)


def method(arch: str) -> str:
    """How `convert` factors an arch's k and v (the module's docstring says why)."""
    return "truncated SVD of each group's slice of A B" if ARCHS[arch].latent_activation is None \
        else "latents assigned to groups, B's other entries dropped"


def convert(cfg: ModelConfig, params: dict, groups: int) -> tuple[ModelConfig, dict, list[dict]]:
    """(cfg with `groups` latent heads, params (a pure dict of numpy arrays, layers stacked) with k and v
    refactored, per layer {"k": {"weight": relative error}, "v": ...}). Any source g: its B is made
    dense first, so g -> 1 is exact."""
    attn = params["layers"]["attn"]
    new_attn, errors = dict(attn), {}
    for name in PROJECTIONS:
        a = np.asarray(attn[name]["a"], np.float64)  # [L, d, r]
        b = dense_b(np.asarray(attn[name]["b"], np.float64), cfg.attn_latent_heads)  # [L, r, D]
        if groups == 1:  # one block: B itself
            a2, b2, errors[name] = a, b, np.zeros(cfg.n_layers)
        else:
            factor = _svd if ARCHS[cfg.arch].latent_activation is None else _assign
            a2, b2, errors[name] = factor(a, b, groups, ARCHS[cfg.arch].carries_latents)
        dtype = np.asarray(attn[name]["b"]).dtype
        new_attn[name] = {**attn[name], "a": a2.astype(dtype), "b": b2.astype(dtype)}  # a bias as it was
    params = {**params, "layers": {**params["layers"], "attn": new_attn}}
    report = [{name: {"weight": float(errors[name][i])} for name in PROJECTIONS} for i in range(cfg.n_layers)]
    return dataclasses.replace(cfg, attn_latent_heads=groups), params, report


def _svd(a, b, groups, _carries):
    """Per layer and group: the rank-r/g truncated SVD of A B_j, split as U sqrt(S), sqrt(S) V^T; the
    error from the dropped singular values (Eckart-Young)."""
    layers, _, r = a.shape
    k, n = r // groups, b.shape[-1] // groups
    a2, b2 = np.empty_like(a), np.empty((layers, r, n))
    lost = np.zeros(layers)
    for i in range(layers):
        for j in range(groups):
            u, s, vt = np.linalg.svd(a[i] @ b[i, :, j * n:(j + 1) * n], full_matrices=False)
            a2[i, :, j * k:(j + 1) * k] = u[:, :k] * np.sqrt(s[:k])
            b2[i, j * k:(j + 1) * k] = np.sqrt(s[:k])[:, None] * vt[:k]
            lost[i] += (s[k:] ** 2).sum()
    total = np.einsum("ldr,lrn->ldn", a, b)
    return a2, b2, np.sqrt(lost / (total**2).sum(axis=(1, 2)))


def _assign(a, b, groups, carries):
    """Each latent kept in one group (A's columns permuted), B'_j = B[S_j, cols_j]."""
    layers, r, cols = b.shape
    energy = (b.reshape(layers, r, groups, cols // groups) ** 2).sum(-1)  # [L, r, g]: latent i's in group j
    perms = [assignment(energy.sum(0), groups)] * layers if carries else [assignment(e, groups) for e in energy]
    permuted = np.stack([b[i][p] for i, p in enumerate(perms)])
    b2 = stacked_b(permuted, groups)[0]
    a2 = np.stack([a[i][:, p] for i, p in enumerate(perms)])
    return a2, b2, np.linalg.norm(permuted - dense_b(b2, groups), axis=(1, 2)) / np.linalg.norm(b, axis=(1, 2))


def assignment(energy: np.ndarray, groups: int) -> np.ndarray:
    """A permutation of the r latents, group j's r / g at positions [j r/g, (j+1) r/g): greedily the
    (latent, group) pairs of the most energy first, each group taking r / g latents."""
    r = energy.shape[0]
    owner, room = np.full(r, -1), np.full(groups, r // groups)
    for flat in np.argsort(-energy, axis=None, kind="stable"):
        i, j = divmod(int(flat), groups)
        if owner[i] < 0 and room[j]:
            owner[i], room[j] = j, room[j] - 1
    return np.argsort(owner, kind="stable")
