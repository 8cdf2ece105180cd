"""`bench report`: regenerate docs/results.md and its plots in one run.

It runs `bench paper` (abstract compiles of the paper's settings + the performance model), a
`bench step --compare` on a 4-way TP simulated mesh (dense/megatron, cola/vanilla, cola/btp
interleaved over several repetitions), and the single-device training throughput against the
matmul peak measured in the same run; then writes the page and the PNGs. Every number on the page
comes from this run (or from `--paper-json`, a saved `bench paper --json`). The page's text is the
template results_page.md beside this file; the code here computes the numbers and tables it holds.
Section 9 (latent heads) draws saved `bench decode`, `bench comm` and `bench quality` outputs given by
`--latent-decode-json`, `--latent-comm-json` and `--latent-quality-json` (bench/latent_section.py);
section 6 draws a saved study (`--study-json`), and beside it 6b and 6c the factored dense model of
`--quality-json` and the step times of `--optimizers-json` (without a study, sections 6 and 6b are
those two runs' comparisons); section 7 draws `--startup-json`. With `--rerender` the saved runs given
are added to the saved results (replacing what they held), and results.json is written with them.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from string import Template

import flax
import jax
import jaxlib
import numpy as np
import optax

from boost_jax.bench import decode, latent_section, paper, planner, quality, startup, study_section
from boost_jax.bench.common import config_of, parse, parser
from boost_jax.bench.profile import profile
from boost_jax.bench.step import Runner, compare_configs, measure_with_peak, time_runners
from boost_jax.config import ConfigError
from boost_jax.config.presets import PRESETS
from boost_jax.launch.peaks import PEAK_BF16_FLOPS
from boost_jax.model.counts import count
from boost_jax.runtime.paths import check_writable_dir
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
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "backend": jax.default_backend(), "devices": jax.device_count(), "commit": commit,
            "date": datetime.date.today().isoformat()}


# ----------------------------------------------------------------------------- plots


def plot(result: dict, out: Path) -> list[str]:
    """Every figure `result` holds the data for, drawn into `out`: their file names, in FIGURES' order."""
    files = []
    for name, draw in FIGURES:
        if (fig := draw(result)) is not None:
            files.append(_save(fig, out / name))
    return files


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend), whatever display the host has."""
    import matplotlib  # optional: matplotlib is a dev extra, needed by `bench report` alone

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: as above, and only after the backend is chosen

    return plt


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path.name


def _paper_rows(pr: dict):
    """The paper's models in order, the protocol the plots read (the first), and its row finder."""
    protocol = pr["settings"]["protocols"][0]
    return list(dict.fromkeys(r["model"] for r in pr["rows"])), protocol, lambda m, v: paper.find_row(pr, m, v, protocol)


def paper_vs_model(result: dict):
    """Seconds per iteration: the model on each GPU beside the paper (A100)."""
    pr, plt = result["paper"], pyplot()
    hw_names = list(pr["hardware"])
    models, protocol, row = _paper_rows(pr)
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
    return fig


def layer_comm(result: dict):
    """Communication per decoder layer (fwd + bwd), measured on the compiled HLO."""
    models, protocol, row = _paper_rows(result["paper"])
    fig, ax = pyplot().subplots(figsize=(7, 4))
    x = np.arange(len(models))
    for i, v in enumerate(TRIO):
        rows = [row(m, v) for m in models]
        ax.bar(x + (i - 1) * 0.27, [(r["layer_forward_bytes"] + r["layer_backward_bytes"]) / GIB for r in rows], 0.27, label=LABELS[v])
    ax.set_xticks(x, [f"{m.removeprefix('llama-')}\nTP={row(m, TRIO[0])['tp']}" for m in models])
    ax.set_ylabel("GiB per layer per device (fwd + bwd)")
    ax.set_title(f"Collectives per decoder layer, compiled HLO ({protocol} protocol)")
    ax.legend()
    fig.tight_layout()
    return fig


