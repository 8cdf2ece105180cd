"""LLaMA MLP: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) or identity for CoLA, whose latents are already nonlinear."""

from __future__ import annotations

import jax
from flax import nnx

from boost_jax.config import ModelConfig
from boost_jax.layers.lowrank import Linear
from boost_jax.parallel.projections import Projections


class MLP(nnx.Module):
    """down(act(gate(norm(x))) * up(norm(x))), each projection run by the plan's strategy."""

    def __init__(self, cfg: ModelConfig, linear_kwargs: dict, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.gate_silu = cfg.mlp_gate_silu
        lin = lambda i, o, axes: Linear(i, o, rank=cfg.mlp_rank, axes=axes, rngs=rngs, **linear_kwargs)
        self.gate = lin(d, f, ("embed", "mlp"))
        self.up = lin(d, f, ("embed", "mlp"))
        self.down = lin(f, d, ("mlp", "embed"))

    def __call__(self, x: jax.Array, norm, proj: Projections) -> jax.Array:
        """x: the residual stream; `norm` is applied to it first (fused into gate/up under btp)."""
        return proj("down", self.down, self.hidden(x, norm, proj), ("act_mlp", "mlp"))

    def hidden(self, x: jax.Array, norm, proj: Projections) -> jax.Array:
        """act(gate(norm(x))) * up(norm(x)) [B, S, d_ff]: what down reads."""
        mlp = ("mlp", "act_mlp")
        gu = proj.normed(x, norm, {"gate": self.gate, "up": self.up}, {"gate": mlp, "up": mlp})
        g = jax.nn.silu(gu["gate"]) if self.gate_silu else gu["gate"]
        return proj.plan.constrain(g * gu["up"], ("batch", "seq", "act_mlp"))
