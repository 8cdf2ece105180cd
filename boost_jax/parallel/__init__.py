"""Parallelism, in one place: the mesh (mesh.py), the tensor-parallel schemes as one table
(schemes.py), the plan handed to the model (plan.py), and the shard_map blocks whose collectives
must be exact (blocks.py). docs/design.md explains the math; the README's "Extending boost_jax"
says where a new scheme goes."""

from boost_jax.parallel.mesh import DP, FSDP, MESH_AXES, PP, TP, init_distributed, make_mesh, simulate_cpu_devices
from boost_jax.parallel.plan import Plan, abstract_plan, make_plan, single_device_plan
from boost_jax.parallel.schemes import SCHEMES, Scheme, default_scheme

__all__ = [
    "DP", "FSDP", "MESH_AXES", "PP", "TP", "Plan", "SCHEMES", "Scheme", "default_scheme", "init_distributed", "make_mesh",
    "abstract_plan", "make_plan", "simulate_cpu_devices", "single_device_plan",
]