def breakdown_7b(result: dict):
    """Where llama-7b's time goes on the first GPU of the hardware file (the paper's A100); None
    without a llama-7b row."""
    pr = result["paper"]
    _, protocol, _ = _paper_rows(pr)
    seven = [r for r in pr["rows"] if r["model"] == "llama-7b" and r["protocol"] == protocol]
    if not seven:
        return None
    hw = next(iter(pr["hardware"]))
    fig, ax = pyplot().subplots(figsize=(9.5, 4))
    bottom = np.zeros(len(seven))
    for part in seven[0]["predicted"][hw]["parts"]:
        vals = np.array([r["predicted"][hw]["parts"][part] for r in seven])
        ax.bar(range(len(seven)), vals, bottom=bottom, label=part)
        bottom += vals
    ax.plot(range(len(seven)), [r["paper_seconds"] or np.nan for r in seven], "ko", ms=8, label="paper")
    ax.set_xticks(range(len(seven)), [r["variant"] for r in seven], rotation=20)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"llama-7b, TP=4, {hw}: predicted time by part")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def cpu_measured(result: dict):
    """Measured on this machine: the TP=4 step compare with its repetitions, and one device's
    training FLOP/s over the matmul peak."""
    sc, sd = result["step_compare"], result["single_device"]
    fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(10, 4))
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
    return fig


def decode_figure(result: dict):
    """Decoding on this machine: tokens/s per batch size beside the memory-bound ceiling; None
    without a decode section."""
    if "decode" not in result:
        return None
    runs = result["decode"]["runs"]
    fig, axes = pyplot().subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True)
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
    return fig


def quality_figure(result: dict):
    """The quality runs: validation loss against tokens and against training FLOPs; None without them
    or beside a study (which supersedes their comparison: SUPERSEDED)."""
    if "quality" not in result or "study" in result:
        return None
    fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(11, 4), sharey=True)
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
    return fig


def study_figure(result: dict):
    """The saved study's loss against compute (bench/study_section.py); None without one."""
    return study_section.plot(result["study"]) if "study" in result else None


# The page's figures in its order: (file name, drawing of a results.json or None where it lacks the data).
FIGURES = (("paper_vs_model.png", paper_vs_model), ("layer_comm.png", layer_comm), ("breakdown_7b.png", breakdown_7b),
           ("cpu_measured.png", cpu_measured), ("decode.png", decode_figure), ("quality.png", quality_figure),
           (study_section.IMAGE, study_figure))


# ----------------------------------------------------------------------------- page

TEMPLATE = Path(__file__).with_name("results_page.md")
_PART = re.compile(r"^<!-- part: (\w+) -->\n", re.MULTILINE)
_WHOLE_LINE_SLOT = re.compile(r"\$(\w+)|\$\{(\w+)\}")


@functools.cache
def parts() -> dict[str, list[str]]:
    """TEMPLATE's parts by name, each the lines from its `part:` comment to the next one."""
    pieces = _PART.split(TEMPLATE.read_text())[1:]  # what precedes the first part is the template's own comment
    return {name: text.removesuffix("\n").split("\n") for name, text in zip(pieces[::2], pieces[1::2])}


def render(part: str, **slots) -> list[str]:
    """The lines of TEMPLATE's `part`, its slots filled: a slot alone on its line takes a list of lines
    (an empty one removes the line) or a string, any other slot a string or a number. An unknown part,
    or a slot of the part left unfilled, raises KeyError."""
    lines = []
    for line in parts()[part]:
        if whole := _WHOLE_LINE_SLOT.fullmatch(line):
            value = slots[whole[1] or whole[2]]
            lines += [value] if isinstance(value, str) else value
        else:
            lines.append(Template(line).substitute(slots))
    return lines


def phrase(part: str, **slots) -> str:
    """A one-line part, filled, for a slot of another part."""
    (line,) = render(part, **slots)
    return line


def page(result: dict, images: list[str], img_dir: str) -> str:
    """docs/results.md of a results.json: each section it holds the data for, then the plots."""
    lines = [*head(result), *paper_sections(result["paper"])]
    if "planner" in result:
        lines += planner_section(result["planner"])
    lines += measured_section(result["step_compare"], result["single_device"])
    for key, section in SECTIONS:
        if key in result:
            lines += (SUPERSEDED.get(key, section) if "study" in result else section)(result[key])
    if "gpu_paper" in result:
        lines += gpu_section(result["gpu_paper"], result.get("gpu_planner"), result.get("gpu_programs", ()))
    if "latent_heads" in result:
        lines += latent_heads_section(result["latent_heads"])
    lines += render("plots", images=[f"![{name}]({img_dir}/{name})" for name in images])
    return "\n".join(lines) + "\n"


