"""GPUs this machine does not have, as devices XLA:GPU compiles for (a deviceless compile).

    use_cpu_backend()                          # before JAX starts a backend: the CUDA plugin looks for no driver
    devices = gpu_devices(hw, nodes=2)         # 2 nodes of hw.gpus_per_node GPUs, as jax.Device objects
    plan = make_plan(cfg, devices)             # a plan on them: its programs compile with XLA:GPU

The CUDA plugin (`pip install 'boost_jax[gpu-compile]'`) compiles for a topology described by a
GpuTargetConfig, the text proto written here from `configs/hardware.yaml` (each GPU's
`compile_target`, its SM count, memory and bandwidth), so the GPU's figures have one home. The cuDNN
and CUDA runtime versions are those of the installed wheels: XLA picks the custom calls they offer
(no cuBLAS call without a runtime version, openxla/xla#25910). jax's own tests/deviceless_aot_test.py
and MaxText's train_compile.py do the same for their targets.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util

import jax
from jax._src import compilation_cache  # its once-per-process "cache used" memo (no public switch)
from jax.experimental import topologies

from boost_jax.config.hardware import Hardware
from boost_jax.runtime.errors import ConfigError, PackageError

EXTRA = "pip install -e '.[gpu-compile]'"
PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")  # this project's CUDA 12 wheels, or a CUDA 13 stack's
# The same on every NVIDIA GPU since Volta (CUDA's programming guide, "Compute capabilities").
CUDA_LIMITS = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 << 10,
               "threads_per_core_limit": 2048, "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535,
               "block_dim_limit_z": 65535, "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}


def use_cpu_backend() -> None:
    """JAX on the CPU alone. Must run before JAX starts a backend: otherwise the CUDA plugin looks for a
    driver, fails, and is dropped, and the GPU topology is gone with it."""
    jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def no_persistent_cache():
    """JAX's persistent compilation cache off for the block: an executable compiled without a device
    cannot be loaded back from it ("PjRtCompiler must be constructed with a Client"), and a user's
    cache would fill with entries no run reads. JAX reads its enable flag once per process, at the first
    compile, and remembers the answer (`compilation_cache.is_cache_used`): after a CPU compile the flag
    alone no longer keeps the cache out, so the block holds that memo at "not used" and puts it back."""
    before = jax.config.jax_enable_compilation_cache
    with compilation_cache._cache_initialized_mutex:
        memo = compilation_cache._cache_checked, compilation_cache._cache_used
        compilation_cache._cache_checked, compilation_cache._cache_used = True, False
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        with compilation_cache._cache_initialized_mutex:
            compilation_cache._cache_checked, compilation_cache._cache_used = memo


def _wheel_version(package: str, what: str) -> tuple[int, int]:
    """(major, minor) of the first installed of `package`'s CUDA 12 / 13 wheels."""
    for name in (f"{package}-cu12", f"{package}-cu13", package):
        try:
            major, minor = importlib.metadata.version(name).split(".")[:2]
        except importlib.metadata.PackageNotFoundError:
            continue
        return int(major), int(minor)
    raise PackageError(f"{package}-cu12 ({what}) is not installed: {EXTRA}")


def target_config(hw: Hardware) -> str:
    """The GpuTargetConfig text proto of `hw` (its `compile_target` in hardware.yaml)."""
    t = hw.compile_target
    if t is None:
        raise ConfigError(f"--hardware {hw.name}: its entry in the hardware file has no compile_target, so XLA "
                          "cannot compile for it (boost_jax/configs/hardware.yaml shows the fields)")
    info = {**CUDA_LIMITS, "shared_memory_per_core": t.shared_memory_per_core,
            "shared_memory_per_block_optin": t.shared_memory_per_block_optin, "core_count": hw.sms,
            "fpus_per_core": t.fpus_per_core, "memory_bandwidth": int(hw.hbm_bytes_per_s),
            "l2_cache_size": t.l2_cache_bytes, "clock_rate_ghz": t.clock_rate_ghz,
            "device_memory_size": int(hw.hbm_bytes)}
    fields = " ".join(f"{k}: {v}" for k, v in info.items())
    major, minor = t.compute_capability
    dnn = _wheel_version("nvidia-cudnn", "cuDNN, for the attention custom calls")
    runtime = _wheel_version("nvidia-cuda-runtime", "the CUDA runtime, for cuBLAS calls")
    return (f"gpu_device_info {{ {fields} cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
            f'platform_name: "CUDA" dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} }} '
            f"runtime_version {{ major: {runtime[0]} minor: {runtime[1]} }} "
            f'device_description_str: "{t.device_kind}"')


def gpu_devices(hw: Hardware, nodes: int, gpus: int = 0) -> list[jax.Device]:
    """`nodes` nodes of `hw.gpus_per_node` GPUs each (or `gpus` GPUs of one node), as devices to build
    a mesh on and compile for (none of them can run a program)."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {nodes}")
    if gpus and not (nodes == 1 and 1 <= gpus <= hw.gpus_per_node):
        raise ConfigError(f"--gpus {gpus}: a part of one node, 1 to {hw.gpus_per_node} GPUs of a {hw.name} "
                          f"(with --nodes 1); whole nodes are --nodes")
    if not any(importlib.util.find_spec(plugin) for plugin in PLUGINS):
        raise PackageError(f"compiling for GPUs needs JAX's CUDA plugin ({PLUGINS[0]}), not installed: {EXTRA}")
    text = target_config(hw)
    if jax.config.jax_platforms not in ("cpu",):
        raise ConfigError("a deviceless GPU compile needs JAX on the CPU (JAX_PLATFORMS=cpu, "
                          "launch.gpu_target.use_cpu_backend() before JAX starts)")
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=text,
                                                topology=f"1x{nodes}x{gpus or hw.gpus_per_node}")
    except Exception as e:  # noqa: BLE001 -- the plugin's own words are the message
        raise PackageError(f"the installed jaxlib and CUDA plugin cannot compile for {hw.name} "
                           f"(sm_{''.join(map(str, hw.compile_target.compute_capability))}): {e}") from None
    return list(topology.devices)
