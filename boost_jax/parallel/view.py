"""What the modules under the plan read of it: the shard_map blocks, the projections' strategies and
context parallelism take a `plan.Plan`, which plan.py builds from them; they name its type by this
Protocol, so that no import (type-only or not) runs back up to plan.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
from jax.sharding import Mesh, PartitionSpec

from boost_jax.config.schemes import Scheme


class PlanView(Protocol):
    """A plan's mesh and scheme, its layout by logical axis names, and how attention runs on it
    (`plan.Plan` is the one there is)."""

    @property
    def mesh(self) -> Mesh: ...

    @property
    def scheme(self) -> Scheme: ...

    @property
    def attention(self) -> str: ...  # xla | cudnn

    @property
    def cp_attention(self) -> str: ...  # gather | ring | latent

    @property
    def flat_tokens(self) -> bool: ...

    @property
    def interpret_kernels(self) -> bool: ...  # Pallas kernels emulated (no GPU among the mesh's devices)

    def spec(self, axes: Sequence[str | None]) -> PartitionSpec: ...

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array: ...

    def axis(self, name: str) -> str | None: ...

    def size(self, name: str) -> int: ...
