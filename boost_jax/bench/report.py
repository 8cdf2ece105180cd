"""`bench report`: regenerate docs/results.md and its plots in one run.

It runs `bench paper` (abstract compiles of the paper's settings + the performance model), a
`bench step --compare` on a 4-way TP simulated mesh (dense/megatron, cola/vanilla, cola/btp
interleaved over several repetitions), and the single-device training throughput against the
matmul peak measured in the same run; then writes the page and the PNGs. Every number on the page
comes from this run (or from `--paper-json`, a saved `bench paper --json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from boost_jax.bench import paper, planner, study_section
from boost_jax.bench.common import config_of, parse, parser
from boost_jax.bench.profile import profile
from boost_jax.bench.step import Runner, compare_configs, measure_with_peak, time_runners
from boost_jax.config import ConfigError
from boost_jax.launch.peaks import PEAK_BF16_FLOPS
from boost_jax.model.counts import count
from boost_jax.runtime.units import GIB, MIB

A100_PEAK = PEAK_BF16_FLOPS["A100"]
TRIO = paper.COLUMNS
LABELS = {"dense/megatron": "full rank (Megatron TP)", "cola/vanilla": "vanilla low-rank TP", "cola/btp": "BOOST (BTP)"}


# ----------------------------------------------------------------------------- measurements


def step_compare(runners: list[Runner], reps: int, steps: int) -> dict:
    cfg = runners[0].cfg
    return {"model": cfg.model.preset, "tp": cfg.parallel.tp, "batch": cfg.train.batch_size, "seq": cfg.train.seq_len,
            "reps": reps, "steps": steps, "rows": dict(zip(TRIO, time_runners(runners, reps, steps)))}


def single_device(runners: list[Runner], reps: int, steps: int) -> dict:
    """Training throughput on one device next to the best fp32 matmul FLOP/s, measured before and after."""
    rows, peak = measure_with_peak(runners, reps, steps)
    for r in rows:
        r["fraction_of_matmul_peak"] = r.pop("fraction_of_peak")  # the name results.json has always used
    cfg = runners[0].cfg
    return {"matmul_peak_flops": peak, "batch": cfg.train.batch_size, "seq": cfg.train.seq_len, "rows": rows}


PROFILED = (("cola", "btp", 1), ("dense", "megatron", 1), ("cola", "btp", 4), ("dense", "megatron", 4))


def step_args(model: str, arch: str, tp: int, batch: int, seq: int, scheme: str = "auto") -> list[str]:
    """The config of a timed step section (fp32, one data-parallel replica), as command-line overrides."""
    return [f"model.preset={model}", f"model.arch={arch}", *([f"parallel.scheme={scheme}"] if scheme != "auto" else []),
            f"parallel.tp={tp}", "parallel.dp=1", f"train.batch_size={batch}", f"train.seq_len={seq}", "model.dtype=float32"]


def profiles(runners: list[Runner], model: str, steps: int, trace_root: Path) -> dict[str, dict]:
    """{"arch/scheme/tpN": `bench profile`} of `model`'s PROFILED variants at the runners' tp and
    batch (traces under `trace_root`): of the runners just timed where they hold one, so that no
    variant is compiled twice, else compiled here."""
    cfg = runners[0].cfg
    tp, batch, seq = cfg.parallel.tp, cfg.train.batch_size, cfg.train.seq_len
    timed = {(r.cfg.model.arch, r.cfg.parallel.scheme): r for r in runners if r.cfg.model.preset == model}
    done = {}
    for arch, scheme, t in PROFILED:
        if t == tp:
            runner = timed.get((arch, scheme)) or Runner(config_of(step_args(model, arch, t, batch, seq, scheme)))
            done[f"{arch}/{scheme}/tp{t}"] = profile(runner.cfg, steps, trace_root / f"{arch}-tp{t}", top=5, runner=runner)
    return done


def machine() -> dict:
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import flax
    import jaxlib
    import optax

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "backend": jax.default_backend(), "devices": jax.device_count(), "commit": commit,
            "date": datetime.date.today().isoformat()}


# ----------------------------------------------------------------------------- plots


def plot(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pr = result["paper"]
    hw_names = list(pr["hardware"])
    models = list(dict.fromkeys(r["model"] for r in pr["rows"]))
    protocol = pr["settings"]["protocols"][0]  # the plots show the first protocol's reading
    row = lambda m, v: paper.find_row(pr, m, v, protocol)
    files = []

    # 1. seconds per iteration: the model on each GPU beside the paper (A100).
    fig, axes = plt.subplots(1, len(TRIO), figsize=(5 * len(TRIO), 4), sharey=True)
    x = np.arange(len(models))
    for ax, v in zip(np.atleast_1d(axes), TRIO):
        rows = [row(m, v) for m in models]
        ax.plot(x, [r["paper_seconds"] for r in rows], "ko", ms=8, label="paper (A100, measured)")
        for i, hw in enumerate(hw_names):
            ax.bar(x + (i - (len(hw_names) - 1) / 2) * 0.25, [paper.model_seconds(r, hw) for r in rows], 0.25,
                   label=f"model: {hw}")
        ax.set_title(LABELS[v])
        ax.set_xticks(x, [f"{m.removeprefix('llama-')}\n({row(m, v)['tp']},{row(m, v)['pp']})" for m in models])
        ax.set_xlabel("model (TP, PP)")
    np.atleast_1d(axes)[0].set_ylabel(f"seconds ({protocol} protocol)")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, out / "paper_vs_model.png"))

    # 2. communication per decoder layer (fwd + bwd), measured on the compiled HLO.
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, v in enumerate(TRIO):
        rows = [row(m, v) for m in models]
        ax.bar(x + (i - 1) * 0.27, [(r["layer_forward_bytes"] + r["layer_backward_bytes"]) / GIB for r in rows], 0.27, label=LABELS[v])
    ax.set_xticks(x, [f"{m.removeprefix('llama-')}\nTP={row(m, TRIO[0])['tp']}" for m in models])
    ax.set_ylabel("GiB per layer per device (fwd + bwd)")
    ax.set_title(f"Collectives per decoder layer, compiled HLO ({protocol} protocol)")
    ax.legend()
    fig.tight_layout()
    files.append(_save(fig, out / "layer_comm.png"))

    # 3. where llama-7b's time goes on the first GPU of the hardware file (the paper's A100).
    seven = [r for r in pr["rows"] if r["model"] == "llama-7b" and r["protocol"] == protocol]
    if seven:
        hw = hw_names[0]
        parts = list(seven[0]["predicted"][hw]["parts"])
        fig, ax = plt.subplots(figsize=(9.5, 4))
        bottom = np.zeros(len(seven))
        for part in parts:
            vals = np.array([r["predicted"][hw]["parts"][part] for r in seven])
            ax.bar(range(len(seven)), vals, bottom=bottom, label=part)
            bottom += vals
        ax.plot(range(len(seven)), [r["paper_seconds"] or np.nan for r in seven], "ko", ms=8, label="paper")
        ax.set_xticks(range(len(seven)), [r["variant"] for r in seven], rotation=20)
        ax.set_ylabel("seconds per iteration")
        ax.set_title(f"llama-7b, TP=4, {hw}: predicted time by part")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout()
        files.append(_save(fig, out / "breakdown_7b.png"))

    # 4. measured on this machine.
    sc, sd = result["step_compare"], result["single_device"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    med = [1e3 * sc["rows"][v]["median_step_s"] for v in TRIO]
    a1.bar([LABELS[v] for v in TRIO], med, color=["C0", "C1", "C2"])
    for v, i in zip(TRIO, range(3)):
        a1.plot([i] * len(sc["rows"][v]["step_times_s"]), [1e3 * t for t in sc["rows"][v]["step_times_s"]], "k.")
    a1.set_ylabel("ms per train step (median, dots: repetitions)")
    a1.set_title(f"{sc['model']} fp32, TP={sc['tp']} simulated on CPU")
    a1.tick_params(axis="x", labelrotation=15)
    names = [f"{r['model']}\n{r['arch']}" for r in sd["rows"]]
    a2.bar(names, [100 * r["fraction_of_matmul_peak"] for r in sd["rows"]])
    a2.set_ylabel("% of measured fp32 matmul peak")
    a2.set_title("one device: model FLOP/s / matmul peak")
    fig.tight_layout()
    files.append(_save(fig, out / "cpu_measured.png"))

    # 5. decoding on this machine: tokens/s per batch size beside the memory-bound ceiling.
    if "decode" in result:
        runs = result["decode"]["runs"]
        fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True)
        for ax, run in zip(np.atleast_1d(axes), runs):
            for cache in dict.fromkeys(r["cache"] for r in run["rows"]):
                rows = [r for r in run["rows"] if r["cache"] == cache]
                batches = [r["batch"] for r in rows]
                line, = ax.plot(batches, [r["decode_tokens_per_s"] for r in rows], "o-", label=f"{cache} cache")
                ax.plot(batches, [r["batch"] / r["floor_s"] for r in rows], "--", color=line.get_color(),
                        label=f"{cache}: memory-bound ceiling")
            if hf := run.get("hf"):
                ax.plot([r["batch"] for r in hf["rows"]], [r["end_to_end_tokens_per_s"] for r in hf["rows"]], "ks",
                        label="Hugging Face generate (end to end)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch (rows decoded together)")
            ax.set_title(f"{run['model']} {run['arch']} {run['dtype']}")
        np.atleast_1d(axes)[0].set_ylabel("new tokens per second")
        np.atleast_1d(axes)[0].legend(fontsize=8)
        fig.tight_layout()
        files.append(_save(fig, out / "decode.png"))

    # 6. the quality runs: validation loss against tokens and against training FLOPs.
    if "quality" in result:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for run in result["quality"]["runs"]:
            style = "-" if run["budget"] == "tokens" else "--"
            label = f"{run['arch']}" + (" (dense's FLOPs)" if run["budget"] == "flops" else "")
            line, = a1.plot([c["tokens"] for c in run["curve"]], [c["eval_loss"] for c in run["curve"]], style, label=label)
            a2.plot([c["flops"] for c in run["curve"]], [c["eval_loss"] for c in run["curve"]], style, color=line.get_color())
        a1.set_xlabel("training tokens")
        a2.set_xlabel("training FLOPs")
        a1.set_ylabel("validation loss")
        a1.legend(fontsize=8)
        a1.set_title(f"{result['quality']['model']}: loss against tokens")
        a2.set_title("and against compute")
        fig.tight_layout()
        files.append(_save(fig, out / "quality.png"))
    if "study" in result:
        files.append(_save(study_section.plot(result["study"]), out / study_section.IMAGE))
    return files


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


# ----------------------------------------------------------------------------- page


def page(result: dict, images: list[str], img_dir: str) -> str:
    pr, mc = result["paper"], result["machine"]
    hw_names = list(pr["hardware"])
    s = pr["settings"]
    L = [
        "# Results",
        "",
        f"Generated by `python -m boost_jax.bench report` on {mc['date']} (commit `{mc['commit']}`). "
        "Every number below comes from that one run; nothing is typed in by hand except the paper's own figures (docs/design.md section 7), "
        "which are marked as such.",
        "",
        # Sections measured again later by their own bench command and saved into results.json (say which, when, why).
        *(f"- {note}" for note in result.get("notes", ())),
        *([""] if result.get("notes") else []),
        "## Machine and versions",
        "",
        f"- CPU: {mc['cpu']}, {mc['cores']} cores, "
        + (f"{mc['memory_bytes'] / GIB:.0f} GiB memory" if mc["memory_bytes"] else "memory unknown")
        + f"; JAX backend `{mc['backend']}` with {mc['devices']} (simulated) devices. No GPU was used.",
        f"- Python {mc['python']}, jax {mc['jax']}, jaxlib {mc['jaxlib']}, flax {mc['flax']}, optax {mc['optax']}.",
        "",
        "Commands (the report runs the equivalent of each):",
        "",
        "```",
        *result["commands"],
        "```",
        "",
        "## 1. The paper's benchmark, compiled here",
        "",
        f"Settings: {s['dtype']}, sequence {s['seq']}, micro-batch {s['batch']}, the paper's (TP, PP) per model; "
        "every variant is an abstract compile of the full train step (forward + backward) on TP x PP simulated devices, "
        "per device, with M micro-batches per iteration (M = PP unless `--microbatches` says otherwise): the 13B and 30B "
        "rows are the real pipelined program (`parallel/pipeline.py`), bubbles and stage-to-stage permutes included. "
        "Nothing is allocated.",
        "",
        *paper.measured_table(pr),
    ]
    L += [
        "",
        "How to read it:",
        "",
        "- **Communication** is every collective inside the scanned decoder layer of the compiled HLO (`analysis/hlo.py`), "
        "bf16 payload per device; backward = gradient program minus forward. The op count is after XLA combines independent "
        "all-reduces (vanilla issues 7 per layer forward, XLA merges them into 4 with the same bytes).",
        "- **GEMM FLOPs** are the compiled `dot`s with their loop trip counts (`analysis/work.py`), next to "
        "6 x matmul parameters x tokens / TP (`model/counts.py`). **Attention** FLOPs in the HLO are the full S x S score and value "
        "matmuls including the backward's recompute of the scores (7 matmuls, as FlashAttention-2 does), against the analytic "
        "causal count (3 x 2 matmuls x half the square). Vanilla TP runs attention replicated on every rank: its HLO attention "
        "FLOPs are TP times those of the other schemes.",
        "- **XLA's `cost_analysis()`** counts a while-loop body once, so on a scanned stack it reports one layer plus the edge; "
        "it is shown raw for transparency and not used.",
        "- **Memory**, two figures. The CPU compile's: `compiled.memory_analysis()` of the train step (arguments + outputs + "
        "temporaries) plus the AdamW moments; the CPU backend keeps fp32 copies of bf16 elementwise work a GPU does not, so "
        "it overstates a GPU's peak. The memory model's (`analysis/memory_model.py`, validated within 10% of fp32 CPU "
        "compiles): weights, gradients and AdamW moments by their sharding, each layer's saved activations at 2 bytes, "
        "pipeline buffers, the loss and the largest transient; this is the figure to hold against an 80 GB GPU. The paper's "
        "numbers need no activation checkpointing to be compared, so `train.remat=none` here; `bench memory` compares remat "
        "modes and section 3 lets the planner choose.",
        "",
        "## 2. Performance model beside the paper",
        "",
        "`boost_jax/analysis/perf_model.py` turns the measured GEMM shapes, memory traffic and collectives into seconds on a GPU: "
        "roofline GEMMs with wave quantization, causal flash attention at a stated efficiency, memory-bound traffic at HBM speed, "
        "ring collectives at NCCL bus bandwidth plus a per-op latency over the links their group has (inside a node "
        "without an NVSwitch, as Perlmutter's A100s are wired, a group of g GPUs has only its g - 1 peer links: a TP=2 "
        "pair a third of a TP=4 group's bandwidth; a group with members on two nodes, the network), "
        "no compute/communication overlap unless stated (the "
        "overlap reading hides each layer's backward TP all-reduces behind its weight-gradient GEMMs, as Nanotron does), "
        "AdamW as HBM traffic, "
        "and pipelines priced as compiled (their M + PP - 1 iterations, bubbles computed like any other, and the "
        "collective-permutes between stages over NVLink or, where a pair spans nodes, the network). Constants are datasheet values and stated "
        "efficiencies in `boost_jax/configs/hardware.yaml`; **none was fitted to the paper**:",
        "",
        "| constant | " + " | ".join(hw_names) + " |",
        "|---|" + "---|" * len(hw_names),
        *(f"| {k} | " + " | ".join(_fmt(pr["hardware"][h][k]) for h in hw_names) + " |"
          for k in pr["hardware"][hw_names[0]] if k not in ("name", "description", "compile_target")),
        "",
    ]
    protocols = pr["settings"]["protocols"]
    theirs = ", ".join(f"{m.removeprefix('llama-').upper()} {a.rows} x {a.accumulation}" for m, a in paper.AUTHORS.items())
    L += ["Two readings of the paper's seconds per iteration, each a protocol of `bench paper --protocol`: **micro**, ours "
          "(micro-batch 4 x 4096, M = PP micro-batches per iteration, compared per micro-batch: the iteration over M), and "
          "**authors**, the authors' own (Arcana-2236/BOOST's configs, timed by their `run_iter_compare.sh`: micro-batch "
          f"x accumulation {theirs} "
          "(3B, 13B and 30B, without a config of theirs, as 7B), tied embeddings, BTP's norm as their config's, and the whole "
          "iteration: every micro-batch's forward and backward, then one optimizer step); docs/design.md's preset table sets "
          "them beside ours. Each is priced without and with overlap.", ""]
    for hw in hw_names:
        L += [f"### {hw}: {pr['hardware'][hw]['description']}", ""]
        for protocol in protocols:
            L += [f"{paper.PROTOCOL_TITLES[protocol].capitalize()}:", "", *paper.prediction_table(pr, hw, protocol), ""]
        L += ["The paper measured A100s only: on H100/H200 the paper column is the same A100 figure, for scale.", ""]
    L += [f"### Which reading fits the paper ({hw_names[0]}, model / paper)", "",
          "Each paper row under each protocol, without and with overlap; the last column names the reading closest to "
          "the paper's figure (in ratio, either way).", "", *paper.fit_table(pr, hw_names[0]), ""]
    if pipe := paper.pipeline_table(pr, hw_names[0]):
        L += [f"### The pipelined rows as compiled ({hw_names[0]})", "",
              "Iterations M + PP - 1 and the bubble (PP - 1) / (M + PP - 1) are the compiled schedule's; p2p is the "
              "collective-permute payload per device per iteration read from the HLO, next to the carry's analytic size "
              "(one micro-batch's residual [b, s, d] split as the plan lays it out: over TP under BTP), and its predicted "
              "seconds per iteration in all.", "", *pipe, ""]
    if breakdown := paper.breakdown_table(pr, hw_names[0]):
        L += [f"### Where llama-7b's time goes ({hw_names[0]}, seconds per iteration)", "", *breakdown, "",
              f"Per-layer forward communication time of llama-7b, TP=4 ({hw_names[0]}): the model applied to the measured "
              "bytes, against the paper's measured all-reduce time (docs/design.md section 3):", "",
              *paper.layer_comm_table(pr, hw_names[0]), ""]
    L += ["### Where the model and the paper differ", "", *differences(pr), ""]
    if "planner" in result:
        L += planner_section(result["planner"])
    sc, sd = result["step_compare"], result["single_device"]
    med = {v: sc["rows"][v]["median_step_s"] for v in TRIO}
    L += [
        "## 4. Measured on this machine",
        "",
        f"`bench step --compare`: {sc['model']}, fp32, batch {sc['batch']} x {sc['seq']}, TP={sc['tp']} on simulated CPU "
        f"devices, the three variants interleaved in {sc['reps']} repetitions of {sc['steps']} steps (machine noise hits all alike). "
        "Each timed section (this one and its profiles, the single-device one and its profiles, decoding) ran in a fresh "
        "process, as its own `bench` command does: JAX with only the devices its configs simulate, and their host memory "
        "setting (`parallel.cpu_reuse_memory`).",
        "",
        "| variant | median ms/step | repetitions (ms) | tokens/s | model TFLOP/s (all devices) | peak MiB/device |",
        "|---|---|---|---|---|---|",
    ]
    for v in TRIO:
        r = sc["rows"][v]
        L.append(f"| {v} | {1e3 * r['median_step_s']:.0f} | {', '.join(f'{1e3 * t:.0f}' for t in r['step_times_s'])} | "
                 f"{r['tokens_per_s']:,.0f} | {r['model_flops_per_s'] / 1e12:.3f} | {r['peak_bytes_per_device'] / MIB:.0f} |")
    L += [
        "",
        f"BOOST is **{med['cola/vanilla'] / med['cola/btp']:.2f}x** faster than vanilla low-rank TP and "
        f"**{med['dense/megatron'] / med['cola/btp']:.2f}x** faster than full-rank Megatron TP here; vanilla is "
        f"{med['dense/megatron'] / med['cola/vanilla']:.2f}x of full rank. All simulated devices share the same cores, so "
        "a collective is a memory copy: these ratios measure the work each scheme does per device (replicated attention and "
        "elementwise work, skinny GEMMs), not interconnect time, and they are not GPU figures. Compute dominates dispatch "
        f"overhead at this size: the full-rank run sustains {sc['rows']['dense/megatron']['model_flops_per_s'] / sd['matmul_peak_flops']:.0%} "
        "of the host's measured matmul peak (below) in model FLOPs.",
        "",
        f"Single device (fp32, batch {sd['batch']} x {sd['seq']}): training throughput as a fraction of the best fp32 "
        f"matmul rate measured in the same run ({sd['matmul_peak_flops'] / 1e9:.1f} GFLOP/s, a 2048^3 jitted matmul, "
        "best of 10, before and after the runs).",
        "",
        "| model | arch | median ms/step | tokens/s | model GFLOP/s | of matmul peak |",
        "|---|---|---|---|---|---|",
    ]
    for r in sd["rows"]:
        L.append(f"| {r['model']} | {r['arch']} | {1e3 * r['median_step_s']:.0f} | {r['tokens_per_s']:,.0f} | "
                 f"{r['model_flops_per_s'] / 1e9:.1f} | {100 * r['fraction_of_matmul_peak']:.0f}% |")
    L += ["", "Model FLOPs are the analytic training count (`model/counts.py`: 6 per matmul parameter per token plus causal "
          "attention), so recomputation and elementwise work are not credited.", ""]
    if "profile" in result:
        L += profile_section(result["profile"])
    if "decode" in result:
        L += decode_section(result["decode"])
    if "quality" in result:
        L += quality_section(result["quality"])
    if "optimizers" in result:
        L += optimizers_section(result["optimizers"])
    if "study" in result:
        L += study_section.section(result["study"])
    if "startup" in result:
        L += startup_section(result["startup"])
    if "gpu_paper" in result:
        L += gpu_section(result["gpu_paper"], result.get("gpu_planner"), result.get("gpu_programs", ()))
    L += ["## Plots", ""]
    L += [f"![{name}]({img_dir}/{name})" for name in images]
    return "\n".join(L) + "\n"


def quality_section(q: dict) -> list[str]:
    """Markdown: `bench quality`: dense against the low-rank archs at equal tokens and equal FLOPs,
    beside CoLA's claim, and the compressed dense model's recovery."""
    from boost_jax.bench import quality

    r = quality.ratios(q)
    runs = {(x["arch"], x["budget"]): x for x in q["runs"]}
    dense = runs[("dense", "tokens")]
    L = ["## 6. Low-rank quality, measured", "",
         f"`{q['command']}`: {q['model']} (d = {q['d_model']}, {q['n_layers']} layers, rank d/4 = {q['rank']}) "
         f"trained from scratch on the `{q['corpus']}` corpus, sequence {q['seq_len']} x batch {q['batch_size']}, "
         f"the same schedule for every run (AdamW, warmup 10%, cosine); each evaluated on {q['eval_tokens']:,} "
         "validation tokens (`python -m boost_jax.eval`). Equal tokens: every arch sees the same "
         f"{q['tokens']:,} tokens; equal FLOPs: svd and cola train longer, to dense's training FLOPs. The minutes are "
         "each run's wall time, with other work sharing the machine: not a speed comparison (section 4 is).", "",
         *quality.table(q), ""]
    lines = []
    for name, label in (("cola/tokens", "cola at equal tokens"), ("cola/flops", "cola at dense's FLOPs"),
                        ("svd/tokens", "svd at equal tokens"), ("svd/flops", "svd at dense's FLOPs"),
                        ("lax/tokens", "lax at equal tokens")):
        if name in r:
            lines.append(f"{label}: perplexity {r[name]:.3f}x dense's ({_verdict(r[name])})")
    L += ["Perplexity over dense's: " + "; ".join(lines) + ".", "",
          "CoLA's claim (arXiv 2502.10940, LLaMA 60M to 7B on C4, sequence 256, batch 512, T5 tokenizer): "
          "full-rank-level perplexity at about 2x less compute. What differs here: models of "
          f"{dense['params'] / 1e6:.1f}M (dense) and {runs[('cola', 'tokens')]['params'] / 1e6:.1f}M (cola) parameters, "
          "far below CoLA's smallest; Python source code instead of web text; a BPE tokenizer of the model's "
          f"vocabulary trained on the corpus; {q['tokens'] / 1e6:.1f}M training tokens instead of billions "
          f"({q['tokens'] / dense['params']:.2f} tokens per dense parameter, where CoLA trains to about 20: every run "
          f"here is early in training, where how fast a model starts to learn weighs more than its capacity); batch "
          f"{q['batch_size']}. The figures say how the claim fares at this scale, nothing more.", ""]
    L += ["The dense model factored into the svd arch at rank d/4 (`python -m boost_jax.convert import --to svd`; "
          "svd: truncated SVD of each weight; whiten: SVD-LLM's, on 64 calibration sequences), evaluated as "
          "factored and after continued training:", "",
          "| method | rank | dense ppl | factored ppl | after continued training | steps (tokens) |",
          "|---|---|---|---|---|---|"]
    for c in q["recovery"]:
        L.append(f"| {c['method']} | {c['rank']} | {dense['final']['perplexity']:.2f} | {c['compressed']['perplexity']:.2f} "
                 f"| {c['recovered']['perplexity']:.2f} | {c['steps']} ({c['tokens']:,}) |")
    return L + [""]


def _verdict(ratio: float) -> str:
    """A perplexity ratio against dense's in words: within 2% is a match."""
    if ratio < 0.98:
        return f"beats dense by {100 * (1 - ratio):.1f}%"
    return "matches dense" if ratio <= 1.02 else f"lags dense by {100 * (ratio - 1):.1f}%"


