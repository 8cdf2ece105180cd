"""LLaMA MLP: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) or identity for CoLA, whose latents are already nonlinear."""

from __future__ import annotations

import jax
from flax import nnx

from boost_jax.config import ModelConfig
from boost_jax.layers.lowrank import Crossing, Linear
from boost_jax.sharding import constrain


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, linear_kwargs: dict, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.gate_silu = cfg.mlp_gate_silu
        lin = lambda i, o, axes: Linear(i, o, rank=cfg.mlp_rank, axes=axes, rngs=rngs, **linear_kwargs)
        self.gate = lin(d, f, ("embed", "mlp"))
        self.up = lin(d, f, ("embed", "mlp"))
        self.down = lin(f, d, ("mlp", "embed"))

    def __call__(self, x: jax.Array, apply: Crossing) -> jax.Array:
        g = apply("gate", self.gate, x)
        if self.gate_silu:
            g = jax.nn.silu(g)
        h = constrain(g * apply("up", self.up, x), ("batch", "seq", "act_mlp"))
        return apply("down", self.down, h)
