"""The architectures, as one table: what each arch does to a projection `x -> y` (docs/design.md section 1).

| arch  | output                          | latent h       | LaX carry |
|-------|---------------------------------|----------------|-----------|
| dense | x @ W                           | -              | no        |
| svd   | (x @ A) @ B                     | x @ A          | no        |
| cola  | silu(x @ A) @ B                 | silu(x @ A)    | no        |
| lax   | (h + h_prev) @ B, h as cola     | silu(x @ A)    | yes       |

Adding an arch is one entry in `ARCHS` (plus a preset if it needs one, and its tests): the layers
(`layers/lowrank.py`), parameter counts (`model/counts.py`), config validation, the TP schemes' arch lists
and export all read this table. It imports no JAX (the config validates against it in processes
that never start JAX), so the latent function is named: an activation of `jax.nn`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One architecture: what it does to every projection of a block."""

    name: str
    low_rank: bool  # factors A: [d_in, r], B: [r, d_out]; else one dense W: [d_in, d_out]
    # The `jax.nn` activation applied to x @ A to give the latent h; None: the identity (low-rank
    # archs only; layers/lowrank.py applies it).
    latent_activation: str | None
    # LaX: the same projection's latent of the previous decoder layer is added to h before B.
    carries_latents: bool
    # SwiGLU's gate SiLU when the config leaves `model.mlp_gate_silu` unset: CoLA/LaX drop it (their
    # latents are already nonlinear), dense/svd keep it.
    default_gate_silu: bool
    # Exported in the Hugging Face LLaMA layout (with the gate SiLU); else the boost layout (export.py).
    hf_llama_export: bool

    def linear_params(self, d_in: int, d_out: int, rank: int, groups: int = 1) -> int:
        """Parameters of one projection d_in -> d_out (`groups`: latent heads, a block-diagonal B of
        that many [r / g, d_out / g] blocks)."""
        return rank * (d_in + d_out // groups) if self.low_rank else d_in * d_out


ARCHS: dict[str, Arch] = {
    "dense": Arch("dense", low_rank=False, latent_activation=None, carries_latents=False, default_gate_silu=True,
                  hf_llama_export=True),
    "svd": Arch("svd", low_rank=True, latent_activation=None, carries_latents=False, default_gate_silu=True,
                hf_llama_export=False),
    "cola": Arch("cola", low_rank=True, latent_activation="silu", carries_latents=False, default_gate_silu=False,
                 hf_llama_export=False),
    "lax": Arch("lax", low_rank=True, latent_activation="silu", carries_latents=True, default_gate_silu=False,
                hf_llama_export=False),
}

# The KV caches a decode can keep, by `--cache` name (layers/kv_cache.py's CACHES): keys and values for
# every arch, the rank-r latents of v (latent_v) or of k and v (latent) for the low-rank ones. Named
# here so that the commands check the flag before JAX starts.
CACHE_KINDS = ("full", "latent_v", "latent")
AUTO_CACHE = "auto"  # not a kind: the one whose step a roofline models fastest for a model and layout (model/decode.choose_cache)