def decode_section(dec: dict) -> list[str]:
    """Markdown: `bench decode` per model, cache kind and batch size, against the memory-bound floor."""
    L = ["## 5. Decoding on this machine", "",
         f"`bench decode` (`boost_jax/model/decode.py`): random weights of each shape, prompts of {dec['runs'][0]['prompt_len']} "
         f"tokens prefilled in one forward, {dec['runs'][0]['new_tokens']} new tokens greedily in the compiled decode "
         "loop, the median of the repetitions after a warm-up that compiles. A decode step reads every weight once (at "
         "the compute dtype; of the untied embedding table only the rows it looks up) and every cached token of every "
         "row once, so it cannot beat (weight bytes + cached bytes) / "
         f"the read bandwidth measured in the same run ({dec['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, a compiled "
         "matrix-vector product over 256 MiB): the floor. The latent_v cache keeps the keys and v's rank-r latent, the "
         "latent one both latents and rebuilds the keys each step (bytes per cached token, all layers, below; "
         "docs/design.md section 11). The full cache is heads-first, written in place, and on CPU the programs "
         "run their dots with XNNPACK (`decode.COMPILER_OPTIONS`; `bench decode --xla-defaults` times XLA's default "
         "beside it).", "",
         "| model | cache | bytes/token | batch | prefill tok/s | decode tok/s | step ms | floor ms | step / floor |",
         "|---|---|---|---|---|---|---|---|---|"]
    for run in dec["runs"]:
        for r in run["rows"]:
            L.append(f"| {run['model']} {run['arch']} | {r['cache']} | {r['cache_bytes_per_token']:,} | {r['batch']} | "
                     f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | {1e3 * r['step_s']:.2f} | "
                     f"{1e3 * r['floor_s']:.2f} | {r['step_over_floor']:.2f}x |")
    for run in dec["runs"]:
        if hf := run.get("hf"):
            gemms = "step_gemms" in hf  # results measured before the matmul columns have none
            L += ["", f"Hugging Face `generate` on the same {run['model']} {run['arch']} (exported with `python -m "
                  f"boost_jax.export`, transformers {hf['transformers']}, torch {hf['torch']}, {hf['threads']} threads, "
                  "its KV cache, greedy), end to end (prefill included) beside boost_jax's"
                  + (f"; and a decode step's {hf['step_gemms']} matmuls alone (every projection and the LM head, one "
                     "after another at the batch's rows) in PyTorch and in XLA as the decoder compiles them, beside "
                     "boost_jax's whole step:" if gemms else ":"), "",
                  "| batch | Hugging Face tok/s | boost_jax tok/s | ratio |"
                  + (" PyTorch matmuls ms | XLA matmuls ms | XLA / PyTorch | boost_jax step ms |" if gemms else ""),
                  "|---|---|---|---|" + ("---|---|---|---|" if gemms else "")]
            for h in hf["rows"]:
                mine = next(r for r in run["rows"] if r["batch"] == h["batch"] and r["cache"] == "full")
                L.append(f"| {h['batch']} | {h['end_to_end_tokens_per_s']:,.1f} | {mine['end_to_end_tokens_per_s']:,.1f} "
                         f"| {mine['end_to_end_tokens_per_s'] / h['end_to_end_tokens_per_s']:.2f}x |"
                         + (f" {1e3 * h['step_gemms_s']:.2f} | {1e3 * h['xla_step_gemms_s']:.2f} | "
                            f"{h['xla_step_gemms_s'] / h['step_gemms_s']:.2f}x | {1e3 * mine['step_s']:.2f} |" if gemms else ""))
    for run in dec["runs"]:
        if timed := [r for r in run["rows"] if "api_call_s" in r]:
            hf = {h["batch"]: h["end_to_end_tokens_per_s"] for h in run.get("hf", {}).get("rows", [])}
            L += ["", f"As a notebook calls it: `api.generate(model, prompts, max_new_tokens=...)` on the same "
                  f"{run['model']} {run['arch']} in a loop, after its first call (which compiles; later calls reuse the "
                  "Decoder it keeps with the model), timed end to end beside the kept Decoder's call (interleaved)"
                  + (" and Hugging Face's `generate`" if hf else "") + ":", "",
                  "| batch | kept Decoder s/call | api.generate s/call | api / kept | api.generate tok/s"
                  + (" | Hugging Face tok/s | api / Hugging Face |" if hf else " |"),
                  "|---|---|---|---|---" + ("|---|---|" if hf else "|")]
            for r in timed:
                line = (f"| {r['batch']} | {r['call_s']:.3f} | {r['api_call_s']:.3f} | {r['api_call_s'] / r['call_s']:.2f}x | "
                        f"{r['api_tokens_per_s']:,.1f} |")
                if hf:
                    line += f" {hf[r['batch']]:,.1f} | {r['api_tokens_per_s'] / hf[r['batch']]:.2f}x |"
                L.append(line)
    return L + [""]