def head(result: dict) -> list[str]:
    """The title, the notes on sections measured again later (which, when, why), the machine and the commands."""
    mc = result["machine"]
    notes = [f"- {note}" for note in result.get("notes", ())]
    memory = f"{mc['memory_bytes'] / GIB:.0f} GiB memory" if mc["memory_bytes"] else "memory unknown"
    return [*render("head", date=mc["date"], commit=mc["commit"]), *notes, *([""] if notes else []),
            *render("machine", **mc, memory=memory, commands=result["commands"])]


def paper_sections(pr: dict) -> list[str]:
    """Sections 1 and 2: the paper's rows compiled here, then the performance model beside the paper."""
    hw_names = list(pr["hardware"])
    first, s = hw_names[0], pr["settings"]
    theirs = ", ".join(f"{m.removeprefix('llama-').upper()} {a.rows} x {a.accumulation}" for m, a in paper.AUTHORS.items())
    lines = [*render("paper", dtype=s["dtype"], seq=s["seq"], batch=s["batch"], table=paper.measured_table(pr)),
             *render("perf_model", hardware=" | ".join(hw_names), rule="---|" * len(hw_names),
                     constants=constants_rows(pr), theirs=theirs)]
    for hw in hw_names:
        protocols = [line for protocol in s["protocols"]
                     for line in render("protocol", title=paper.PROTOCOL_TITLES[protocol].capitalize(),
                                        table=paper.prediction_table(pr, hw, protocol))]
        lines += render("hardware", hw=hw, description=pr["hardware"][hw]["description"], protocols=protocols)
    lines += render("fit", hw=first, table=paper.fit_table(pr, first))
    if pipe := paper.pipeline_table(pr, first):
        lines += render("pipeline", hw=first, table=pipe)
    if breakdown := paper.breakdown_table(pr, first):
        lines += render("breakdown", hw=first, table=breakdown, layer_comm=paper.layer_comm_table(pr, first))
    return lines + differences(pr)


def constants_rows(pr: dict) -> list[str]:
    """The performance model's constants, one table row per constant, one column per GPU."""
    hw_names = list(pr["hardware"])
    return [f"| {k} | " + " | ".join(_fmt(pr["hardware"][h][k]) for h in hw_names) + " |"
            for k in pr["hardware"][hw_names[0]] if k not in ("name", "description", "compile_target")]


def _fmt(v) -> str:
    if isinstance(v, float) and (v >= 1e4 or v < 1e-2):
        return f"{v:.3g}"
    return "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def differences(pr: dict) -> list[str]:
    """Rows where the model is more than 15% from the paper, and the model's known blind spots."""
    hw = next(iter(pr["hardware"]))
    misses = []
    for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in pr["rows"]):
        best = paper.best_reading(pr, model, variant, hw)
        if best and abs(best[1] - 1) > 0.15:
            misses += render("miss", model=model, variant=variant, reading=best[0], ratio=f"{best[1]:.2f}")
    return render("differences", misses=misses or render("no_miss", hw=hw), pp_requirements=_pp_requirements(pr))


def _pp_requirements(pr: dict) -> list[str]:
    """For each pipelined paper row: the fraction of A100 peak its time needs if it were one micro-batch
    of `batch` sequences through the stages in sequence."""
    out = []
    for r in pr["rows"]:
        if r["pp"] > 1 and r["paper_seconds"] and r["variant"] in TRIO and r["protocol"] == "micro":
            cfg = paper.row_config(r["model"], r["variant"])
            flops = count(cfg.model, r["seq"]).train_flops_per_token * r["batch"] * r["seq"]
            need = flops / r["tp"] / (r["paper_seconds"] * A100_PEAK)
            out += render("pp_requirement", model=r["model"], variant=r["variant"], pp=r["pp"],
                          seconds=f"{r['paper_seconds']:.2f}", need=f"{100 * need:.0f}")
    return out


