"""`bench paper [section.key=value ...]`: the paper's benchmark (docs/design.md section 7) at its
settings, from abstract compiles.

For llama-1b .. 30b at bf16, seq 4096, micro-batch 4 and the paper's (TP, PP), each variant
(dense/megatron and every low-rank arch under vanilla TP and BTP) is compiled here without
allocating anything. From the compiled train step we measure, per device: collectives per decoder
layer (forward and backward), GEMM and attention FLOPs (next to the analytic count and XLA's own
cost analysis), and memory: the CPU compile's peak beside the memory model's figure
(`analysis/memory_model.py`), which is what a GPU holds (the CPU backend keeps f32 copies of bf16
work). The performance model (`perf_model.py`, constants in
`boost_jax/configs/hardware.yaml`) turns them into seconds per iteration on A100, H100 and H200 nodes,
printed beside the paper's measurements.

Models the paper runs with pipeline stages (13B: PP=2, 30B: PP=4) are compiled as the real pipelined
train step on TP x PP simulated devices (`parallel/pipeline.py`): an iteration is PP micro-batches
of 4 sequences (the fewest its schedule allows; the paper does not state its number), and the
performance model prices what that program does, bubbles and stage-to-stage permutes included.

Each row's config is the paper's protocol (`row_config`) followed by the command line's overrides,
which apply to every row: `train.seq_len=2048`, `model.dtype=float32`, or `train.microbatches=8
train.batch_size=32` (the global batch of an iteration, as everywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from boost_jax.analysis.comm import forward, layer_split, pipeline_comm
from boost_jax.analysis.compiled import custom_calls
from boost_jax.analysis.hlo import collectives, summarize
from boost_jax.analysis.memory_model import breakdown, layer_bytes_on
from boost_jax.analysis.perf_model import Work, collective_seconds, predict
from boost_jax.analysis.program import build, peak_bytes
from boost_jax.analysis.work import analyze
from boost_jax.bench.common import parse, parser
from boost_jax.config import Config, ConfigError, load_config
from boost_jax.config.hardware import HARDWARE_FILE, Hardware, one_machine, select_hardware
from boost_jax.launch.gpu_target import gpu_devices, no_persistent_cache, target_config
from boost_jax.model.counts import count
from boost_jax.parallel.context import query_group
from boost_jax.runtime.units import GIB, MIB

# The paper's table: GPUs as (TP, PP), seconds per iteration of full-rank Megatron TP / vanilla
# low-rank TP / BOOST, all CoLA (docs/design.md section 7).
PAPER = {
    "llama-1b": {"tp": 1, "pp": 1, "dense/megatron": 0.85, "cola/vanilla": 0.56, "cola/btp": 0.59},
    "llama-3b": {"tp": 2, "pp": 1, "dense/megatron": 1.14, "cola/vanilla": 1.41, "cola/btp": 0.78},
    "llama-7b": {"tp": 4, "pp": 1, "dense/megatron": 1.06, "cola/vanilla": 1.64, "cola/btp": 0.72,
                 "svd/vanilla": 1.57, "svd/btp": 0.70, "lax/vanilla": 1.72, "lax/btp": 0.75},
    "llama-13b": {"tp": 4, "pp": 2, "dense/megatron": 2.07, "cola/vanilla": 2.42, "cola/btp": 1.30},
    "llama-30b": {"tp": 4, "pp": 4, "dense/megatron": 2.43, "cola/vanilla": 2.58, "cola/btp": 1.27},
}
# LLaMA-7B, b=4, s=4096, TP=4: measured per-layer forward communication time (docs/design.md section 3).
PAPER_LAYER_COMM_7B_S = {"dense/megatron": 2.01e-3, "cola/vanilla": 9.87e-3, "cola/btp": 1.85e-3}
PAPER_GEMM_UTILIZATION_7B = {"cola/vanilla": "~59%", "cola/btp": "70-75%"}
COLUMNS = ("dense/megatron", "cola/vanilla", "cola/btp")  # the paper's table: full rank, vanilla, BOOST
VARIANTS = ("dense/megatron", "cola/vanilla", "cola/btp", "svd/vanilla", "svd/btp", "lax/vanilla", "lax/btp")


MICROBATCH_ROWS = 4  # the paper's micro-batch: 4 sequences of 4096 tokens, in bf16


@dataclass(frozen=True)
class AuthorsRun:
    """How the authors' configs run a model (Arcana-2236/BOOST `examples/cola/config_cola_llama_*.yaml`,
    timed by `run_iter_compare.sh`): rows per micro-batch, micro-batches per iteration (accumulation),
    tied embeddings, and our nearest `model.norm` for BTP."""

    rows: int
    accumulation: int
    tied: bool
    norm: str  # 7B's default per-shard norm issues no statistic all-reduce: nearest is online


# Their 7B and 1B configs; models without one of theirs (3B, 13B, 30B) take 7B's, the model their
# timing script runs (docs/design.md, "Presets against the references").
AUTHORS = {"llama-1b": AuthorsRun(2, 16, True, "sync"), "llama-7b": AuthorsRun(1, 4, True, "online")}
# micro: ours (micro-batch 4 x 4096, M = PP, the time per micro-batch); authors: their configs, the
# time per iteration (every micro-batch and the optimizer step), as their script measures it.
PROTOCOLS = ("micro", "authors")


def row_config(model: str, variant: str, overrides: tuple[str, ...] = (), protocol: str = "micro") -> Config:
    """One row of the paper's table as a config at its (TP, PP), in bf16 at 4096 tokens, then
    `overrides`. micro: an iteration of PP micro-batches of MICROBATCH_ROWS sequences. authors: the
    authors' micro-batch, tying and norm; under a pipeline all their micro-batches in one program,
    without one a single micro-batch (`runs_per_iteration` prices the rest)."""
    arch, scheme = variant.split("/")
    tp, pp = PAPER[model]["tp"], PAPER[model]["pp"]
    if protocol == "micro":
        rows, micro, extra = MICROBATCH_ROWS, pp, []
    elif protocol == "authors":
        run = AUTHORS.get(model, AUTHORS["llama-7b"])
        rows, micro = run.rows, (run.accumulation if pp > 1 else 1)
        extra = [f"model.tie_embeddings={str(run.tied).lower()}", *([f"model.norm={run.norm}"] if scheme == "btp" else [])]
    else:
        raise ConfigError(f"--protocol: unknown {protocol!r}; choose from {list(PROTOCOLS)}")
    return load_config(None, [
        f"model.preset={model}", f"model.arch={arch}", f"parallel.scheme={scheme}", f"parallel.tp={tp}", "parallel.dp=1",
        f"parallel.pp={pp}", f"train.microbatches={micro}", f"train.batch_size={rows * micro}", "train.seq_len=4096",
        "model.dtype=bfloat16", *extra, *overrides])


def runs_per_iteration(model: str, protocol: str) -> int:
    """Runs of the compiled program per iteration of the protocol: the authors' accumulation steps
    where no pipeline holds them; 1 otherwise."""
    return AUTHORS.get(model, AUTHORS["llama-7b"]).accumulation if protocol == "authors" and PAPER[model]["pp"] == 1 else 1


def measure(cfg: Config, variant: str) -> tuple[dict, Work, list]:
    """Measured quantities of one variant's train step (per device: its pipeline stage, all its
    micro-batches), its Work, and the collectives of one decoder layer's forward."""
    m, model, tp, pp = cfg.model, cfg.model.preset, cfg.parallel.tp, cfg.parallel.pp
    microbatches, seq, dtype = cfg.train.microbatches, cfg.train.seq_len, m.dtype
    batch = cfg.train.batch_size // microbatches  # sequences per micro-batch
    if m.n_layers // pp < 2:
        # XLA unrolls a one-trip loop: per-layer figures need the scanned stack to stay a loop.
        raise ConfigError(f"{model}: n_layers={m.n_layers} must give pp={pp} stages of at least 2 layers")
    prog = build(cfg)
    step = jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).compile()
    text = step.as_text()
    both = collectives(text)
    fwd = forward(both)
    itemsize = jnp.dtype(m.dtype).itemsize
    gemms, traffic = analyze(text, seq=seq, itemsize=itemsize, query_block=m.attention_query_block,
                             group=query_group(prog.plan, m))
    params = prog.params_per_device
    tokens = batch * microbatches * seq  # per iteration
    work = Work(gemms, traffic, both, itemsize, params)
    c = count(m, seq)
    layer_fwd, layer_bwd = layer_split(both, pp > 1)
    flops = lambda attention: sum(g.flops * g.trip_count for g in gemms if g.attention == attention)
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "model": model, "variant": variant, "tp": tp, "pp": pp, "microbatches": microbatches,
        "layers_per_stage": m.n_layers // pp, "batch": batch, "seq": seq, "dtype": dtype,
        "layer_forward_bytes": layer_fwd["bytes"], "layer_forward_collectives": layer_fwd["count"],
        "layer_backward_bytes": layer_bwd["bytes"], "layer_backward_collectives": layer_bwd["count"],
        "step_collective_bytes": summarize(both)["bytes"],
        **({"pipeline": pipeline_comm(prog, fwd, batch * seq, itemsize)} if pp > 1 else {}),
        "gemm_flops_hlo": flops(False),
        # Training matmul FLOPs of one stage's weights (6 per parameter per token), split over TP:
        # the useful work; a pipeline's HLO also computes its bubbles.
        "gemm_flops_analytic": 6 * c.matmul_params * tokens / tp / pp,
        "attention_flops_hlo": flops(True),  # full S x S, as the compiled program computes it
        "attention_flops_analytic_causal": (c.train_flops_per_token - 6 * c.matmul_params) * tokens / tp / pp,
        "xla_cost_analysis_flops": float(cost.get("flops", 0.0)),  # counts a while body once
        "peak_bytes": peak_bytes(step), "adamw_bytes": 8 * params, "params_per_device": params,
        # What a GPU holds (bf16 activations at 2 bytes; the CPU compile keeps f32 copies of bf16 work).
        "memory_model_bytes": breakdown(cfg)["total"],
    }, work, [c for c in fwd if c.loop_depth and c.kind != "collective-permute"]


