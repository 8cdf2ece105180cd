"""Predicted seconds per training iteration on named GPUs, from what the compiled program does.

Inputs are measured on this machine from one abstract compile of the train step (per device): its
GEMMs and memory-bound traffic (`analysis/work.py`) and its collectives (`analysis/hlo.py`).
Hardware constants come from `boost_jax/configs/hardware.yaml` (config/hardware.py). Nothing is fitted to the paper.

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

import math
import re
from dataclasses import dataclass

from boost_jax.analysis.hlo import Collective
from boost_jax.analysis.work import Gemm, Traffic
from boost_jax.config.hardware import Hardware, ring_seconds

ADAMW_BYTES_PER_PARAM = 28  # read param, grad, m, v and write param, m, v, all fp32


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


def _crosses_nodes(c: Collective, hw: Hardware) -> bool:
    """Whether a group of `c` (a permute: a source/target pair) has members on two nodes; "{}" (every
    device) by its size. A pipeline's groups over pp ({0,4}, ...) span nodes though only 2 wide."""
    groups = re.findall(r"\{([\d,]+)\}", c.replica_groups)
    if not groups:
        return c.group_size > hw.gpus_per_node
    return any(len({int(d) // hw.gpus_per_node for d in g.split(",")}) > 1 for g in groups)


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
