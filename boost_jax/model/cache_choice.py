"""`--cache auto`: the cache kind whose decode step a simple roofline of the device models fastest.

A decode step reads every weight and every cached token once and computes the attention of one
query per row; the kinds trade bytes for FLOPs (docs/design.md section 11,
docs/design/absorbed-attention.md). Each kind's step is modelled as max(bytes read / bandwidth,
FLOPs / peak) per device: the weights (the same for every kind) plus the cache's bytes per token
(exact, as the plan lays it out), and the attention's FLOPs per cached token and per query of that
kind. Fewest bytes alone picked the rebuilding latent cache, which decodes slower wherever the device
computes fewer FLOPs per byte than a key's rebuild costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from boost_jax.config import ModelConfig
from boost_jax.config.hardware import load_hardware
from boost_jax.model.counts import count

# The roofline of a platform's device: FLOP/s and bytes/s. GPUs: hardware.yaml's H100 (the compile
# target of this repository's GPU figures); CPUs: what `bench step` and `bench decode` measure on the
# hosts of docs/design.md section 11 (~150 GFLOP/s over ~60 GB/s).
CPU_ROOFLINE = (150e9, 60e9)
GPU_MACHINE = "h100-80gb"
# The shape a step is modelled at where the caller does not know its own: a long context, one row.
REFERENCE = (1, 4096)


@dataclass(frozen=True)
class Roofline:
    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def of(cls, platform: str) -> Roofline:
        if platform == "cpu":
            return cls(*CPU_ROOFLINE)
        hw = load_hardware()[GPU_MACHINE]
        return cls(hw.peak_flops, hw.hbm_bytes_per_s)


def attention_flops(kind: str, cfg: ModelConfig, context: int) -> float:
    """FLOPs of one layer's attention for one query over `context` cached tokens, on one device of
    none split (divide by the heads' split): scores and values per cached token, and each kind's own
    work (latent_v and latent: B_v after the weighted latents; latent: every key rebuilt from its
    latent; latent with decoupled RoPE: q into the latent space, B_k absorbed)."""
    h, kvh, dh, r, g, dr = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.attn_rank, cfg.attn_latent_heads,
                            cfg.attn_rope_dims)
    if kind == "full":
        return 4.0 * h * dh * context
    values_up = 2.0 * h * (r // g) * dh  # (p h_v) B_v, per query
    weighted = 2.0 * h * (r // g) * context
    if kind == "latent_v":
        return 2.0 * h * dh * context + weighted + values_up
    if dr:  # absorbed: scores on the latents and rotary keys, q_n B_k^T per query
        return 2.0 * h * (r // g + dr) * context + weighted + values_up + 2.0 * h * (dh - dr) * (r // g)
    return 2.0 * h * dh * context + weighted + values_up + 2.0 * r * kvh * dh / g * context  # keys rebuilt


def step_seconds(kind: str, cfg: ModelConfig, cache_bytes_per_token: int, heads_split: int, tp: int,
                 roofline: Roofline, batch: int, context: int) -> float:
    """A decode step's modelled seconds on one device: max(bytes / bandwidth, FLOPs / peak)."""
    itemsize = 2 if cfg.dtype == "bfloat16" else 4
    counts = count(cfg, context)
    weight_bytes = counts.matmul_params * itemsize / tp
    read = weight_bytes + batch * context * cache_bytes_per_token
    flops = batch * (2.0 * counts.matmul_params / tp
                     + cfg.n_layers * attention_flops(kind, cfg, context) / heads_split)
    return max(read / roofline.bytes_per_s, flops / roofline.flops_per_s)
