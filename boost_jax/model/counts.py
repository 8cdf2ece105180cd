"""A model's exact parameter counts and analytic FLOPs per token, from its config alone.

Model FLOPs follow the usual convention (PaLM / MaxText): 2 FLOPs per multiply-add of every
matmul, training = 3x forward (no remat recompute counted), causal attention counts half of the
full S x S score and value matmuls, and the embedding gather is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from boost_jax.config import ModelConfig
from boost_jax.config.archs import ARCHS


@dataclass(frozen=True)
class Counts:
    params: int  # every trainable parameter
    matmul_params: int  # weights that take part in a matmul per token (layers + LM head)
    forward_flops_per_token: float
    train_flops_per_token: float


def layer_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """(d_in, d_out, rank) of each projection of one decoder layer (decoupled RoPE: k's B makes the
    position-free part of each key, `rotary_key_params` the rest)."""
    d, f, dq, dkv = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    ra, rm = cfg.attn_rank, cfg.mlp_rank
    dk = cfg.n_kv_heads * (cfg.head_dim - cfg.attn_rope_dims)
    return {"q": (d, dq, ra), "k": (d, dk, ra), "v": (d, dkv, ra), "o": (dq, d, ra),
            "gate": (d, f, rm), "up": (d, f, rm), "down": (f, d, rm)}


def layer_linear_groups(cfg: ModelConfig) -> dict[str, int]:
    """The latent heads of each projection of one decoder layer: k's and v's B are block-diagonal in
    `model.attn_latent_heads` groups, every other B (and dense W) one block."""
    return {name: cfg.attn_latent_heads if name in ("k", "v") else 1 for name in layer_linear_shapes(cfg)}


def rotary_key_params(cfg: ModelConfig) -> int:
    """Decoupled RoPE's key projection of one layer (`model.attn_rope_dims` d_r): dense [d, g d_r]."""
    return cfg.d_model * cfg.attn_latent_heads * cfg.attn_rope_dims


def embedding_params(cfg: ModelConfig) -> int:
    """The embedding table's parameters and, untied, the LM head's: what "non-embedding" leaves out."""
    return cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)


def count(cfg: ModelConfig, seq_len: int) -> Counts:
    """Parameters and FLOPs of a resolved model config at a sequence length (a block-diagonal B
    counted by its blocks: latent heads hold and multiply r d_out / g of its r d_out)."""
    cfg.require_resolved("model.counts.count")
    d, v, n = cfg.d_model, cfg.vocab_size, cfg.n_layers
    groups = layer_linear_groups(cfg)
    per_layer = sum(ARCHS[cfg.arch].linear_params(*s, groups=groups[name]) for name, s in layer_linear_shapes(cfg).items())
    per_layer += rotary_key_params(cfg)
    head = d * v
    bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0  # q/k/v biases
    params = embedding_params(cfg) + n * (per_layer + 2 * d + bias) + d
    matmul_params = n * per_layer + head
    attention = n * 2 * cfg.n_heads * cfg.head_dim * seq_len  # causal QK^T and AV, per token
    forward = 2.0 * matmul_params + attention
    return Counts(params, matmul_params, forward, 3.0 * forward)