def evaluated_tokens(asked: int, evaluated: int) -> str:
    """"N validation tokens", and what was asked where the split held fewer."""
    return f"{evaluated:,} validation tokens" + (f" (all the split holds; {asked:,} asked)" if evaluated < asked else "")


def optimizers_section(q: dict) -> list[str]:
    """Markdown: `bench quality --vary train.optimizer=...`: each optimizer at its best learning rate."""
    from boost_jax.bench import quality

    o = q["optimizers"]
    return ["## 6b. Optimizers for factorized weights, measured", "",
            f"`{q['command']}`: the quality protocol's model and corpus (section 6), each arch trained from scratch on "
            f"{o['tokens']:,} tokens ({o['steps']} steps) by each optimizer (`train.optimizer`, docs/design.md section 14) "
            f"at every rate of the grid, evaluated on {evaluated_tokens(o['eval_tokens'], o['evaluated_tokens'])}; the best rate's run is "
            "repeated with a second seed (another initialisation and batch order). The spread is the two seeds' "
            "difference: a gap between optimizers smaller than it is not a result.", "",
            *quality.optimizer_table(o), "", *(optimizer_step_lines(q["step"]) if "step" in q else [])]


def optimizer_step_lines(s: dict) -> list[str]:
    """Markdown: `bench step --vary train.optimizer=...`: each optimizer's step time and what its
    Newton-Schulz adds, measured beside its FLOPs at adamw's own step rate."""
    base = s["results"][0]
    lines = [f"`{s['command']}` ({base['arch']}, one device, {base['dtype']}, {base['batch']} x {base['seq']} tokens; "
             f"matmul peak {s['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s): the time each optimizer adds to adamw's step, "
             "and what its Newton-Schulz FLOPs cost at adamw's step rate (training FLOPs / step time). Our "
             "target: the added time within 1.5x of the predicted (the orthogonalisation runs as GEMMs, not as copies).", "",
             "| optimizer | median step ms | added ms (share of the step) | Newton-Schulz GFLOP | predicted ms | measured / predicted |",
             "|---|---|---|---|---|---|"]
    for r in s["results"]:
        if "optimizer_overhead_s" not in r:
            lines.append(f"| {r['optimizer']} | {1e3 * r['median_step_s']:.1f} | - | 0 | - | - |")
            continue
        added, predicted = r["optimizer_overhead_s"], r["predicted_optimizer_overhead_s"]
        lines.append(f"| {r['optimizer']} | {1e3 * r['median_step_s']:.1f} | {1e3 * added:.1f} "
                     f"({100 * added / r['median_step_s']:.0f}%) | {r['newton_schulz_flops'] / 1e9:.2f} | "
                     f"{1e3 * predicted:.1f} | {added / predicted:.2f} |")
    return lines + [""]


