"""Predicted seconds per training iteration on named GPUs, from what the compiled program does.

Inputs are measured on this machine from one abstract compile of the train step (per device): its
GEMMs and memory-bound traffic (`analysis/work.py`) and its collectives (`analysis/hlo.py`).
Hardware constants come from `boost_jax/configs/hardware.yaml`. Nothing is fitted to the paper.

The model, per device, with no overlap of compute and tensor-parallel communication (Megatron,
vanilla TP and BOOST all block on their all-reduces) unless `overlap` is asked for (below):

  GEMM        max(FLOPs / (peak * gemm_efficiency * wave), bytes / (HBM * memory_efficiency)) + overhead
              wave = tiles / (ceil(tiles / SMs) * SMs): the last partial wave of output tiles idles SMs
  attention   the S x S matmuls as a causal flash-attention kernel: FLOPs / 2 / (peak * attention_efficiency)
  memory      non-GEMM traffic / (HBM * memory_efficiency)
  collective  latency + f(group) * bytes / (link * collective_efficiency), ring algorithms:
              all-reduce f = 2(g-1)/g; all-gather, reduce-scatter, all-to-all f = (g-1)/g; permute f = 1
              link: the network if a group spans nodes; inside one, what g GPUs reach each other over
              (`link_bytes_per_s`: through an NVSwitch the whole node link, in a direct mesh g - 1 peer links)
  optimizer   AdamW over this device's fp32 parameters: 28 bytes per parameter through HBM

With `overlap=True` (what Nanotron does: its async column-linear issues each backward input-gradient
all-reduce and computes the weight gradient meanwhile) the decoder layers' backward tensor-parallel
collectives are hidden behind their weight-gradient GEMMs, up to those GEMMs' time: taken as a third
of the layers' GEMM seconds (dW does the forward's FLOPs), summed over the step, so an upper bound on
what per-GEMM pairing would hide. The planner adds the data-parallel gradient reduction's overlap
with the backward pass (planner/price.py).

Pipeline parallelism (the paper's 13B and 30B runs) is not assumed: the program compiled is the
pipelined train step itself (`parallel/pipeline.py`), so its iteration loop (M * R + S - 1 trips,
bubbles included, as a GPU would run them) and its stage-to-stage collective-permutes are in the
measured work like any other loop and collective. A permute whose source/target pairs span nodes
crosses the inter-node network (all pairs shift at once, so the slowest link sets the time).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from boost_jax import configs
from boost_jax.analysis.hlo import Collective
from boost_jax.analysis.work import Gemm, Traffic
from boost_jax.config import ConfigError, load_yaml

HARDWARE_FILE = configs.HARDWARE
ADAMW_BYTES_PER_PARAM = 28  # read param, grad, m, v and write param, m, v, all fp32


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


def load_hardware(path: str | Path = HARDWARE_FILE) -> dict[str, Hardware]:
    """Every machine in a hardware YAML, validated: a missing or unknown key names the machine."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hardware file not found: {path}")
    raw = load_yaml(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of machine names to constants")
    fields = {f.name for f in dataclasses.fields(Hardware)} - {"name"}
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"{path}: {name}: expected a mapping of constants")
        if missing := fields - set(spec):
            raise ConfigError(f"{path}: {name}: missing {', '.join(sorted(missing))}")
        if unknown := set(spec) - fields:
            raise ConfigError(f"{path}: {name}: unknown {', '.join(sorted(unknown))} (known: {', '.join(sorted(fields))})")
        tile = spec["gemm_tile"]
        if not (isinstance(tile, list) and len(tile) == 2 and all(isinstance(t, int) and t > 0 for t in tile)):
            raise ConfigError(f"{path}: {name}.gemm_tile must be [rows, cols] of positive integers, got {tile!r}")
        values = {k: (tuple(v) if k == "gemm_tile" else v) for k, v in spec.items()}
        for k, v in values.items():
            if k not in ("description", "gemm_tile") and not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"{path}: {name}.{k} must be a positive number, got {v!r}")
        out[name] = Hardware(name=name, **values)
    return out


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


# ----------------------------------------------------------------------------- pieces


def gemm_seconds(g: Gemm, hw: Hardware, itemsize: int) -> float:
    tm, tn = hw.gemm_tile
    tiles = g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn)
    wave = tiles / (math.ceil(tiles / hw.sms) * hw.sms)
    compute = g.flops / (hw.peak_flops * hw.gemm_efficiency * wave)
    memory = g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) * itemsize / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    return max(compute, memory) + hw.kernel_overhead_s