def planner_section(pl: dict) -> list[str]:
    """Section 3: `bench planner`'s table (the planner's choice beside the paper's layout, per paper row)."""
    st = pl["settings"]
    workers = (phrase("planner_workers", workers=st["workers"], cache="an empty" if st["cold_cache"] else "a warm")
               if "workers" in st else ".")
    return render("planner", hardware=st["hardware"], arch=st["arch"], dtype=st["dtype"], seq=st["seq"], batch=st["batch"],
                  budget=f"{st['hbm_bytes'] * (1 - st['headroom']) / GIB:.1f}", headroom=f"{100 * st['headroom']:.0f}",
                  max_priced=st["max_priced"] or "all", schemes=", ".join(st["schemes"]),
                  pp_repeats=", ".join(map(str, st["pp_repeats"])), workers=workers, table=planner.table(pl),
                  paper_layouts=planner.paper_layout_lines(pl))


def measured_section(sc: dict, sd: dict) -> list[str]:
    """Section 4: the TP=4 step compare and the single-device steps against the matmul peak."""
    med = {v: sc["rows"][v]["median_step_s"] for v in TRIO}
    compare = [f"| {v} | {1e3 * r['median_step_s']:.0f} | {', '.join(f'{1e3 * t:.0f}' for t in r['step_times_s'])} | "
               f"{r['tokens_per_s']:,.0f} | {r['model_flops_per_s'] / 1e12:.3f} | {r['peak_bytes_per_device'] / MIB:.0f} |"
               for v, r in ((v, sc["rows"][v]) for v in TRIO)]
    single = [f"| {r['model']} | {r['arch']} | {1e3 * r['median_step_s']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_flops_per_s'] / 1e9:.1f} | {100 * r['fraction_of_matmul_peak']:.0f}% |" for r in sd["rows"]]
    return render("measured", model=sc["model"], batch=sc["batch"], seq=sc["seq"], tp=sc["tp"], reps=sc["reps"],
                  steps=sc["steps"], compare_rows=compare, btp_over_vanilla=f"{med['cola/vanilla'] / med['cola/btp']:.2f}",
                  btp_over_dense=f"{med['dense/megatron'] / med['cola/btp']:.2f}",
                  vanilla_over_dense=f"{med['dense/megatron'] / med['cola/vanilla']:.2f}",
                  dense_of_peak=f"{sc['rows']['dense/megatron']['model_flops_per_s'] / sd['matmul_peak_flops']:.0%}",
                  single_batch=sd["batch"], single_seq=sd["seq"], peak_gflops=f"{sd['matmul_peak_flops'] / 1e9:.1f}",
                  single_rows=single)


def profile_section(rows: list[dict]) -> list[str]:
    """Markdown: `bench profile`'s time by category per variant, and the first variant's top ops."""
    r0 = rows[0]
    share = lambda r, s: f"{1e3 * s:,.0f} ({100 * s / r['step_s']:.1f}%)"
    per_variant = lambda cell: " | ".join(cell(r) for r in rows)
    return render("profile", model=r0["model"], batch=r0["batch"], seq=r0["seq"], steps=r0["steps"],
                  variants=per_variant(lambda r: f"{r['arch']}/{r['scheme']} tp={r['tp']}"), rule="---|" * len(rows),
                  categories=[f"| {k} | {per_variant(lambda r: share(r, r['categories'][k]))} |" for k in r0["categories"]],
                  traced=per_variant(lambda r: f"{1e3 * r['step_s']:,.0f}"),
                  untraced=per_variant(lambda r: f"{1e3 * r['untraced_step_s']:,.0f}"),
                  ops=per_variant(lambda r: f"{100 * r['ops_fraction']:.1f}%"),
                  accounted=per_variant(lambda r: f"{100 * r['accounted_fraction']:.1f}%"),
                  arch=r0["arch"], scheme=r0["scheme"], tp=r0["tp"],
                  top_ops=[f"| {o['name']} | {o['category']} | {1e3 * o['s_per_step']:,.0f} | {100 * o['fraction']:.1f}% "
                           f"| `{o['op_name'].removeprefix('jit(train_step)/')[-60:]}` |" for o in r0["top_ops"]])