def gpu_topology(gpus: int, hw: Hardware) -> tuple[int, int]:
    """(nodes, GPUs of one node: 0 for whole nodes) holding `gpus` GPUs of `hw`."""
    if gpus < hw.gpus_per_node:
        return 1, gpus
    if gpus % hw.gpus_per_node:
        raise ConfigError(f"{gpus} GPUs are no whole number of {hw.name} nodes of {hw.gpus_per_node}")
    return gpus // hw.gpus_per_node, 0


def ideal(hw: Hardware) -> Hardware:
    """`hw` at its datasheet figures: every efficiency 1, no launch or collective latency (a roofline)."""
    return dataclasses.replace(hw, gemm_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
                               collective_efficiency=1.0, kernel_overhead_s=0.0, collective_latency_s=0.0,
                               p2p_latency_s=0.0)


def gpu_reading(cfg: Config, hw: Hardware) -> dict:
    """The row's program compiled by XLA:GPU for its GPUs of `hw` (launch/gpu_target.py, no GPU
    needed): its peak beside the memory model's (the layer measured by the same compiler), and the
    GEMMs, cuDNN attention, memory traffic and collectives of the program XLA:GPU built, priced by the
    performance model and as a roofline (`ideal`: datasheet peak, bandwidth and links)."""
    t0 = time.perf_counter()
    devices = gpu_devices(hw, *gpu_topology(cfg.parallel.tp * cfg.parallel.pp, hw))
    m = cfg.model
    with no_persistent_cache():
        prog = build(cfg, devices)
        step = jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).compile()
        model_step = breakdown(cfg, layer_bytes_on(devices), "gpu")["step"]
    text = step.as_text()
    itemsize = jnp.dtype(m.dtype).itemsize
    gemms, traffic = analyze(text, seq=cfg.train.seq_len, itemsize=itemsize, query_block=m.attention_query_block,
                             group=query_group(prog.plan, m))
    work = Work(gemms, traffic, [c for c in collectives(text) if not c.conditional], itemsize, prog.params_per_device)
    return {"hardware": hw.name, "attention": prog.plan.attention, "peak_bytes": peak_bytes(step),
            "memory_model_step_bytes": model_step, "predicted": predict(work, hw) | {
                "with_overlap_s": predict(work, hw, overlap=True)["seconds"]},
            "roofline": predict(work, ideal(hw)) | {"with_overlap_s": predict(work, ideal(hw), overlap=True)["seconds"]},
            # Beside the CPU program's `gemm_flops_hlo`: XLA:GPU rematerializes toward a memory limit of its own.
            "gemm_flops": sum(g.flops * g.trip_count for g in gemms if not g.attention),
            "custom_calls": custom_calls(text), "compile_s": time.perf_counter() - t0}


