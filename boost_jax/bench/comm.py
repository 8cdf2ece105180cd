"""`bench comm [CONFIG.yaml] [section.key=value ...]`: collectives per decoder layer, forward and
backward, measured on the compiled HLO next to the scheme's analytic volume
(`boost_jax/analysis/comm.py`); under train.optimizer=muon/spectron, the optimizer update's
collectives next to the formula of the way each matrix is orthogonalised (docs/design.md section 14),
and both priced per step on train.muon.hardware. The programs are compiled on abstract inputs (nothing
allocated), so `model.preset=llama-7b parallel.tp=4 train.seq_len=4096 train.batch_size=4` runs on a laptop."""

from __future__ import annotations

import json

from boost_jax.analysis.comm import measure, optimizer_comm
from boost_jax.analysis.program import build
from boost_jax.bench.common import config_of, parse, parser
from boost_jax.config.hardware import one_machine
from boost_jax.runtime.units import GIB, MIB


def print_table(r: dict) -> None:
    print(f"{r['model']} {r['arch']} {r['scheme']} tp={r['tp']} dp={r['dp']} b={r['batch']} s={r['seq']} {r['dtype']} "
          f"norm={r['norm']} grouping={r['grouping']} kernels={r['kernels']}")
    print("  per decoder layer, per device (compiled HLO, after XLA combines independent collectives):")
    for phase in ("forward", "backward"):
        kinds = ", ".join(f"{k} x{v['count']} {v['bytes'] / GIB:.4f} GiB" for k, v in sorted(r["by_kind"][phase].items()))
        print(f"    {phase:8s} {r[f'layer_{phase}_collectives']:3d} collectives {r[f'layer_{phase}_bytes'] / GIB:8.4f} GiB  ({kinds})")
    print(f"    analytic forward          {r['analytic_layer_forward_bytes'] / GIB:8.4f} GiB  "
          f"(measured / analytic = {r['forward_over_analytic']:.4f})")
    print(f"    sent per device by a ring: forward {r['layer_forward_ring_bytes'] / GIB:.4f} GiB (analytic "
          f"{r['analytic_layer_forward_ring_bytes'] / GIB:.4f}), backward {r['layer_backward_ring_bytes'] / GIB:.4f} GiB")
    if (bwd := r["analytic_layer_backward_bytes"]) is not None:
        print(f"    analytic backward         {bwd / GIB:8.4f} GiB  ({len(r['analytic_layer_backward_all_reduces'])} "
              f"all-reduces; measured parts equal: {r['layer_backward_all_reduce_parts'] == r['analytic_layer_backward_all_reduces']})")
    if gathers := r["analytic_layer_backward_all_gathers"]:  # latent heads: k/v latents split over tp
        kinds = ", ".join(f"{k} {v / GIB:.4f} GiB" for k, v in r["analytic_layer_forward_by_kind"].items())
        print(f"    latent heads: analytic forward {kinds}; backward all-gathers {sum(gathers) / GIB:.4f} GiB "
              f"(measured reduce-scatter {sum(r['layer_forward_reduce_scatter_parts']) / GIB:.4f}, all-gather "
              f"{sum(r['layer_backward_all_gather_parts']) / GIB:.4f} GiB, with the online norm's statistic)")
    for op in r["layer_forward_ops"]:
        print(f"      fwd: {op}")
    if r["layer_forward_issued"]:
        issued_ops = ", ".join(f"{k} x{v}" for k, v in r["layer_forward_issued"].items())
        print(f"    forward as the program issues them (explicit shard_map collectives): {issued_ops}")
    if pipe := r.get("pipeline"):
        print(f"  pipeline: {pipe['stages']} stages x {pipe['repeats']} repeats, {pipe['microbatches']} micro-batches, "
              f"{pipe['iterations']} iterations, bubble {100 * pipe['bubble_fraction']:.1f}%")
        print(f"    stage-to-stage per iteration, per device: {pipe['p2p_bytes_per_iteration'] / MIB:.4f} MiB measured, "
              f"{pipe['analytic_p2p_bytes_per_iteration'] / MIB:.4f} MiB analytic")
        for op in pipe["p2p_ops_per_iteration"]:
            print(f"      {op}")
    if ctx := r.get("context"):
        print(f"  context parallel: cp={ctx['cp']}, attention by {ctx['attention']}; per layer over cp, per device:")
        for phase in ("forward", "backward"):
            print(f"    {phase:8s} {ctx[phase]['count']:3d} collectives {ctx[phase]['bytes'] / MIB:10.4f} MiB")
        print(f"    analytic forward          {ctx['analytic_forward_bytes'] / MIB:10.4f} MiB")
        for phase, short in (("forward", "fwd"), ("backward", "bwd")):
            for op in ctx[f"{phase}_ops"]:
                print(f"      {short}: {op}")
    if opt := r.get("optimizer"):
        print(f"  optimizer update ({r['optimizer_name']}), per step, per device: Newton-Schulz ways {opt['ways']}")
        print(f"    measured {opt['bytes'] / MIB:10.4f} MiB  {opt['measured']}")
        print(f"    formula  {opt['formula_bytes'] / MIB:10.4f} MiB  {opt['formula']}"
              f"  (equal: {opt['measured'] == opt['formula']})")
        print(f"    + {opt['norms_and_clip']} small all-reduces (the clip's norm, Frobenius norms of matrices left in place)")
        ways = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in opt["seconds_by_way"].items())
        print(f"    on {opt['hardware']}: the chosen ways {1e3 * opt['seconds']:.2f} ms per step (each way alone: {ways}); "
              f"the layers' collectives {1e3 * r['layers_collective_s']:.2f} ms per step")
    up = r["backend_upcast_extra_bytes"]["forward"]
    if up:
        print(f"  note: this backend upcast bf16 all-reduces to f32 (+{up / GIB:.4f} GiB per layer forward as compiled);"
              " counted at the program's bf16, as a GPU moves them")


def main(argv: list[str]) -> None:
    a = parse(parser("python -m boost_jax.bench comm", __doc__), argv)
    prog = build(config_of(a.config))
    hw = one_machine(None, prog.cfg.train.muon.hardware)
    r = {**measure(prog, hw), "optimizer_name": prog.cfg.train.optimizer, "optimizer": optimizer_comm(prog, hw)}
    print(json.dumps(r, indent=1)) if a.json else print_table(r)
