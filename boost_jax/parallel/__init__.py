"""Parallelism: the mesh (mesh.py), the plan handed to the model (plan.py), which attention it runs
(attention_choice.py: cuDNN's where cuDNN takes the dtype, head dim and layout) and what the modules
under it read of it (view.py), how each scheme runs a block's projections and where attention
finds its keys (projections.py), the shard_map blocks whose collectives must be exact (blocks.py),
pipeline stages (pipeline.py), context parallelism: its token order and the shard_map regions
around the attention op of boost_jax/ops/ (context.py), the heartbeat that names a lost peer
process (peers.py), and remat.py: the activations the blocks save and the checkpoint policies
(`train.remat`) that keep them. The schemes themselves are a table in
`boost_jax/config/schemes.py`; docs/design.md explains the math; docs/guides/extending.md says
where a new scheme goes."""

from boost_jax.parallel.mesh import init_distributed, make_mesh
from boost_jax.parallel.plan import Plan, abstract_plan, make_plan, single_device_plan

__all__ = ["Plan", "abstract_plan", "init_distributed", "make_mesh", "make_plan", "single_device_plan"]