def paper_variants(model: str) -> list[str]:
    """The variants the paper measured for `model` (SVD and LaX only at 7B)."""
    return [v for v in VARIANTS if v in PAPER[model]]


def run(models: list[str], variants: tuple[str, ...] | None, hardware: dict, overrides: tuple[str, ...] = (),
        log=print, protocols: tuple[str, ...] = ("micro",), gpu_compile: Hardware | None = None) -> dict:
    """`variants=None`: each model's `paper_variants`; each row `row_config(model, variant, overrides,
    protocol)` for each protocol, priced with and without the performance model's overlap; with
    `gpu_compile`, each row also compiled by XLA:GPU for that GPU (`gpu_reading`)."""
    rows = []
    for protocol in protocols:
        for model in models:
            setting = PAPER[model]
            for variant in variants or paper_variants(model):
                t0 = time.perf_counter()
                row, work, layer_fwd = measure(row_config(model, variant, overrides, protocol), variant)
                row["protocol"], row["runs_per_iteration"] = protocol, runs_per_iteration(model, protocol)
                row["predicted"] = {name: predict(work, hw)
                                    | {"layer_forward_comm_s": sum(collective_seconds(c, hw) for c in layer_fwd),
                                       "with_overlap_s": predict(work, hw, overlap=True)["seconds"]}
                                    for name, hw in hardware.items()}
                row["paper_seconds"] = setting.get(variant)
                row["compile_s"] = time.perf_counter() - t0
                if gpu_compile is not None:
                    row["gpu_compile"] = gpu_reading(row_config(model, variant, overrides, protocol), gpu_compile)
                rows.append(row)
                log(f"  {protocol} {model} {variant}: compiled and analysed in {row['compile_s']:.0f} s")
    first = rows[0] if rows else {}
    return {"settings": {"batch": first.get("batch"), "seq": first.get("seq"), "dtype": first.get("dtype"),
                         "overrides": list(overrides), "protocols": list(protocols), "jax": jax.__version__,
                         "backend": jax.default_backend()},
            "hardware": {name: dataclasses.asdict(hw) for name, hw in hardware.items()}, "rows": rows}