def gpu_section(pr: dict, pl: dict | None, programs) -> list[str]:
    """Markdown: the paper's rows (`bench paper --gpu-compile`), the planner's choices (`bench planner
    --gpu-compile`) and single programs (`python -m boost_jax.compile --json`) compiled by XLA:GPU
    without a GPU: memory beside the memory model's, seconds beside the performance model and the paper."""
    hw = pr["settings"]["gpu_compile"]
    off = [r for r in pr["rows"] if "gpu_compile" in r and r["paper_seconds"]
           and abs(paper.protocol_seconds(r, r["gpu_compile"]["predicted"]) / r["paper_seconds"] - 1) > 0.15]
    L = ["## 8. Compiled for GPUs, without one", "",
         f"`{pr['settings']['command']}`: each paper row's gradient program compiled by XLA's GPU compiler for its "
         f"{hw} GPUs on this CPU-only machine (`launch/gpu_target.py`; the memory model's layer term compiled by the "
         "same compiler). The roofline prices the GEMMs, cuDNN attention calls, memory-bound fusions and collectives of "
         "the program XLA:GPU built at the datasheet's peak, bandwidth and links (every efficiency 1, no latency); the "
         "performance model prices the same program with `hardware.yaml`'s efficiencies, beside its reading of the CPU "
         "program (section 2) and the paper. Memory: the gradient program's peak per GPU (AdamW's state apart, as "
         "section 1), and the memory model's figure for it.", "", *paper.gpu_table(pr), ""]
    recomputed = [r for r in pr["rows"] if "gpu_compile" in r and r["gpu_compile"]["gemm_flops"] > 1.01 * r["gemm_flops_hlo"]]
    if off:
        L += ["Rows where the performance model over XLA:GPU's program is more than 15% from the paper: "
              + "; ".join(f"{r['model']} {r['variant']} "
                          f"({paper.protocol_seconds(r, r['gpu_compile']['predicted']) / r['paper_seconds']:.2f}x)"
                          for r in off) + ". Section 2's list of what the model cannot know applies to both programs.", ""]
    if recomputed:
        L += ["XLA:GPU rematerializes a program over a memory limit of its own (about 51-54 GiB for an A100-80GB "
              "compiled without one), recomputing GEMMs the CPU program does once; the GPU program's GEMM FLOPs over "
              "the CPU program's: " + "; ".join(f"{r['model']} {r['variant']} "
                                                f"{r['gpu_compile']['gemm_flops'] / r['gemm_flops_hlo']:.2f}x"
                                                for r in recomputed) + ".", ""]
    if pl:
        L += [f"The planner's choices (section 3) compiled by XLA:GPU for {pl['settings']['gpu_compile']}: the train "
              f"step as `train` builds it, optimizer included (`{pl['settings']['command']}`):", "",
              *planner.gpu_lines(pl), ""]
        off = [f"{r['model']} {name.replace('_', ' ')} ({g['memory_model_bytes'] / g['peak_bytes']:.2f}x)"
               for r in pl["rows"] for name, g in r.get("gpu_compile", {}).items()
               if abs(g["memory_model_bytes"] / g["peak_bytes"] - 1) > 0.10]
        if off:
            L += ["More than 10% from XLA:GPU's peak: " + ", ".join(off) + ". The FSDP layouts: the memory model "
                  "counts the stacked weights gathered for the whole step, as XLA:CPU's program holds them "
                  "(`fsdp_gathered`, section 10 of docs/design.md), where XLA:GPU's gathers them layer by layer "
                  "inside the loop; the model is pessimistic there, and the planner with it.", ""]
    for r in programs:
        L += [f"`{r['command']}`:", "", "| program | compile s | peak MiB | temp MiB | memory model MiB | collectives per "
              "step (MiB) | per layer over tp: compiled / formula MiB | library calls and kernels |",
              "|---|---|---|---|---|---|---|---|"]
        for p in r["programs"]:
            layer = (f"{p['layer_collective_bytes'] / MIB:.3f} / {p['analytic_collective_bytes'] / MIB:.3f}"
                     if p["analytic_collective_bytes"] else "-")
            model = f"{p['model_memory'] / MIB:,.0f}" if p.get("model_memory") else "-"
            calls = ", ".join(f"{k} {n}" for k, n in p["custom_calls"].items() if "cudnn" in k or "gpu$" in k or "cublas" in k)
            L.append(f"| {p['name']} | {p['compile_s']:.1f} | {p['memory']['peak'] / MIB:,.0f} | {p['memory']['temp'] / MIB:,.0f} "
                     f"| {model} | {p['collective_bytes'] / MIB:,.1f} | {layer} | {calls or '-'} |")
        L.append("")
    return L


