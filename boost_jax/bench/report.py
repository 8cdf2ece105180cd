"""`bench report`: regenerate docs/results.md and its plots in one run.

It runs `bench paper` (abstract compiles of the paper's settings + the performance model), a
`bench step --compare` on a 4-way TP simulated mesh (dense/megatron, cola/vanilla, cola/btp
interleaved over several repetitions), and the single-device training throughput against the
matmul peak measured in the same run; then writes the page and the PNGs. Every number on the page
comes from this run (or from `--paper-json`, a saved `bench paper --json`). The page's text is the
template results_page.md beside this file (bench/page.py fills it); each section's numbers and tables are
computed by its module (bench/paper_section.py, measured_section.py, study_section.py,
quality_section.py, gpu_section.py, latent_section.py, absorbed_section.py) and its plots by bench/figures.py; here they
are measured and put together. Section 9 (latent heads) draws saved `bench decode`, `bench comm` and `bench quality` outputs given by
`--latent-decode-json`, `--latent-comm-json` and `--latent-quality-json` (bench/latent_section.py), section 10
(decoupled RoPE) saved `bench decode`, `compile` and `bench quality` outputs given by `--absorbed-decode-json`,
`--absorbed-gpu-json` and `--absorbed-quality-json` (bench/absorbed_section.py);
section 6 draws a saved study (`--study-json`), and beside it 6b and 6c the factored dense model of
`--quality-json` and the step times of `--optimizers-json` (without a study, sections 6 and 6b are
those two runs' comparisons); section 7 draws `--startup-json`, section 11 `--serve-json`, section 12 `--finetune-json`. With `--rerender` the saved runs given
are added to the saved results (replacing what they held), and results.json is written with them.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import flax
import jax
import jaxlib
import optax

from boost_jax.bench import absorbed_section, decode, latent_section, paper, planner, serve, startup, study_section
from boost_jax.bench.common import config_of, parse, parser
from boost_jax.bench.figures import plot
from boost_jax.bench.finetune_section import finetune_section
from boost_jax.bench.gpu_section import gpu_section
from boost_jax.bench.measured_section import decode_section, measured_section, profile_section
from boost_jax.bench.page import render
from boost_jax.bench.paper_section import paper_sections, planner_section
from boost_jax.bench.profile import profile
from boost_jax.bench.quality_section import (
    factored_section,
    optimizer_costs_section,
    optimizers_section,
    quality_section,
)
from boost_jax.bench.step import Runner, compare_configs, measure_with_peak, time_runners
from boost_jax.bench.study_section import study_page_section
from boost_jax.config import ConfigError
from boost_jax.config.presets import PRESETS
from boost_jax.runtime.paths import check_writable_dir
from boost_jax.runtime.units import GIB

TRIO = paper.COLUMNS


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


# ----------------------------------------------------------------------------- page


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
    for saved in SAVED_SECTIONS:
        if saved.key in result:
            lines += saved.section(result[saved.key])
    if "serve" in result:
        lines += serve_section(result["serve"])
    if "finetune" in result:
        lines += finetune_section(result["finetune"])
    lines += render("plots", images=[f"![{name}]({img_dir}/{name})" for name in images])
    return "\n".join(lines) + "\n"


def head(result: dict) -> list[str]:
    """The title, the notes on sections measured again later (which, when, why), the machine and the commands."""
    mc = result["machine"]
    notes = [f"- {note}" for note in result.get("notes", ())]
    memory = f"{mc['memory_bytes'] / GIB:.0f} GiB memory" if mc["memory_bytes"] else "memory unknown"
    return [*render("head", date=mc["date"], commit=mc["commit"]), *notes, *([""] if notes else []),
            *render("machine", **mc, memory=memory, commands=result["commands"])]


def serve_section(sv: dict) -> list[str]:
    """Markdown: `bench serve`: concurrent clients beside one at a time and api.generate's padded batch."""
    ratio = lambda x: f"{x:.2f}"
    return render("serve", command=sv["command"], model=sv["model"], arch=sv["arch"], cache=sv["cache"],
                  context=sv["context"], requests=sv["requests"], reps=sv["reps"], slots=sv["serve"]["slots"],
                  page_tokens=sv["serve"]["page_tokens"], decode_steps=sv["serve"]["decode_steps"],
                  programs=sv["programs"], prompts="-".join(map(str, sv["prompt_tokens"])),
                  new="-".join(map(str, sv["new_tokens"])), useful=f"{sv['useful_tokens']:,}",
                  over_one=ratio(sv["concurrent_over_one_at_a_time"]), over_batch=ratio(sv["concurrent_over_padded_batch"]),
                  checks="Every completion's text was the same all three ways, nothing compiled while serving, every "
                         "cache page came back." if sv["ok"] else f"A check FAILED: {sv['checks']}.",
                  table=serve.table(sv))