def find_row(result: dict, model: str, variant: str, protocol: str = "micro") -> dict | None:
    return next((r for r in result["rows"] if r["model"] == model and r["variant"] == variant
                 and r["protocol"] == protocol), None)


def model_seconds(row: dict, hw: str, overlap: bool = False) -> float:
    """The model's reading of the paper's figure under the row's protocol on `hw`: micro, the time per
    micro-batch (an iteration over M); authors, the time per iteration (every micro-batch's forward
    and backward, then one optimizer step). `overlap`: priced with perf_model's overlap."""
    return protocol_seconds(row, row["predicted"][hw], overlap)


def protocol_seconds(row: dict, pred: dict, overlap: bool = False) -> float:
    """A prediction `pred` (perf_model.predict's, of the row's program) read under the row's protocol."""
    seconds, optimizer = (pred["with_overlap_s"] if overlap else pred["seconds"]), pred["parts"]["optimizer"]
    if row["protocol"] == "authors":
        return row["runs_per_iteration"] * (seconds - optimizer) + optimizer
    return seconds / row["microbatches"]


def measured_table(result: dict) -> list[str]:
    """Markdown: what was measured per variant (per device: its pipeline stage, all micro-batches)."""
    lines = ["| model | variant | protocol: TP,PP,M x rows | layer fwd GiB (ops) | layer bwd GiB (ops) | GEMM TFLOP HLO / analytic "
             "| attention TFLOP HLO / analytic causal | XLA cost_analysis TFLOP | CPU compile: peak GiB + AdamW GiB "
             "| memory model GiB (GPU, AdamW included) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['variant']} | {r['protocol']}: {_layout(r)} x {r['batch']} "
                     f"| {r['layer_forward_bytes'] / GIB:.4f} ({r['layer_forward_collectives']}) "
                     f"| {r['layer_backward_bytes'] / GIB:.4f} ({r['layer_backward_collectives']}) "
                     f"| {r['gemm_flops_hlo'] / 1e12:.2f} / {r['gemm_flops_analytic'] / 1e12:.2f} "
                     f"| {r['attention_flops_hlo'] / 1e12:.2f} / {r['attention_flops_analytic_causal'] / 1e12:.2f} "
                     f"| {r['xla_cost_analysis_flops'] / 1e12:.2f} | {r['peak_bytes'] / GIB:.1f} + {r['adamw_bytes'] / GIB:.1f} "
                     f"| {r['memory_model_bytes'] / GIB:.1f} |")
    return lines