def startup_section(st: dict) -> list[str]:
    """Markdown: `bench startup`: each command's seconds to its first result, cold and warm."""
    from boost_jax.bench import startup

    return ["## 7. Start-up: from the command to its first result", "",
            f"`{st['command']}`: the config's run trained for {st['steps']} steps, then `train` (a run dir of its own), "
            "`eval` and `generate` on it (the README's `--prompt \"def main(\" --max-new-tokens 40`), each twice in a "
            "fresh process with its own compilation cache folder: first empty (cold), then as the first run left it "
            "(warm). Wall seconds are the process's, timed from outside; the split is the command's own `--timings` "
            "(launch/startup.py: compile is every trace, lowering and XLA compile or cache read).", "",
            *startup.table(st), ""]


def planner_section(pl: dict) -> list[str]:
    """Markdown: `bench planner`'s table (the planner's choice beside the paper's layout, per paper row)."""
    st = pl["settings"]
    budget = st["hbm_bytes"] * (1 - st["headroom"]) / GIB
    return [
        "## 3. The planner on the paper's rows",
        "",
        f"`python -m boost_jax.plan` on each row's GPUs ({st['hardware']}) and batch ({st['arch']}, {st['dtype']}, "
        f"seq {st['seq']}; an iteration of PP micro-batches of {st['batch']}, as section 1 compiles it). It enumerates every "
        "layout (scheme, TP, PP, pipeline repeats, DP, FSDP, micro-batches, remat), keeps those the memory model puts "
        f"within {budget:.1f} GiB per GPU ({100 * st['headroom']:.0f}% headroom: the paper's layouts ran in this memory; "
        "full remat only where neither none nor lowrank fits, since it recomputes every GEMM of a layer's forward), "
        "and prices them with the performance model of section 2, each on its own abstract compile: in order of a lower "
        "bound on their time that needs no compile (`planner/price.py`), skipping those whose bound cannot beat the fastest "
        f"priced, at most {st['max_priced'] or 'all'} besides the paper's layout. The paper's layout (BTP at its TP and PP, "
        "DP = FSDP = 1, M = PP) is priced in every remat mode that fits and shown at its fastest. Schemes searched: "
        f"{', '.join(st['schemes'])}; pipeline repeats {', '.join(map(str, st['pp_repeats']))}. Seconds per iteration, "
        "predicted with no communication overlap (the planner's default; `python -m boost_jax.plan --overlap` prices "
        "the overlap of section 2 and the data-parallel all-reduce behind the backward pass). Time to plan: the row's wall time on this machine"
        + (f", {st['workers']} compile workers, from {'an empty' if st['cold_cache'] else 'a warm'} compile cache."
           if "workers" in st else "."),
        "",
        *planner.table(pl),
        "",
        "The planner's choice is never slower than the paper's layout when that layout fits: it is one of the priced "
        "candidates. Its layouts in every remat mode (memory by the memory model, and why each lost):",
        "",
        *planner.paper_layout_lines(pl),
        "",
    ]


