"""A dense model factored into the svd arch: every projection W [d_in, d_out] becomes A [d_in, r],
B [r, d_out] with x A B ~ x W (the svd arch's layer is exactly (x A) B; cola and lax put a SiLU
between A and B, which no factorization of W reproduces: continue training from svd instead).

- `svd`: the truncated SVD W = U S V^T, A = U_r S_r^(1/2), B = S_r^(1/2) V_r^T: the best rank-r
  approximation of W itself.
- `whiten` (SVD-LLM, Wang et al. 2024): the best rank-r approximation of the projection's output on
  calibration inputs X. With C = X^T X / n = L L^T (Cholesky), ||X (W - A B)|| is ||L^T W - L^T A B||
  up to a rotation, so the truncated SVD of L^T W = U S V^T gives A = L^-T U_r S_r^(1/2),
  B = S_r^(1/2) V_r^T.

Each projection's relative error is reported both ways: of the weight, ||W - A B|| / ||W||, and of
its output on the calibration inputs, ||X (W - A B)|| / ||X W|| = sqrt(tr(E^T C E) / tr(W^T C W)).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boost_jax.config import ConfigError, ModelConfig
from boost_jax.model import Model, residual, unstack_layers
from boost_jax.model.counts import layer_linear_shapes
from boost_jax.ops.attention import Positions
from boost_jax.parallel import single_device_plan

ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
# Which calibration input each projection reads: the normed residual (q, k, v; gate, up), the heads'
# output (o), the MLP's hidden activation (down).
INPUT_OF = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "heads", "gate": "mlp_in", "up": "mlp_in",
            "down": "hidden"}


def factor(w: np.ndarray, rank: int, cov: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of rank `rank` for W [d_in, d_out]: truncated SVD, or whitened by `cov` = X^T X / n."""
    w = np.asarray(w, np.float64)
    if cov is None:
        u, s, vt = np.linalg.svd(w, full_matrices=False)
        root = np.sqrt(s[:rank])
        return u[:, :rank] * root, root[:, None] * vt[:rank]
    return whitened_factor(w, rank, whitening(cov)[0])