def _layout(r: dict) -> str:
    return f"{r['tp']},{r['pp']},{r['microbatches'] * r['runs_per_iteration']}"


def _rows(result: dict, protocol: str) -> list[dict]:
    return [r for r in result["rows"] if r["protocol"] == protocol]


def prediction_table(result: dict, hw: str, protocol: str = "micro", overlap: bool = False) -> list[str]:
    """Markdown: the model's reading of the paper's figure on `hw` under `protocol` (`model_seconds`)
    beside the paper's, with BOOST's speedups."""
    lines = ["| model | TP,PP,M | full: model / paper | vanilla: model / paper | BOOST: model / paper "
             "| BOOST vs full: model / paper | BOOST vs vanilla: model / paper |",
             "|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in _rows(result, protocol)):
        trio = [find_row(result, model, v, protocol) for v in COLUMNS]
        if None in trio:
            continue
        p = [model_seconds(t, hw, overlap) for t in trio]
        q = [t["paper_seconds"] for t in trio]
        cells = [f"{a:.2f} / {b:.2f} ({a / b:.2f}x)" for a, b in zip(p, q)]
        lines.append(f"| {model} | {_layout(trio[0])} | " + " | ".join(cells)
                     + f" | {p[0] / p[2]:.2f}x / {q[0] / q[2]:.2f}x | {p[1] / p[2]:.2f}x / {q[1] / q[2]:.2f}x |")
    return lines


READINGS = tuple((protocol, overlap) for protocol in PROTOCOLS for overlap in (False, True))


def reading_name(protocol: str, overlap: bool) -> str:
    return protocol + (" + overlap" if overlap else "")


def best_reading(result: dict, model: str, variant: str, hw: str) -> tuple[str, float] | None:
    """The protocol and overlap setting whose model seconds lie closest to the paper's figure for one
    paper row (in ratio, either way), and that ratio; None without the paper's figure or any reading."""
    found = []
    for protocol, overlap in READINGS:
        r = find_row(result, model, variant, protocol)
        if r and r["paper_seconds"]:
            found.append((reading_name(protocol, overlap), model_seconds(r, hw, overlap) / r["paper_seconds"]))
    return min(found, key=lambda x: abs(math.log(x[1]))) if found else None


def fit_table(result: dict, hw: str) -> list[str]:
    """Markdown: per paper row, the model's seconds under each protocol, without and with overlap, as
    a ratio to the paper's figure, and the reading that fits it best."""
    present = [rd for rd in READINGS if _rows(result, rd[0])]
    lines = ["| model | variant | paper s | " + " | ".join(reading_name(*rd) for rd in present) + " | fits best |",
             "|---|---|---|" + "---|" * len(present) + "---|"]
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        for variant in dict.fromkeys(r["variant"] for r in result["rows"] if r["model"] == model):
            best = best_reading(result, model, variant, hw)
            if best is None:
                continue
            cells = []
            for protocol, overlap in present:
                r = find_row(result, model, variant, protocol)
                cells.append(f"{model_seconds(r, hw, overlap):.2f} ({model_seconds(r, hw, overlap) / r['paper_seconds']:.2f}x)"
                             if r else "-")
            lines.append(f"| {model} | {variant} | {PAPER[model][variant]:.2f} | " + " | ".join(cells)
                         + f" | {best[0]} ({best[1]:.2f}x) |")
    return lines


def pipeline_table(result: dict, hw: str) -> list[str]:
    """Markdown: each pipelined row's measured schedule and stage-to-stage traffic, and its predicted
    time on `hw` per iteration and per micro-batch, beside the paper's. The last column extends the
    compiled program to many micro-batches: one iteration of the loop plus one micro-batch's share of
    the edge (embedding, head, loss), the optimizer amortised away."""
    rows = [r for r in result["rows"] if r["pp"] > 1]
    if not rows:
        return []
    lines = ["| model | variant | protocol: TP,PP,M x rows | iterations | bubble | p2p MiB/iteration measured / analytic | p2p s "
             "| model s/iteration | model s/micro-batch | model s/micro-batch, M large | paper s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pipe, pred, m = r["pipeline"], r["predicted"][hw], r["microbatches"]
        paper_s = f"{r['paper_seconds']:.2f}" if r["paper_seconds"] else "-"
        lines.append(f"| {r['model']} | {r['variant']} | {r['protocol']}: {_layout(r)} x {r['batch']} | {pipe['iterations']} "
                     f"| {100 * pipe['bubble_fraction']:.0f}% "
                     f"| {pipe['p2p_bytes_per_iteration'] / MIB:.1f} / {pipe['analytic_p2p_bytes_per_iteration'] / MIB:.1f} "
                     f"| {pred['parts']['pipeline_p2p']:.3f} | {pred['seconds']:.2f} | {pred['seconds'] / m:.2f} "
                     f"| {pred['loop_s'] / pipe['iterations'] + pred['edge_s'] / m:.2f} | {paper_s} |")
    return lines


def breakdown_table(result: dict, hw: str) -> list[str]:
    """Markdown: llama-7b's predicted seconds by part on `hw` under our protocol (one compiled run;
    empty without those rows)."""
    seven = [r for r in _rows(result, "micro") if r["model"] == "llama-7b"]
    if not seven:
        return []
    parts = list(seven[0]["predicted"][hw]["parts"])
    lines = ["| variant | model | paper | " + " | ".join(parts) + " | hidden by overlap | GEMM utilization (paper) |",
             "|---|---|---|" + "---|" * len(parts) + "---|---|"]
    for r in seven:
        p = r["predicted"][hw]
        paper_s = f"{r['paper_seconds']:.2f}" if r["paper_seconds"] else "-"
        lines.append(f"| {r['variant']} | {p['seconds']:.3f} | {paper_s} | "
                     + " | ".join(f"{p['parts'][k]:.3f}" for k in parts)
                     + f" | {p['seconds'] - p['with_overlap_s']:.3f}"
                     + f" | {100 * p['gemm_utilization']:.0f}% ({PAPER_GEMM_UTILIZATION_7B.get(r['variant'], '-')}) |")
    return lines


def gpu_table(result: dict) -> list[str]:
    """Markdown: each row compiled by XLA:GPU (`gpu_reading`): its peak beside the memory model's, and
    its seconds as a roofline and by the performance model, beside the performance model over the CPU
    program and the paper, each read under the row's protocol."""
    rows = [r for r in result["rows"] if "gpu_compile" in r]
    if not rows:
        return []
    lines = ["| model | variant | protocol | XLA:GPU peak GiB | memory model GiB (ratio) | roofline s (GPU program) "
             "| model s (GPU program) | model s (CPU program) | paper s | model (GPU) / paper | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, hw = r["gpu_compile"], r["gpu_compile"]["hardware"]
        ours = protocol_seconds(r, g["predicted"])
        paper = f"{r['paper_seconds']:.2f} | {ours / r['paper_seconds']:.2f}x" if r["paper_seconds"] else "- | -"
        lines.append(f"| {r['model']} | {r['variant']} | {r['protocol']} | {g['peak_bytes'] / GIB:.1f} "
                     f"| {g['memory_model_step_bytes'] / GIB:.1f} ({g['memory_model_step_bytes'] / g['peak_bytes']:.2f}x) "
                     f"| {protocol_seconds(r, g['roofline']):.3f} | {ours:.3f} | {model_seconds(r, hw):.3f} | {paper} "
                     f"| {g['compile_s']:.0f} |")
    return lines


def layer_comm_table(result: dict, hw: str) -> list[str]:
    """Markdown: llama-7b's per-layer forward communication time on `hw` beside the paper's measurement."""
    rows = [r for r in _rows(result, "micro") if r["model"] == "llama-7b" and r["variant"] in PAPER_LAYER_COMM_7B_S]
    if not rows:
        return []
    return ["| variant | measured GiB (ops) | model ms | paper ms |", "|---|---|---|---|"] + [
        f"| {r['variant']} | {r['layer_forward_bytes'] / GIB:.4f} ({r['layer_forward_collectives']}) | "
        f"{1e3 * r['predicted'][hw]['layer_forward_comm_s']:.2f} | {1e3 * PAPER_LAYER_COMM_7B_S[r['variant']]:.2f} |"
        for r in rows]


PROTOCOL_TITLES = {
    "micro": "seconds per micro-batch of 4 x 4096 (an iteration of M = PP of them, over M)",
    "authors": "seconds per iteration at the authors' configs (their micro-batch x accumulation, tied embeddings; "
               "every micro-batch and the optimizer step)",
}


def print_report(result: dict) -> None:
    first = next(iter(result["hardware"]))
    print("\nMeasured here, per device, from the compiled train step (M micro-batches per iteration):",
          *measured_table(result), sep="\n")
    for hw in result["hardware"]:
        for protocol in result["settings"]["protocols"]:
            print(f"\nPredicted {PROTOCOL_TITLES[protocol]} on {hw} ({result['hardware'][hw]['description']}), "
                  "next to the paper (A100):", *prediction_table(result, hw, protocol), sep="\n")
    print(f"\nWhich reading fits the paper on {first} (model / paper):", *fit_table(result, first), sep="\n")
    if table := pipeline_table(result, first):
        print(f"\nThe pipelined rows on {first}, as compiled:", *table, sep="\n")
    if table := breakdown_table(result, first):
        print(f"\nllama-7b on {first}, where the time goes (seconds per iteration):", *table, sep="\n")
    if table := gpu_table(result):
        print(f"\nCompiled by XLA:GPU for {result['settings']['gpu_compile']} (no GPU): memory per GPU (the gradient "
              "program; AdamW apart) and seconds, under each row's protocol:", *table, sep="\n")
    if table := layer_comm_table(result, first):
        print(f"\nllama-7b per-layer forward communication on {first}: the model on the measured bytes / the paper's measurement:",
              *table, sep="\n")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(PAPER), help=f"comma-separated, from {', '.join(PAPER)}")
    p.add_argument("--variants", default="paper",
                   help=f"comma-separated arch/scheme pairs from {', '.join(VARIANTS)}, or paper: those the paper measured per model")
    p.add_argument("--hardware-file", default=str(HARDWARE_FILE))
    p.add_argument("--hardware", default="all", help="comma-separated names from the hardware file, or all")
    p.add_argument("--gpu-compile", default="", metavar="NAME",
                   help="also compile each row with XLA:GPU for this machine of the hardware file (deviceless: "
                        "pip install -e '.[gpu-compile]'), priced as a roofline and by the performance model")
    p.add_argument("--protocol", default=",".join(PROTOCOLS),
                   help="comma-separated: micro (micro-batch 4 x 4096, M = PP, the time per micro-batch) and/or "
                        "authors (the authors' configs, the time per iteration: docs/design.md)")


def from_flags(a: argparse.Namespace, log=print) -> dict:
    models = a.models.split(",")
    if bad := [m for m in models if m not in PAPER]:
        raise ConfigError(f"--models: unknown {bad}; the paper's are {list(PAPER)}")
    variants = None if a.variants == "paper" else tuple(a.variants.split(","))
    if bad := [v for v in variants or () if v not in VARIANTS]:
        raise ConfigError(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    protocols = tuple(a.protocol.split(","))
    if bad := [p for p in protocols if p not in PROTOCOLS]:
        raise ConfigError(f"--protocol: unknown {bad}; choose from {list(PROTOCOLS)}")
    hardware = select_hardware(a.hardware_file, a.hardware)
    overrides = tuple(a.config)
    for protocol in protocols:  # every row's config is valid before the first compile
        for model in models:
            for variant in variants or paper_variants(model):
                row_config(model, variant, overrides, protocol)
    gpu = one_machine(a.hardware_file, a.gpu_compile) if a.gpu_compile else None
    if gpu is not None:
        target_config(gpu)  # a machine without a compile target, or a missing extra, before any compile
    result = run(models, variants, hardware, overrides, log=log, protocols=protocols, gpu_compile=gpu)
    result["settings"]["gpu_compile"] = a.gpu_compile or None
    return result


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench paper", __doc__)
    add_flags(p)
    a = parse(p, argv)
    result = from_flags(a, log=lambda s: print(s, file=sys.stderr))
    result["settings"]["command"] = " ".join(["python -m boost_jax.bench paper", *argv])
    print(json.dumps(result, indent=1)) if a.json else print_report(result)