def profile_section(rows: list[dict]) -> list[str]:
    """Markdown: `bench profile`'s time by category per variant, and the first variant's top ops."""
    r0 = rows[0]
    head = " | ".join(f"{r['arch']}/{r['scheme']} tp={r['tp']}" for r in rows)
    share = lambda r, s: f"{1e3 * s:,.0f} ({100 * s / r['step_s']:.1f}%)"
    L = ["### Where the step time goes (`bench profile`)", "",
         f"{r0['model']}, fp32, batch {r0['batch']} x {r0['seq']}, {r0['steps']} traced steps each; ms per step and share "
         "of the traced step. Per device (at TP=4 the mean of the simulated devices, which share the host's cores). "
         "*loss* is the gradient outside the layer scan (embedding, final norm, LM head and cross-entropy, GEMMs "
         "included); *attention* the `attention` name scope; *gemm* the layers' other matmuls; *host gaps* the time "
         "inside the traced steps when a device ran no op and awaited no asynchronous op's result (the CPU "
         "runtime's Eigen matmuls return before their work is done; that time is theirs). *Accounted* = "
         "categorised ops + host gaps over the step (`boost_jax/bench/profile.py`, `boost_jax/analysis/timeline.py`).", "",
         f"| category | {head} |", "|---|" + "---|" * len(rows)]
    for k in r0["categories"]:
        L.append(f"| {k} | " + " | ".join(share(r, r["categories"][k]) for r in rows) + " |")
    L += ["| **step (traced)** | " + " | ".join(f"{1e3 * r['step_s']:,.0f}" for r in rows) + " |",
          "| step (untraced) | " + " | ".join(f"{1e3 * r['untraced_step_s']:,.0f}" for r in rows) + " |",
          "| ops alone | " + " | ".join(f"{100 * r['ops_fraction']:.1f}%" for r in rows) + " |",
          "| **accounted** | " + " | ".join(f"{100 * r['accounted_fraction']:.1f}%" for r in rows) + " |", "",
          f"Top ops, {r0['arch']}/{r0['scheme']} TP={r0['tp']}:", "",
          "| op | category | ms/step | of step | JAX name |", "|---|---|---|---|---|"]
    L += [f"| {o['name']} | {o['category']} | {1e3 * o['s_per_step']:,.0f} | {100 * o['fraction']:.1f}% "
          f"| `{o['op_name'].removeprefix('jit(train_step)/')[-60:]}` |" for o in r0["top_ops"]]
    return L + [""]


