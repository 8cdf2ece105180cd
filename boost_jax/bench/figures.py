"""The results page's plots: each figure a function of a results.json (None where it lacks the data),
drawn with matplotlib's Agg backend into the page's img/ folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from boost_jax.bench import paper, study_section
from boost_jax.bench.paper import COLUMNS as TRIO
from boost_jax.runtime.units import GIB

LABELS = {"dense/megatron": "full rank (Megatron TP)", "cola/vanilla": "vanilla low-rank TP", "cola/btp": "BOOST (BTP)"}


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
