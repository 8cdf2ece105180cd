"""Shared plumbing of the kernels: backend choice, block sizes, padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

IMPLS = ("pallas", "xla")
# jax 0.10 lowers a plain pl.pallas_call on GPU with Mosaic GPU (which lacks axis reductions);
# Triton's params select the Triton backend. Interpret mode ignores them.
TRITON = pltriton.CompilerParams()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def resolve_interpret(interpret: bool | None) -> bool:
    """CPU has no Pallas compiler: interpret there, compile (Triton on GPU) elsewhere."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def block(dim: int, cap: int) -> int:
    """A power of two >= 16 (Triton's tensor and dot minimums), at most `cap`, not much above `dim`."""
    return min(cap, max(16, 1 << (dim - 1).bit_length()))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `axis` up to `size` (zeros add nothing to sums or GEMMs); a no-op when it fits."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