def decode_section(dec: dict) -> list[str]:
    """Markdown: `bench decode` per model, cache kind and batch size, against the memory-bound floor;
    then Hugging Face's generate and api.generate beside it where measured."""
    runs = dec["runs"]
    rows = [f"| {run['model']} {run['arch']} | {r['cache']} | {r['cache_bytes_per_token']:,} | {r['batch']} | "
            f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | {1e3 * r['step_s']:.2f} | "
            f"{1e3 * r['floor_s']:.2f} | {r['step_over_floor']:.2f}x |" for run in runs for r in run["rows"]]
    lines = render("decode", prompt_len=runs[0]["prompt_len"], new_tokens=runs[0]["new_tokens"],
                   bandwidth=f"{dec['read_bandwidth_bytes_per_s'] / 1e9:.1f}", rows=rows)
    lines += [line for run in runs if run.get("hf") for line in hf_generate_lines(run)]
    return lines + [line for run in runs for line in api_generate_lines(run)]


def hf_generate_lines(run: dict) -> list[str]:
    """Hugging Face's generate on `run`'s model beside boost_jax's decoder, end to end and matmuls alone."""
    hf = run["hf"]
    gemms = "step_gemms" in hf  # results measured before the matmul columns have none
    rows = []
    for h in hf["rows"]:
        mine = next(r for r in run["rows"] if r["batch"] == h["batch"] and r["cache"] == "full")
        rows.append(f"| {h['batch']} | {h['end_to_end_tokens_per_s']:,.1f} | {mine['end_to_end_tokens_per_s']:,.1f} "
                    f"| {mine['end_to_end_tokens_per_s'] / h['end_to_end_tokens_per_s']:.2f}x |"
                    + (f" {1e3 * h['step_gemms_s']:.2f} | {1e3 * h['xla_step_gemms_s']:.2f} | "
                       f"{h['xla_step_gemms_s'] / h['step_gemms_s']:.2f}x | {1e3 * mine['step_s']:.2f} |" if gemms else ""))
    return render("decode_hf", model=run["model"], arch=run["arch"], transformers=hf["transformers"], torch=hf["torch"],
                  threads=hf["threads"], matmuls=phrase("decode_hf_matmuls", count=hf["step_gemms"]) if gemms else ":",
                  matmul_columns=phrase("decode_hf_matmul_columns") if gemms else "",
                  matmul_rule="---|" * 4 if gemms else "", rows=rows)


def api_generate_lines(run: dict) -> list[str]:
    """`api.generate` called in a loop beside the kept Decoder (and Hugging Face's generate); none
    where `run` did not time it."""
    timed = [r for r in run["rows"] if "api_call_s" in r]
    if not timed:
        return []
    hf = {h["batch"]: h["end_to_end_tokens_per_s"] for h in run.get("hf", {}).get("rows", [])}
    rows = [f"| {r['batch']} | {r['call_s']:.3f} | {r['api_call_s']:.3f} | {r['api_call_s'] / r['call_s']:.2f}x | "
            f"{r['api_tokens_per_s']:,.1f} |" + (f" {hf[r['batch']]:,.1f} | {r['api_tokens_per_s'] / hf[r['batch']]:.2f}x |"
                                                 if hf else "") for r in timed]
    return render("decode_api", model=run["model"], arch=run["arch"], beside_hf=phrase("decode_api_beside_hf") if hf else "",
                  hf_columns=phrase("decode_api_hf_columns") if hf else "", hf_rule="---|" * 2 if hf else "", rows=rows)


def quality_section(q: dict) -> list[str]:
    """Markdown: `bench quality`: dense against the low-rank archs at equal tokens and equal FLOPs,
    beside CoLA's claim, and the compressed dense model's recovery."""
    r = quality.ratios(q)
    dense, cola = protocol_run(q, "dense"), protocol_run(q, "cola")
    ratios = [phrase("quality_ratio", label=label, ratio=f"{r[name]:.3f}", verdict=_verdict(r[name]))
              for name, label in (("cola/tokens", "cola at equal tokens"), ("cola/flops", "cola at dense's FLOPs"),
                                  ("svd/tokens", "svd at equal tokens"), ("svd/flops", "svd at dense's FLOPs"),
                                  ("lax/tokens", "lax at equal tokens")) if name in r]
    return [*render("quality", **quality_slots(q), rank=q["rank"], table=quality.table(q), ratios="; ".join(ratios),
                    dense_millions=f"{dense['params'] / 1e6:.1f}", cola_millions=f"{cola['params'] / 1e6:.1f}",
                    token_millions=f"{q['tokens'] / 1e6:.1f}"),
            *recovery_lines(q)]