def attention_seconds(g: Gemm, hw: Hardware) -> float:
    # Causal: a flash kernel skips the blocks above the diagonal (of a full S x S block, half).
    return g.flops * g.causal_share / (hw.peak_flops * hw.attention_efficiency)


_RING_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
                "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
                "collective-permute": lambda n: 1.0}


def _crosses_nodes(c: Collective, hw: Hardware) -> bool:
    """Whether a group of `c` (a permute: a source/target pair) has members on two nodes; "{}" (every
    device) by its size. A pipeline's groups over pp ({0,4}, ...) span nodes though only 2 wide."""
    groups = re.findall(r"\{([\d,]+)\}", c.replica_groups)
    if not groups:
        return c.group_size > hw.gpus_per_node
    return any(len({int(d) // hw.gpus_per_node for d in g.split(",")}) > 1 for g in groups)


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


def ring_seconds(kind: str, group_size: int, nbytes: float, crosses_nodes: bool, hw: Hardware) -> float:
    """One collective of `kind` over `group_size` devices moving `nbytes` per device."""
    link = link_bytes_per_s(group_size, crosses_nodes, hw)
    latency = hw.p2p_latency_s if kind == "collective-permute" else hw.collective_latency_s
    return latency + _RING_FACTOR[kind](group_size) * nbytes / (link * hw.collective_efficiency)


def collective_seconds(c: Collective, hw: Hardware) -> float:
    return ring_seconds(c.kind, c.group_size, c.bytes, _crosses_nodes(c, hw), hw)


# ----------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Work:
    """What one device does in one train step (all its micro-batches, its pipeline stage), as compiled."""

    gemms: list[Gemm]
    traffic: list[Traffic]
    collectives: list[Collective]
    itemsize: int  # bytes per element of the compute dtype
    params_per_device: int


def _split(items, cost) -> tuple[float, float]:
    """(inside the scanned decoder stack, outside it) seconds per program run."""
    inside = sum(cost(x) * x.trip_count for x in items if _in_loop(x))
    return inside, sum(cost(x) * x.trip_count for x in items if not _in_loop(x))


def _in_loop(x) -> bool:
    return x.loop_depth > 0 if isinstance(x, Collective) else x.in_loop


def predict(work: Work, hw: Hardware, overlap: bool = False) -> dict:
    """Seconds per iteration (one run of the compiled step, then the optimizer), its parts, and the
    seconds inside loops (decoder layers; under a pipeline, its iterations) and outside them (edge:
    embedding, head, loss). Stage-to-stage permutes are reported apart as `pipeline_p2p`. `overlap`:
    the layers' backward TP collectives hide behind their weight-gradient GEMMs (module docstring);
    what is hidden is reported as `overlap_hidden_s` and taken off the loop's seconds."""
    gemms = [g for g in work.gemms if not g.attention]
    p2p = [c for c in work.collectives if c.kind == "collective-permute"]
    parts = {
        "gemm": _split(gemms, lambda g: gemm_seconds(g, hw, work.itemsize)),
        "attention": _split([g for g in work.gemms if g.attention], lambda g: attention_seconds(g, hw)),
        "memory": _split(work.traffic, lambda t: t.bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency)),
        "communication": _split([c for c in work.collectives if c not in p2p], lambda c: collective_seconds(c, hw)),
        "pipeline_p2p": _split(p2p, lambda c: collective_seconds(c, hw)),
    }
    optimizer = work.params_per_device * ADAMW_BYTES_PER_PARAM / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    gemm_flops = sum(g.flops * g.trip_count for g in gemms)
    seconds = {k: sum(v) for k, v in parts.items()} | {"optimizer": optimizer}
    hidden = 0.0
    if overlap:
        backward_tp = _split([c for c in work.collectives if c.backward and c not in p2p], lambda c: collective_seconds(c, hw))[0]
        hidden = min(backward_tp, parts["gemm"][0] / 3)  # dW: a third of the layers' GEMM time
    return {
        "seconds": sum(seconds.values()) - hidden, "parts": seconds, "overlap_hidden_s": hidden,
        "loop_s": sum(v[0] for v in parts.values()) - hidden, "edge_s": sum(v[1] for v in parts.values()),
        "gemm_utilization": gemm_flops / (sum(parts["gemm"]) * hw.peak_flops) if gemm_flops else 0.0,
    }
