"""Which attention a plan runs: `model.attention` resolved for the plan's devices, dtype and layout,
decided here alone (`resolve_attention` over the table `CUDNN_TAKES`).

cuDNN's fused flash kernel (`jax.nn.dot_product_attention(implementation="cudnn")`) runs a subset of
what XLA's attention runs, and JAX checks that subset only while tracing the step (at float32:
`NotImplementedError: Q must be fp16/bf16/fp8_e4m3fn/fp8_e5m2`). So `auto` takes cuDNN's where every
row of the table holds and XLA's where one fails, and says which (`Plan.attention_why`, in the line
that names the plan); an explicit `cudnn` where a row fails is refused by name before anything
compiles. docs/design/attention-on-gpus.md has the rule and where each row comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from boost_jax.runtime.errors import ConfigError


@dataclass(frozen=True)
class AttentionSite:
    """What decides whether cuDNN's attention can run a plan's causal self-attention."""

    platform: str | None  # the plan's devices' ("gpu", "cpu", ...); None: a device-free mesh (abstract_plan)
    capability: tuple[int, int] | None  # the compute capability JAX's cuDNN checks read (`checked_capability`)
    dtype: str  # model.dtype: q's, k's and v's
    head_dim: int
    n_kv_heads: int
    tp: int
    kv_split_alike: bool  # the kv heads split over tp as the query heads are (not replicated: Scheme.rules_for)


CUDNN_DTYPES = ("float16", "bfloat16")  # and fp8, which no model.dtype names
HEAD_DIM_MULTIPLE = 8
HOPPER = (9, 0)


def max_head_dim(capability: tuple[int, int] | None) -> int:
    """The widest head cuDNN's fp16/bf16 flash kernel takes: 256 from Hopper, 128 before."""
    return 256 if capability is not None and capability >= HOPPER else 128


def checked_capability(device: jax.Device) -> tuple[int, int] | None:
    """The compute capability JAX checks cuDNN's limits against: that of the process's own GPU
    backend (jax/_src/cudnn/fused_attention_stablehlo.py `check_compute_capability`), not the plan's
    devices'. In a deviceless compile (`python -m boost_jax.compile`: JAX on the CPU) there is none,
    and JAX checks as before Hopper: None."""
    if device.platform != "gpu" or jax.default_backend() != "gpu":
        return None
    major, minor = device.compute_capability.split(".")
    return int(major), int(minor)


def _head_dim_why(s: AttentionSite) -> str:
    if s.capability is None:
        where = "here (JAX checks a deviceless compile or plan as before Hopper; 256 where it runs on a Hopper GPU)"
    else:
        where = f"on this GPU (compute capability {s.capability[0]}.{s.capability[1]}; 256 from Hopper, 9.0)"
    return (f"cuDNN's fused attention takes a head dim that is a multiple of {HEAD_DIM_MULTIPLE} and at most "
            f"{max_head_dim(s.capability)} {where}, not model.head_dim={s.head_dim}")


# What cuDNN's attention needs of a site, in the order checked, each with why a site fails it and what
# makes it run there: the first that fails is the one named.
CUDNN_TAKES: tuple[tuple[Callable[[AttentionSite], bool], Callable[[AttentionSite], str], str], ...] = (
    (lambda s: s.dtype in CUDNN_DTYPES,
     lambda s: f"cuDNN's fused attention takes {' or '.join(CUDNN_DTYPES)} only, not model.dtype={s.dtype}",
     "set model.dtype=bfloat16, or "),
    (lambda s: s.head_dim % HEAD_DIM_MULTIPLE == 0 and s.head_dim <= max_head_dim(s.capability), _head_dim_why, ""),
    (lambda s: s.kv_split_alike,
     lambda s: (f"parallel.tp={s.tp} does not divide model.n_kv_heads={s.n_kv_heads}, so the kv heads are "
                "replicated while the query heads are split, and cuDNN's attention cannot be partitioned that "
                "way (XLA:GPU: \"Query, key and value should have same sharding\")"),
     "choose a tp that divides the kv heads, or "),
)


def cudnn_refusal(site: AttentionSite) -> tuple[str, str] | None:
    """Why cuDNN's attention cannot run at `site` and what would make it, or None where it can."""
    for holds, why, fix in CUDNN_TAKES:
        if not holds(site):
            return why(site), fix
    return None


def resolve_attention(choice: str, site: AttentionSite) -> tuple[str, str]:
    """`model.attention` at `site`: (the implementation, why auto took XLA's attention on GPUs, or "").
    auto is cuDNN's kernel on GPUs where it can run, XLA's elsewhere (an abstract mesh, platform None,
    has no devices: auto stands for the CPU compile that prices it); an explicit cudnn where it cannot
    run raises ConfigError naming the key, the value and the limit."""
    refusal = cudnn_refusal(site)
    if choice == "auto":
        if site.platform != "gpu":
            return "xla", ""
        return ("cudnn", "") if refusal is None else ("xla", f"auto: {refusal[0]}")
    if choice != "cudnn":
        return choice, ""
    if site.platform not in ("gpu", None):
        raise ConfigError(f"model.attention=cudnn needs GPU devices, this mesh has {site.platform} "
                          "(auto picks cudnn on GPUs and xla elsewhere)")
    if refusal is not None:
        why, fix = refusal
        raise ConfigError(f"model.attention=cudnn: {why}; {fix}model.attention=auto (XLA's attention here)")
    return "cudnn", ""