def factored_section(q: dict) -> list[str]:
    """Markdown beside a study (section 6b): of `bench quality`, the compressed dense model's recovery alone."""
    return [*render("factored", **quality_slots(q)), *recovery_lines(q)]


def quality_slots(q: dict) -> dict:
    """The slots the quality protocol's run fills wherever the page states it."""
    dense = protocol_run(q, "dense")
    return dict(command=q["command"], model=q["model"], d_model=q["d_model"], n_layers=q["n_layers"],
                corpus=q["corpus"], seq_len=q["seq_len"], batch_size=q["batch_size"], eval_tokens=f"{q['eval_tokens']:,}",
                tokens=f"{q['tokens']:,}", tokens_per_parameter=f"{q['tokens'] / dense['params']:.2f}")


def protocol_run(q: dict, arch: str) -> dict:
    """The quality protocol's run of `arch` at the protocol's tokens."""
    return next(x for x in q["runs"] if (x["arch"], x["budget"]) == (arch, "tokens"))


def recovery_lines(q: dict) -> list[str]:
    """Markdown: the dense model factored into svd, as factored and after continued training."""
    dense = protocol_run(q, "dense")
    return render("recovery", recovery=[
        f"| {c['method']} | {c['rank']} | {dense['final']['perplexity']:.2f} | {c['compressed']['perplexity']:.2f} "
        f"| {c['recovered']['perplexity']:.2f} | {c['steps']} ({c['tokens']:,}) |" for c in q["recovery"]])


def _verdict(ratio: float) -> str:
    """A perplexity ratio against dense's in words: within 2% is a match."""
    if ratio < 0.98:
        return f"beats dense by {100 * (1 - ratio):.1f}%"
    return "matches dense" if ratio <= 1.02 else f"lags dense by {100 * (ratio - 1):.1f}%"


def optimizers_section(q: dict) -> list[str]:
    """Markdown: `bench quality --vary train.optimizer=...`: each optimizer at its best learning rate."""
    o = q["optimizers"]
    fewer = phrase("split_fewer", asked=f"{o['eval_tokens']:,}") if o["evaluated_tokens"] < o["eval_tokens"] else ""
    return [*render("optimizers", command=q["command"], tokens=f"{o['tokens']:,}", steps=o["steps"],
                    evaluated=f"{o['evaluated_tokens']:,}", fewer=fewer, table=quality.optimizer_table(o)),
            *(optimizer_step_lines(q["step"]) if "step" in q else [])]


def optimizer_costs_section(q: dict) -> list[str]:
    """Markdown beside a study (section 6c): of the optimizers' saved runs, their step times alone."""
    return [*render("optimizer_costs"), *optimizer_step_lines(q["step"])] if "step" in q else []


def optimizer_step_lines(s: dict) -> list[str]:
    """Markdown: `bench step --vary train.optimizer=...`: each optimizer's step time and what its
    Newton-Schulz adds, measured beside its FLOPs at adamw's own step rate."""
    base = s["results"][0]
    rows = []
    for r in s["results"]:
        if "optimizer_overhead_s" not in r:
            rows.append(f"| {r['optimizer']} | {1e3 * r['median_step_s']:.1f} | - | 0 | - | - |")
            continue
        added, predicted = r["optimizer_overhead_s"], r["predicted_optimizer_overhead_s"]
        rows.append(f"| {r['optimizer']} | {1e3 * r['median_step_s']:.1f} | {1e3 * added:.1f} "
                    f"({100 * added / r['median_step_s']:.0f}%) | {r['newton_schulz_flops'] / 1e9:.2f} | "
                    f"{1e3 * predicted:.1f} | {added / predicted:.2f} |")
    return render("optimizer_steps", command=s["command"], arch=base["arch"], dtype=base["dtype"], batch=base["batch"],
                  seq=base["seq"], peak_gflops=f"{s['matmul_peak_flops_per_s'] / 1e9:.1f}", rows=rows)


def startup_section(st: dict) -> list[str]:
    """Markdown: `bench startup`: each command's seconds to its first result, cold and warm."""
    return render("startup", command=st["command"], steps=st["steps"], table=startup.table(st))


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