def whitened_factor(w: np.ndarray, rank: int, lower: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of rank `rank` for W whitened by `lower`, any square root of C (L L^T = C, `whitening`)."""
    w = np.asarray(w, np.float64)
    u, s, vt = np.linalg.svd(lower.T @ w, full_matrices=False)
    root = np.sqrt(s[:rank])
    return np.linalg.solve(lower.T, u[:, :rank] * root), root[:, None] * vt[:rank]


# Ridges tried in turn, as fractions of C's mean diagonal: the first is SVD-LLM's; the larger ones
# rescue a covariance that rounding left slightly indefinite (a calibration set much smaller than d_in).
DAMPING = (1e-6, 1e-4, 1e-2)
PLAIN = f"cholesky, damping {DAMPING[0]:g}"  # SVD-LLM's whitening, no fallback


def whitening(cov: np.ndarray) -> tuple[np.ndarray, str]:
    """(L with L L^T ~ C, how it was found): the Cholesky factor of C plus the first ridge of DAMPING
    that makes it positive definite, else (how: "eigendecomposition") Q sqrt(max(lambda, ridge)) of
    C = Q diag(lambda) Q^T, which is a square root of C with its eigenvalues floored at the largest ridge."""
    scale = max(float(np.mean(np.diag(cov))), 1e-30)
    for ridge in DAMPING:
        try:
            return np.linalg.cholesky(cov + ridge * scale * np.eye(len(cov))), f"cholesky, damping {ridge:g}"
        except np.linalg.LinAlgError:
            continue
    values, vectors = np.linalg.eigh((cov + cov.T) / 2)
    return vectors * np.sqrt(np.maximum(values, DAMPING[-1] * scale)), "eigendecomposition"


def errors(w: np.ndarray, a: np.ndarray, b: np.ndarray, cov: np.ndarray | None) -> dict[str, float]:
    """Relative error of the weight, and of the output on the calibration inputs (when given)."""
    e = np.asarray(w, np.float64) - a @ b
    out = {"weight": float(np.linalg.norm(e) / np.linalg.norm(w))}
    if cov is not None:
        # clipped at 0: float32 grams of a few samples can leave C slightly indefinite
        out["output"] = float(np.sqrt(max(np.einsum("ij,ik,kj->", e, cov, e), 0) / np.einsum("ij,ik,kj->", w, cov, w)))
    return out


def svd_config(dense: ModelConfig, rank: int) -> ModelConfig:
    """The svd arch of a dense model's shape at `rank` (attention and MLP), with its gate SiLU."""
    if dense.arch != "dense":
        raise ConfigError(f"compression factors a dense model; this one is {dense.arch}")
    cfg = dataclasses.replace(dense, arch="svd", attn_rank=rank, mlp_rank=rank, mlp_gate_silu=dense.mlp_gate_silu)
    cfg = cfg.resolved()
    too_big = {name: min(d_in, d_out) for name, (d_in, d_out, _) in layer_linear_shapes(cfg).items() if rank > min(d_in, d_out)}
    if too_big:
        raise ConfigError(f"--rank {rank} is larger than the matrices it factors: {too_big} (rank <= min(d_in, d_out))")
    return cfg


def compress(dense: ModelConfig, params: dict, rank: int, covs: list[dict] | None = None) -> tuple[ModelConfig, dict, list]:
    """(svd config, its parameters, per layer {projection: errors}) of a dense model's parameters
    (a pure dict, layers stacked); `covs` (one dict per layer, from `covariances`) whitens."""
    cfg = svd_config(dense, rank)
    layers = jax.tree.map(np.asarray, params["layers"])
    report, stacked = [], {"attn": {}, "mlp": {}}
    for i in range(dense.n_layers):
        row = {}
        roots = {k: whitening(c) for k, c in covs[i].items()} if covs else {}  # one per input, shared
        for block, names in (("attn", ATTENTION), ("mlp", MLP)):
            for name in names:
                w = layers[block][name]["w"][i]
                cov = covs[i][INPUT_OF[name]] if covs else None
                if cov is None:
                    a, b = factor(w, rank)
                    row[name] = errors(w, a, b, cov)
                else:
                    lower, how = roots[INPUT_OF[name]]
                    a, b = whitened_factor(w, rank, lower)
                    row[name] = {**errors(w, a, b, cov), "whitening": how}
                slot = stacked[block].setdefault(name, {"a": [], "b": []})
                slot["a"].append(a.astype(w.dtype))
                slot["b"].append(b.astype(w.dtype))
                if "bias" in layers[block][name]:  # q/k/v bias: kept dense, after B (docs/design/hf-models.md)
                    slot.setdefault("bias", []).append(layers[block][name]["bias"][i])
        report.append(row)
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layers"] = {"attn_norm": layers["attn_norm"], "mlp_norm": layers["mlp_norm"],
                     **{block: {n: {k: np.stack(v) for k, v in f.items()} for n, f in projections.items()}
                        for block, projections in stacked.items()}}
    return cfg, out, report


def covariances(model: Model, tokens: np.ndarray, batch: int = 8) -> list[dict[str, np.ndarray]]:
    """Per layer, X^T X / n of each projection input (INPUT_OF) over the calibration tokens [N, S],
    from the model's own activations (one device, layer by layer, `batch` rows at a time)."""
    cfg = model.cfg
    plan = single_device_plan(cfg)
    graphdef, state = nnx.split(model.layers)
    embed = jax.jit(lambda e, t: e[t].astype(cfg.dtype))

    @jax.jit
    def layer(layer_state, x):
        block = nnx.merge(graphdef, layer_state)
        proj = plan.projections(cfg, plan, {})
        attn_in = block.attn_norm(x)
        heads, _ = block.attn.heads(x, block.attn_norm, proj, Positions())
        x = residual(plan, x + proj("o", block.attn.o, heads, ("act_heads", "heads")))
        mlp_in = block.mlp_norm(x)
        hidden = block.mlp.hidden(x, block.mlp_norm, proj)
        x = residual(plan, x + proj("down", block.mlp.down, hidden, ("act_mlp", "mlp")))
        gram = lambda v: (lambda f: f.T @ f)(v.reshape(-1, v.shape[-1]).astype(jnp.float32))
        return x, {"attn_in": gram(attn_in), "heads": gram(heads), "mlp_in": gram(mlp_in), "hidden": gram(hidden)}

    layers = unstack_layers(state, cfg.n_layers)
    sums = [None] * cfg.n_layers
    for lo in range(0, len(tokens), batch):
        x = embed(model.embed[...], jnp.asarray(tokens[lo:lo + batch]))
        for i, layer_state in enumerate(layers):
            x, grams = layer(layer_state, x)
            grams = jax.device_get(grams)
            sums[i] = grams if sums[i] is None else {k: sums[i][k] + grams[k] for k in grams}
    n = tokens.size
    return [{k: np.asarray(v, np.float64) / n for k, v in layer_sums.items()} for layer_sums in sums]