def startup_section(st: dict) -> list[str]:
    """Markdown: `bench startup`: each command's seconds to its first result, cold and warm."""
    return render("startup", command=st["command"], steps=st["steps"], table=startup.table(st))


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
    p.add_argument("--serve-json", help="a saved `bench serve --json` (the server under many clients) for section 11")
    p.add_argument("--finetune-json", help="a saved `bench finetune --json` (its pre-training and fine-tunes) for section 12")
    for saved_input in (s for saved in SAVED_SECTIONS for s in saved.inputs):  # with --rerender too: added to the saved results
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
    parts = read_saved_sections(a)
    added = any(parts.values()) or any(flag in saved for _, flag, _ in KEPT)  # with --rerender: saved runs to add
    result = saved["--rerender"] if a.rerender else measure_all(a, argv, log, saved)
    result = with_saved_sections(with_kept(result, saved), parts)
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


@dataclass(frozen=True)
class SavedSection:
    """A section drawn only from saved bench outputs: its key in results.json, its flags, its Markdown
    and the commands it states."""

    key: str
    inputs: tuple  # latent_section.SavedInput
    section: Callable[[dict], list[str]]
    commands: Callable[[dict], list[str]]
    check: dict  # part -> check(files, paths) of the parts read from several files


SAVED_SECTIONS = (
    SavedSection("latent_heads", latent_section.INPUTS, latent_section.latent_heads_section,
                 latent_section.latent_heads_commands, {"comm": latent_section.check_comm}),  # section 9
    SavedSection("absorbed", absorbed_section.INPUTS, absorbed_section.absorbed_section,
                 absorbed_section.absorbed_commands, {"gpu": absorbed_section.check_gpu}),  # section 10
)


def read_saved_sections(a: argparse.Namespace) -> dict[str, dict]:
    """The saved inputs of each SAVED_SECTIONS section given on the command line, by part, each file
    checked by `read_saved`."""
    out = {}
    for saved in SAVED_SECTIONS:
        parts = out[saved.key] = {}
        for s in saved.inputs:
            if paths := given(a, s.flag):
                parts[s.part] = [read_saved(p, s.flag, s.keys) for p in paths] if s.several else read_saved(paths, s.flag, s.keys)
                if s.part in saved.check:
                    saved.check[s.part](parts[s.part], paths)
    return out


def with_saved_sections(result: dict, parts: dict[str, dict]) -> dict:
    """`result` with the saved sections' inputs (replacing the parts it held) and their commands in its
    list: a replaced part's commands leave it."""
    for saved in SAVED_SECTIONS:
        if given := parts.get(saved.key):
            merged = {**result.get(saved.key, {}), **given}
            new = saved.commands(merged)
            old = set(saved.commands(result[saved.key])) - set(new) if saved.key in result else set()
            kept = [c for c in result["commands"] if c not in old]
            result = {**result, "commands": [*kept, *(c for c in new if c not in kept)], saved.key: merged}
    return result


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
        ("startup", "--startup-json", ("rows", "command")), ("study", "--study-json", study_section.KEYS),
        ("serve", "--serve-json", ("runs", "command", "median_tokens_per_s")),
        ("finetune", "--finetune-json", ("paths", "throughput", "fill", "command")))


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
