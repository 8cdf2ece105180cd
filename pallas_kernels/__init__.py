"""Pallas kernels for BOOST's fused paths, each beside its jnp twin and an analytic custom_vjp.

- `norm_down` / `recover`: online RMSNorm fused with the row-parallel down-projection
  (docs/design.md section 4): one all-reduce of (h, s) per norm instead of two.
- `grouped_matmul`: the batched column-parallel up-projections (docs/design.md section 5).

`impl="pallas"` runs the kernel (Triton on GPU; interpret mode on CPU, chosen automatically),
`impl="xla"` the twin. Both work under jit, grad, checkpoint and shard_map(check_vma=False).
"""

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.online_rmsnorm import norm_down, recover

__all__ = ["grouped_matmul", "norm_down", "recover"]