def _fmt(v) -> str:
    if isinstance(v, float) and (v >= 1e4 or v < 1e-2):
        return f"{v:.3g}"
    return "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def differences(pr: dict) -> list[str]:
    """Rows where the model is more than 15% from the paper, and the model's known blind spots."""
    hw = next(iter(pr["hardware"]))
    out = []
    for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in pr["rows"]):
        best = paper.best_reading(pr, model, variant, hw)
        if best and abs(best[1] - 1) > 0.15:
            out.append(f"- {model} {variant}: no reading within 15% of the paper; the closest, {best[0]}, is {best[1]:.2f}x.")
    if not out:
        out.append(f"- On {hw} every paper row is within 15% of the paper under at least one reading (the table above names it).")
    out += [
        "",
        "What the model cannot know, and so where it is expected to miss:",
        "",
        "- **The pipeline schedule.** The paper gives (TP, PP) and a micro-batch of 4 sequences, but neither the "
        "micro-batches per iteration nor its schedule; the authors' code runs 1F1B, their configs 4 micro-batches of one "
        "sequence (7B's; 13B and 30B have none of theirs). The pipelined rows here are our compiled SPMD pipeline (fill and "
        "drain over M + PP - 1 iterations, bubbles computed like the rest): the micro reading at M = PP micro-batches of 4, "
        "compared per micro-batch (an iteration over M), the authors' at their 4 of 1, compared per iteration. Were the "
        "paper's time one micro-batch of 4 through its stages in sequence, it would need these fractions of A100 peak "
        "(analytic model FLOPs / TP / time / peak):",
        *(f"  - {line}" for line in _pp_requirements(pr)),
        "",
        "  A figure near 100% cannot be reached, which rules that reading out. The time per micro-batch also keeps "
        "falling as M grows (the pipeline table's last column: one loop iteration plus a micro-batch's share of the "
        "embedding, head and loss), so the comparison depends on an M the paper does not state.",
        "- **Vanilla TP's replicated work** is priced as our vanilla program does it (attention over all heads and the "
        "SwiGLU product on every rank, as docs/design.md section 2 describes), which is what the authors' vanilla baseline "
        "does too (its q/k/v are all-reduced whole and attention runs over every head); like theirs, ours runs the A's of "
        "one input as one GEMM.",
        "- **Memory-bound work** is counted from XLA:CPU's fusion decisions, not a GPU's (see `analysis/work.py`); it is the "
        "least certain part and the largest share of BOOST's predicted time after GEMMs.",
        "- **Kernel quality of the paper's code** (Nanotron, PyTorch eager, its own fused kernels, framework overheads) is not "
        "modelled: every GEMM is assumed to be cuBLAS at the stated efficiency, every attention FlashAttention-2.",
        "- **At TP=1** vanilla and BTP are the same program apart from BOOST's grouping and norm, so the model predicts them "
        "nearly equal; the paper's 1B row shows the same.",
    ]
    return out


