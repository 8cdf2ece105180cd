"""The GPUs of the performance model and what their links cost: the constants of
`boost_jax/configs/hardware.yaml`, validated, and the ring collectives' seconds on them. The
performance model (analysis/perf_model.py) prices compiled programs with these; the optimizers
(training/muon_layout.py) price the ways to orthogonalise a split matrix with them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from boost_jax import configs
from boost_jax.config.config import load_yaml
from boost_jax.runtime.errors import ConfigError

HARDWARE_FILE = configs.HARDWARE


@dataclass(frozen=True)
class CompileTarget:
    """What XLA:GPU needs to know of a GPU to compile for it without one (`hardware.yaml`'s
    `compile_target`; launch/gpu_target.py writes it as a GpuTargetConfig)."""

    device_kind: str
    compute_capability: tuple[int, int]
    clock_rate_ghz: float
    fpus_per_core: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    l2_cache_bytes: int


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_flops: float
    sms: int
    gemm_tile: tuple[int, int]
    gemm_efficiency: float
    attention_efficiency: float
    hbm_bytes_per_s: float
    memory_efficiency: float
    kernel_overhead_s: float
    hbm_bytes: float
    gpus_per_node: int
    node_link_bytes_per_s: float
    peer_link_bytes_per_s: float
    net_bytes_per_s: float
    collective_efficiency: float
    collective_latency_s: float
    p2p_latency_s: float
    compile_target: CompileTarget | None = None  # None: `python -m boost_jax.compile` cannot target it


def load_hardware(path: str | Path = HARDWARE_FILE) -> dict[str, Hardware]:
    """Every machine in a hardware YAML, validated: a missing or unknown key names the machine."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hardware file not found: {path}")
    raw = load_yaml(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of machine names to constants")
    optional = {"compile_target"}
    fields = {f.name for f in dataclasses.fields(Hardware)} - {"name"}
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"{path}: {name}: expected a mapping of constants")
        if missing := fields - optional - set(spec):
            raise ConfigError(f"{path}: {name}: missing {', '.join(sorted(missing))}")
        if unknown := set(spec) - fields:
            raise ConfigError(f"{path}: {name}: unknown {', '.join(sorted(unknown))} (known: {', '.join(sorted(fields))})")
        tile = spec["gemm_tile"]
        if not (isinstance(tile, list) and len(tile) == 2 and all(isinstance(t, int) and t > 0 for t in tile)):
            raise ConfigError(f"{path}: {name}.gemm_tile must be [rows, cols] of positive integers, got {tile!r}")
        values = {k: (tuple(v) if k == "gemm_tile" else v) for k, v in spec.items()}
        if "compile_target" in values:
            values["compile_target"] = _compile_target(path, name, values["compile_target"])
        for k, v in values.items():
            if k not in ("description", "gemm_tile", "compile_target") and not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"{path}: {name}.{k} must be a positive number, got {v!r}")
        out[name] = Hardware(name=name, **values)
    return out


def _compile_target(path: Path, name: str, spec) -> CompileTarget:
    where = f"{path}: {name}.compile_target"
    fields = {f.name for f in dataclasses.fields(CompileTarget)}
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: expected a mapping of {', '.join(sorted(fields))}")
    if missing := fields - set(spec):
        raise ConfigError(f"{where}: missing {', '.join(sorted(missing))}")
    if unknown := set(spec) - fields:
        raise ConfigError(f"{where}: unknown {', '.join(sorted(unknown))} (known: {', '.join(sorted(fields))})")
    cc = spec["compute_capability"]
    if not (isinstance(cc, list) and len(cc) == 2 and all(isinstance(c, int) and c >= 0 for c in cc) and cc[0] > 0):
        raise ConfigError(f"{where}.compute_capability must be [major, minor], got {cc!r}")
    for k in fields - {"device_kind", "compute_capability"}:
        if isinstance(spec[k], bool) or not (isinstance(spec[k], (int, float)) and spec[k] > 0):
            raise ConfigError(f"{where}.{k} must be a positive number, got {spec[k]!r}")
    if not isinstance(spec["device_kind"], str) or not spec["device_kind"]:
        raise ConfigError(f"{where}.device_kind must be the GPU's name, got {spec['device_kind']!r}")
    return CompileTarget(**{**spec, "compute_capability": tuple(cc)})


def select_hardware(path: str | Path | None, names: str) -> dict[str, Hardware]:
    """The machines `names` (comma-separated, or "all") of a hardware file (None: boost_jax/configs/hardware.yaml),
    in the order named; an unknown name raises ConfigError listing the file's machines."""
    machines = load_hardware(path or HARDWARE_FILE)
    if names == "all":
        return machines
    wanted = [n for n in names.split(",") if n]
    bad = [n for n in wanted if n not in machines]
    if bad or not wanted:
        raise ConfigError(f"--hardware: unknown machine(s) {bad or names!r}; {path or HARDWARE_FILE} has {list(machines)}")
    return {n: machines[n] for n in wanted}


def one_machine(path: str | Path | None, name: str) -> Hardware:
    """The one machine `name` of a hardware file (select_hardware's errors, and one for a list)."""
    machines = select_hardware(path, name)
    if len(machines) != 1:
        raise ConfigError(f"--hardware: name one machine, got {name!r}")
    return next(iter(machines.values()))


def machine_of(device_kind: str, path: str | Path = HARDWARE_FILE) -> Hardware | None:
    """The machine of a hardware file whose GPU reports `device_kind` (jax.Device.device_kind, its
    `compile_target.device_kind`), or None where none does."""
    return next((hw for hw in load_hardware(path).values()
                 if hw.compile_target and hw.compile_target.device_kind == device_kind), None)


_RING_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
                "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
                "collective-permute": lambda n: 1.0}


def link_bytes_per_s(group_size: int, crosses_nodes: bool, hw: Hardware) -> float:
    """Bandwidth per GPU, one direction, for a group of `group_size` GPUs. Inside a node a GPU reaches
    the rest of its group over its links to those g - 1 peers: through an NVSwitch that is the whole
    node link (peer_link = node_link), but a directly wired node has only g - 1 peer links to use.
    Perlmutter's 4 A100s are such a mesh (each pair joined by 4 of a GPU's 12 NVLink3 links), so a
    2-GPU group, like the paper's llama-3b at TP=2 or a permute's pair, moves a third of what a
    4-GPU group does."""
    if crosses_nodes:
        return hw.net_bytes_per_s
    return min(hw.node_link_bytes_per_s, (group_size - 1) * hw.peer_link_bytes_per_s)


def ring_bytes(kind: str, group_size: int, nbytes: float) -> float:
    """Bytes one device sends in a ring collective of `kind` over `group_size` devices whose payload is
    `nbytes` (the HLO convention: a reduce-scatter's input, an all-gather's output)."""
    return _RING_FACTOR[kind](group_size) * nbytes


def ring_seconds(kind: str, group_size: int, nbytes: float, crosses_nodes: bool, hw: Hardware) -> float:
    """One collective of `kind` over `group_size` devices moving `nbytes` per device."""
    link = link_bytes_per_s(group_size, crosses_nodes, hw)
    latency = hw.p2p_latency_s if kind == "collective-permute" else hw.collective_latency_s
    return latency + ring_bytes(kind, group_size, nbytes) / (link * hw.collective_efficiency)