def latent_heads_section(lh: dict) -> list[str]:
    """Section 9: latent heads, from the saved bench outputs it holds (bench/latent_section.py)."""
    lines = render("latent_heads")
    if "decode" in lh:
        dec, first = lh["decode"], lh["decode"]["runs"][0]
        target = latent_section.decode_target(dec)
        value = target.pop("value_latent")  # latent_v beside the latent cache, where the run measured it
        lines += render("latent_decode", command=latent_section.decode_command(dec), device=dec["device"],
                        model=first["model"], arch=first["arch"], dtype=first["dtype"], prompt_len=first["prompt_len"],
                        new_tokens=first["new_tokens"], positions=first["prompt_len"] + first["new_tokens"],
                        table=latent_section.decode_table(dec), **target,
                        value_latent=phrase("latent_decode_value", **value) if value else "")
    if "comm" in lh:
        comms = lh["comm"]
        lines += render("latent_comm", command=latent_section.comm_command(comms),
                        tps=", ".join(map(str, sorted({c["tp"] for c in comms}))), table=latent_section.comm_table(comms))
        if kv := latent_section.kv_forward(comms):  # a tp with both layouts
            lines += render("latent_comm_kv", rows=[phrase("latent_comm_kv_row", **row) for row in kv])
    if "quality" in lh:
        q, o = lh["quality"], lh["quality"]["latent_heads"]
        lines += render("latent_quality", command=q["command"], tokens=f"{o['tokens']:,}", steps=o["steps"],
                        evaluated=f"{o['evaluated_tokens']:,}", table=latent_section.quality_table(q),
                        costs=latent_section.quality_costs(q))
    return lines


def latent_heads_commands(lh: dict) -> list[str]:
    """The commands of section 9's saved inputs, as the section states them."""
    return [*([latent_section.decode_command(lh["decode"])] if "decode" in lh else []),
            *([latent_section.comm_command(lh["comm"])] if "comm" in lh else []),
            *([lh["quality"]["command"]] if "quality" in lh else [])]


def study_page_section(r: dict) -> list[str]:
    """Markdown: section 6, a saved `python -m boost_jax.study --json` (bench/study_section.py)."""
    pct = round(100 * r["interval"])
    readings = [multiplier_reading(m, pct) for m in r["multipliers"]
                if m["value"] is not None and m["interval"] is not None]
    return render("study", **study_section.slots(r),
                  readings=[phrase("study_readings"), "", *readings, ""] if readings else [])


def multiplier_reading(m: dict, pct: int) -> str:
    """A study's compute multiplier in words: its interval above 1, `of` is the cheaper; below 1, the
    dearer (read the other way round); holding 1, no difference shown."""
    (lo, hi), pair = m["interval"], dict(of=m["of"], against=m["against"], at=f"{m['at_loss']:.4f}", pct=pct)
    if lo > 1:
        return phrase("study_cheaper", **pair, times=f"{m['value']:.2f}", lo=f"{lo:.2f}", hi=f"{hi:.2f}")
    if hi < 1:
        return phrase("study_dearer", **pair, times=f"{1 / m['value']:.2f}", lo=f"{1 / hi:.2f}", hi=f"{1 / lo:.2f}")
    return phrase("study_even", **pair, lo=f"{lo:.2f}", hi=f"{hi:.2f}")


# The sections after section 4 that a results.json may hold, in the page's order: (its key, its Markdown).
SECTIONS = (("profile", profile_section), ("decode", decode_section), ("study", study_page_section),
            ("quality", quality_section), ("optimizers", optimizers_section), ("startup", startup_section))
