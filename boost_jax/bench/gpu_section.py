"""The results page's section 8, compiled for GPUs without one: the paper's rows (`bench paper
--gpu-compile`), the planner's choices (`bench planner --gpu-compile`) and single programs
(`python -m boost_jax.compile --json`) as XLA:GPU compiles them."""

from __future__ import annotations

from boost_jax.bench import paper, planner
from boost_jax.bench.page import render
from boost_jax.runtime.units import MIB


def gpu_section(pr: dict, pl: dict | None, programs) -> list[str]:
    """Markdown: the paper's rows (`bench paper --gpu-compile`), the planner's choices (`bench planner
    --gpu-compile`) and single programs (`python -m boost_jax.compile --json`) compiled by XLA:GPU
    without a GPU: memory beside the memory model's, seconds beside the performance model and the paper."""
    compiled = [r for r in pr["rows"] if "gpu_compile" in r]
    off = [f"{r['model']} {r['variant']} ({paper.protocol_seconds(r, r['gpu_compile']['predicted']) / r['paper_seconds']:.2f}x)"
           for r in compiled if r["paper_seconds"]
           and abs(paper.protocol_seconds(r, r["gpu_compile"]["predicted"]) / r["paper_seconds"] - 1) > 0.15]
    recomputed = [f"{r['model']} {r['variant']} {r['gpu_compile']['gemm_flops'] / r['gemm_flops_hlo']:.2f}x"
                  for r in compiled if r["gpu_compile"]["gemm_flops"] > 1.01 * r["gemm_flops_hlo"]]
    lines = render("gpu", command=pr["settings"]["command"], hw=pr["settings"]["gpu_compile"], table=paper.gpu_table(pr))
    if off:
        lines += render("gpu_off_paper", rows="; ".join(off))
    if recomputed:
        lines += render("gpu_recomputed", rows="; ".join(recomputed))
    if pl:
        lines += gpu_planner_lines(pl)
    return lines + [line for r in programs for line in gpu_program_lines(r)]


def gpu_planner_lines(pl: dict) -> list[str]:
    """The planner's choices compiled by XLA:GPU, and those the memory model puts more than 10% off."""
    off = [f"{r['model']} {name.replace('_', ' ')} ({g['memory_model_bytes'] / g['peak_bytes']:.2f}x)"
           for r in pl["rows"] for name, g in r.get("gpu_compile", {}).items()
           if abs(g["memory_model_bytes"] / g["peak_bytes"] - 1) > 0.10]
    lines = render("gpu_planner", hw=pl["settings"]["gpu_compile"], command=pl["settings"]["command"],
                   table=planner.gpu_lines(pl))
    return lines + (render("gpu_planner_off", rows=", ".join(off)) if off else [])


def gpu_program_lines(r: dict) -> list[str]:
    """One `python -m boost_jax.compile --json`'s programs: compile time, memory, collectives, library calls."""
    rows = []
    for p in r["programs"]:
        layer = (f"{p['layer_collective_bytes'] / MIB:.3f} / {p['analytic_collective_bytes'] / MIB:.3f}"
                 if p["analytic_collective_bytes"] else "-")
        model = f"{p['model_memory'] / MIB:,.0f}" if p.get("model_memory") else "-"
        calls = ", ".join(f"{k} {n}" for k, n in p["custom_calls"].items() if "cudnn" in k or "gpu$" in k or "cublas" in k)
        rows.append(f"| {p['name']} | {p['compile_s']:.1f} | {p['memory']['peak'] / MIB:,.0f} | {p['memory']['temp'] / MIB:,.0f} "
                    f"| {model} | {p['collective_bytes'] / MIB:,.1f} | {layer} | {calls or '-'} |")
    return render("gpu_programs", command=r["command"], rows=rows)