def _pp_requirements(pr: dict) -> list[str]:
    """For each pipelined paper row: the fraction of A100 peak its time needs if it were one micro-batch
    of `batch` sequences through the stages in sequence."""
    out = []
    for r in pr["rows"]:
        if r["pp"] > 1 and r["paper_seconds"] and r["variant"] in TRIO and r["protocol"] == "micro":
            cfg = paper.row_config(r["model"], r["variant"])
            flops = count(cfg.model, r["seq"]).train_flops_per_token * r["batch"] * r["seq"]
            need = flops / r["tp"] / (r["paper_seconds"] * A100_PEAK)
            out.append(f"{r['model']} {r['variant']} (PP={r['pp']}, {r['paper_seconds']:.2f} s): {100 * need:.0f}%")
    return out


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench report", __doc__)  # the config: overrides for the paper's and planner's rows
    paper.add_flags(p)
    p.add_argument("--paper-json", help="reuse a saved `bench paper --json` instead of compiling")
    p.add_argument("--planner-json", help="reuse a saved `bench planner --json` instead of planning")
    p.add_argument("--quality-json", help="a saved `bench quality --json` (its hour of training) for section 6")
    p.add_argument("--optimizers-json", help="a saved `bench quality --vary train.optimizer=... --json` for section 6b")
    p.add_argument("--study-json", help="a saved `python -m boost_jax.study --json` (its hours of training) for section 6c")
    p.add_argument("--startup-json", help="a saved `bench startup --json` (its minutes of fresh processes) for section 7")
    p.add_argument("--step-model", default="llama-130m", help="bench step --compare preset (TP=4)")
    p.add_argument("--step-batch", type=int, default=4, help="train.batch_size of the timed sections")
    p.add_argument("--step-seq", type=int, default=256, help="train.seq_len of the timed sections")
    p.add_argument("--single-models", default="llama-60m,llama-130m", help="presets timed on one device")
    p.add_argument("--decode-model", default="llama-60m", help="bench decode preset (dense and cola)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="docs", help="folder for results.md (plots go to <out>/img)")
    p.add_argument("--rerender", metavar="RESULTS_JSON", help="redraw the page and plots from a saved results.json, measuring nothing")
    a = parse(p, argv)
    if a.reps < 1 or a.steps < 1 or a.step_batch < 1 or a.step_seq < 1:
        raise ConfigError("--reps, --steps, --step-batch and --step-seq must be at least 1")
    from boost_jax.config.presets import PRESETS
    from boost_jax.runtime.paths import check_writable_dir

    for flag, names in (("--step-model", a.step_model), ("--single-models", a.single_models),
                        ("--decode-model", a.decode_model)):
        if bad := [n for n in names.split(",") if n not in PRESETS]:
            raise ConfigError(f"{flag}: unknown preset {bad[0]!r}; choose from {sorted(PRESETS)}")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out = Path(a.out)
    check_writable_dir(out / "img", "--out")
    # Saved inputs are read before anything is measured: a bad file fails in a second, not after the paper's compiles.
    saved = {flag: read_saved(path, flag, keys) for flag, path, keys in (
        ("--rerender", a.rerender, RESULT_KEYS), ("--paper-json", a.paper_json, ("settings", "hardware", "rows")),
        ("--planner-json", a.planner_json, ("settings", "rows")),
        ("--quality-json", a.quality_json, ("runs", "recovery")),
        ("--optimizers-json", a.optimizers_json, ("optimizers", "command")),
        ("--startup-json", a.startup_json, ("rows", "command")),
        ("--study-json", a.study_json, study_section.KEYS)) if path}
    result = saved["--rerender"] if a.rerender else measure_all(a, argv, log, saved)
    images = plot(result, out / "img")
    (out / "results.md").write_text(page(result, images, "img"))
    if not a.rerender:
        (out / "results.json").write_text(json.dumps(result, indent=1))
    log(f"wrote {out / 'results.md'} and {len(images)} plots in {out / 'img'}"
        + ("" if a.rerender else f"; the measurements in {out / 'results.json'}"))


RESULT_KEYS = ("machine", "commands", "paper", "planner", "step_compare", "single_device", "profile")


def read_saved(path: str, flag: str, keys: tuple[str, ...]) -> dict:
    """A saved JSON input of `flag`, or one ConfigError naming the flag, the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{flag} {path}: cannot read it as JSON ({e})") from e
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(f"{flag} {path}: not the JSON this flag reads (missing {', '.join(missing)})")
    return data


def measure_all(a: argparse.Namespace, argv: list[str], log, saved: dict[str, dict]) -> dict:
    """Every section measured here, except those read from `saved` (--paper-json, --planner-json)."""
    if a.paper_json:
        pr = saved["--paper-json"]
        paper_cmd = pr["settings"].get("command", f"(paper results read from {a.paper_json})")
    else:
        log("bench paper: abstract compiles of the paper's settings")
        pr = paper.from_flags(a, log=log)
        paper_cmd = " ".join(["python -m boost_jax.bench paper --models", a.models, "--variants", a.variants, *a.config])
    if a.planner_json:
        pl = saved["--planner-json"]
    else:
        log("bench planner: the planner on the paper's rows (compiles cached on disk)")
        pl = planner.run(a.models.split(","), planner.paper_hardware(), overrides=tuple(a.config), log=log)
        pl["settings"]["command"] = " ".join(["python -m boost_jax.bench planner --models", a.models, *a.config])
    compared = step_args(a.step_model, "cola", 4, a.step_batch, a.step_seq)
    singles = [step_args(m, arch, 1, a.step_batch, a.step_seq) for m in a.single_models.split(",")
               for arch in ("dense", "cola")]
    timing = f"--reps {a.reps} --steps {a.steps}"
    with tempfile.TemporaryDirectory() as traces:
        log(f"bench step --compare: {a.step_model}, TP=4, {a.reps} interleaved repetitions; then bench profile")
        sc, tp_profiles = in_fresh_process("compare_section", compared, a.reps, a.steps, a.step_model, traces)
        log(f"single device: {a.single_models}; then bench profile")
        sd, one_profiles = in_fresh_process("single_device_section", singles, a.reps, a.steps, a.step_model, traces)
        prof = [{**one_profiles, **tp_profiles}[f"{arch}/{scheme}/tp{tp}"] for arch, scheme, tp in PROFILED]
    log(f"bench decode: {a.decode_model} dense and cola, batches 1, 8, 32")
    dec = in_fresh_process("measure_decode", a.decode_model, a.reps)
    commands = [
        paper_cmd,
        pl["settings"]["command"],
        " ".join(["python -m boost_jax.bench step --compare", *compared, timing]),
        *(" ".join(["python -m boost_jax.bench step", *args, timing]) for args in singles),
        "python -m boost_jax.bench report" + "".join(f" {x}" for x in argv),
    ]
    commands += [" ".join(["python -m boost_jax.bench profile", *step_args(a.step_model, arch, tp, a.step_batch, a.step_seq,
                                                                         scheme), f"--steps {a.steps}"])
                 for arch, scheme, tp in PROFILED]
    commands += [f"python -m boost_jax.bench decode model.preset={a.decode_model} model.arch={arch} --reps {a.reps}"
                 + (" --api" if arch == "dense" else "") + (" --hf" if arch == "dense" and dec["runs"][0].get("hf") else "")
                 for arch in ("dense", "cola")]
    kept = {section: saved[flag] for section, flag in (("quality", "--quality-json"), ("optimizers", "--optimizers-json"),
                                                       ("startup", "--startup-json"), ("study", "--study-json"))
            if flag in saved}
    commands += [s["command"] for s in kept.values()]
    return {"machine": machine(), "commands": commands, "paper": pr, "planner": pl, "step_compare": sc,
            "single_device": sd, "profile": prof, "decode": dec, **kept}


# The child process of `in_fresh_process`: one of this module's sections, its result as JSON.
_CHILD = ("import json, sys; from boost_jax.bench import report; "
          "print(json.dumps(getattr(report, sys.argv[1])(*json.loads(sys.argv[2]))))")


def in_fresh_process(section: str, *args):
    """`section(*args)` (a function of this module, JSON in and out) in a fresh Python process. A
    timed section runs as its own `bench` command would: JAX with the devices its configs simulate
    (this process has the paper's 16, and a single-device step here ran 1.3x slower beside them) and
    the host memory setting of what it times (bench/common.config_of: decoding keeps glibc's
    defaults, which the training steps give up for good)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, section, json.dumps(args)], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench report: the {section} measurement failed (exit {out.returncode}; its error is above)")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_section(compared: list[str], reps: int, steps: int, profiled: str, traces: str) -> tuple[dict, dict]:
    """`bench step --compare` of `compared`, then `profiles` of model `profiled` at its tp."""
    runners = [Runner(c) for c in compare_configs(compared)]
    return step_compare(runners, reps, steps), profiles(runners, profiled, steps, Path(traces))


def single_device_section(singles: list[list[str]], reps: int, steps: int, profiled: str, traces: str) -> tuple[dict, dict]:
    """`bench step` of each of `singles` on one device, then `profiles` of model `profiled` at tp 1."""
    runners = [Runner(config_of(args)) for args in singles]
    return single_device(runners, reps, steps), profiles(runners, profiled, steps, Path(traces))


def measure_decode(model: str, reps: int) -> dict:
    """`bench decode` of `model` dense (beside Hugging Face generate when torch and transformers are
    installed) and cola, batches 1, 8 and 32."""
    from boost_jax.bench import decode

    def measure(bandwidth: float) -> dict:
        runs = []
        for arch in ("dense", "cola"):
            cfg = config_of([f"model.preset={model}", f"model.arch={arch}", "parallel.dp=1"], decoding=True)
            caches = ["full", "latent_v", "latent"] if arch != "dense" else ["full"]
            run = decode.measure(cfg, caches, [1, 8, 32], 64, 64, reps, bandwidth, through_api=arch == "dense")
            if arch == "dense":
                try:
                    run["hf"] = decode.hf_generate(cfg, [1, 8, 32], 64, 64, reps)
                except ImportError:  # torch or transformers not installed: the section shows boost_jax alone
                    pass
            runs.append(run)
        return {"runs": runs}

    return decode.measure_with_bandwidth(measure)