# Beside a study (section 6), what it supersedes leaves the page (its runs stay in results.json): of the
# quality protocol the factored dense model stays (6b), of the optimizers' runs their step times (6c).
SUPERSEDED = {"quality": factored_section, "optimizers": optimizer_costs_section}


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench report", __doc__)  # the config: overrides for the paper's and planner's rows
    paper.add_flags(p)
    p.add_argument("--paper-json", help="reuse a saved `bench paper --json` instead of compiling")
    p.add_argument("--planner-json", help="reuse a saved `bench planner --json` instead of planning")
    p.add_argument("--quality-json", help="a saved `bench quality --json` (its hour of training) for section 6 "
                                          "(beside a study: its factored model, 6b)")
    p.add_argument("--optimizers-json", help="a saved `bench quality --vary train.optimizer=... --json` for section 6b "
                                             "(beside a study: its step table, 6c)")
    p.add_argument("--study-json", help="a saved `python -m boost_jax.study --json` (its hour of training) for section 6")
    p.add_argument("--startup-json", help="a saved `bench startup --json` (its minutes of fresh processes) for section 7")
    for saved_input in latent_section.INPUTS:  # section 9; with --rerender too: added to the saved results
        p.add_argument(saved_input.flag, nargs="+" if saved_input.several else None, help=saved_input.help)
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
    for flag, names in (("--step-model", a.step_model), ("--single-models", a.single_models),
                        ("--decode-model", a.decode_model)):
        if bad := [n for n in names.split(",") if n not in PRESETS]:
            raise ConfigError(f"{flag}: unknown preset {bad[0]!r}; choose from {sorted(PRESETS)}")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out = Path(a.out)
    check_writable_dir(out / "img", "--out")
    # Saved inputs are read before anything is measured: a bad file fails in a second, not after the paper's compiles.
    inputs = (("--rerender", RESULT_KEYS), ("--paper-json", ("settings", "hardware", "rows")),
              ("--planner-json", ("settings", "rows")), *((flag, keys) for _, flag, keys in KEPT))
    saved = {flag: read_saved(path, flag, keys) for flag, keys in inputs
             if (path := given(a, flag))}
    if "--study-json" in saved:
        study_section.check(saved["--study-json"], a.study_json)
    latent = read_latent_heads(a)
    added = latent or any(flag in saved for _, flag, _ in KEPT)  # with --rerender: saved runs to add to results.json
    result = saved["--rerender"] if a.rerender else measure_all(a, argv, log, saved)
    result = with_latent_heads(with_kept(result, saved), latent)
    images = plot(result, out / "img")
    (out / "results.md").write_text(page(result, images, "img"))
    if not a.rerender or added:
        (out / "results.json").write_text(json.dumps(result, indent=1))
    log(f"wrote {out / 'results.md'} and {len(images)} plots in {out / 'img'}"
        + ("" if a.rerender and not added else f"; the measurements in {out / 'results.json'}"))


RESULT_KEYS = ("machine", "commands", "paper", "planner", "step_compare", "single_device", "profile")


def given(a: argparse.Namespace, flag: str):
    """What the command line gave for `flag` (argparse's attribute of it)."""
    return getattr(a, flag.removeprefix("--").replace("-", "_"))


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


def read_latent_heads(a: argparse.Namespace) -> dict:
    """Section 9's saved inputs given on the command line, by part, each file checked by `read_saved`."""
    latent = {}
    for s in latent_section.INPUTS:
        if paths := given(a, s.flag):
            latent[s.part] = [read_saved(p, s.flag, s.keys) for p in paths] if s.several else read_saved(paths, s.flag, s.keys)
    if "comm" in latent:
        latent_section.check_comm(latent["comm"], a.latent_comm_json)
    return latent


def with_latent_heads(result: dict, latent: dict) -> dict:
    """`result` with section 9's saved inputs (replacing the parts it held) and their commands in its list."""
    if not latent:
        return result
    merged = {**result.get("latent_heads", {}), **latent}
    commands = [*result["commands"], *(c for c in latent_heads_commands(merged) if c not in result["commands"])]
    return {**result, "commands": commands, "latent_heads": merged}


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
    return {"machine": machine(), "commands": commands, "paper": pr, "planner": pl, "step_compare": sc,
            "single_device": sd, "profile": prof, "decode": dec}


# The sections a saved run fills rather than this command: (their key in results.json, the flag naming
# the file, what a file of it must hold).
KEPT = (("quality", "--quality-json", ("runs", "recovery")), ("optimizers", "--optimizers-json", ("optimizers", "command")),
        ("startup", "--startup-json", ("rows", "command")), ("study", "--study-json", study_section.KEYS))


def with_kept(result: dict, saved: dict[str, dict]) -> dict:
    """`result` with the sections of the saved runs given (replacing the ones it held) and their commands in its list."""
    kept = {section: saved[flag] for section, flag, _ in KEPT if flag in saved}
    commands = [*result["commands"], *(s["command"] for s in kept.values() if s["command"] not in result["commands"])]
    return {**result, **kept, "commands": commands}


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
