"""`bench report --study-json FILE`: a saved `python -m boost_jax.study --json` on the results page
(section 6): the sizes studied, the table of cells (every grid point's loss, best rate, seeds, mean,
spread, early), the fits and the compute multipliers with their intervals (the study's own tables,
comparison/report.py), and loss against training FLOPs per (arch, optimizer) with each fitted curve."""

from __future__ import annotations

import numpy as np

from boost_jax.bench.page import phrase, render
from boost_jax.comparison import report
from boost_jax.config import ConfigError, from_dict
from boost_jax.config.archs import ARCHS
from boost_jax.config.presets import PRESETS
from boost_jax.model.counts import count, embedding_params

KEYS = ("cells", "fits", "multipliers", "command")  # what a saved study must hold
IMAGE = "study.png"
# CoLA's sizes, where the section's scope says the spec goes next
GPU_SIZES = ("llama-60m", "llama-130m", "llama-350m", "llama-1b")


def slots(r: dict) -> dict:
    """The slots of results_page.md's `study` part: what was run, the sizes, the study's own tables and
    the numbers its statement of scope quotes (parameters, vocabulary, embedding share, compute span)."""
    cells = r["cells"]
    shapes = cell_shapes(cells)
    # the scope's figures: each size's full-rank model
    dense = [shape(p, "dense") for p in dict.fromkeys(c["preset"] for c in cells)]
    shares = [s["embedding"] / s["params"] for s in dense]
    smallest, largest = (f(s["params"] for s in dense) for f in (min, max))
    at_gpu_sizes = {p: shape(p, "dense") for p in GPU_SIZES}
    reference = at_gpu_sizes[GPU_SIZES[0]]
    flops = [c["train_flops"] for c in cells]
    return dict(command=r["command"], cells=len(cells), seeds=max(len(c["seeds"]) for c in cells),
                eval_tokens=f"{r['eval_tokens']:,}", pct=round(100 * r["interval"]),
                early_below=f"{r['early_below']:g}",
                image=IMAGE, sizes=size_table(shapes), tables=report.table(r),
                smallest=f"{smallest / 1e6:.2f}M", largest=f"{largest / 1e6:.2f}M",
                under=f"{GPU_SIZES[0]} ({reference['params'] / 1e6:.1f}M) is {reference['params'] / largest:.0f}-"
                      f"{reference['params'] / smallest:.0f}x",
                vocab="/".join(sorted({f"{s['vocab']:,}" for s in dense})),
                share=f"{100 * min(shares):.0f}-{100 * max(shares):.0f}%", span=f"{max(flops) / min(flops):.0f}x",
                gpu_shares=", ".join(f"{p} {100 * s['embedding'] / s['params']:.0f}%" for p, s in at_gpu_sizes.items()))


def check(r: dict, path: str) -> None:
    """One ConfigError naming the file where a value the page reads is missing or of another kind, or
    a cell was not run at its preset's shape (the page's size table states the presets' shapes);
    checked when the file is read, before anything is measured."""
    if problem := report.saved_problem(r):
        raise ConfigError(f"--study-json {path}: {problem}: not a saved `python -m boost_jax.study --json` the page "
                          "can draw")
    for key, known in (("preset", PRESETS), ("arch", ARCHS)):
        if bad := next((c[key] for c in r["cells"] if c[key] not in known), None):
            raise ConfigError(f"--study-json {path}: a cell's {key} {bad!r} is not one of this version's {sorted(known)}")
    shapes = cell_shapes(r["cells"])
    for c in r["cells"]:
        if c["params_non_embedding"] != (want := shapes[c["preset"], c["arch"]]["non_embedding"]):
            raise ConfigError(f"--study-json {path}: cell {c['preset']}/{c['arch']} holds {c['params_non_embedding']:,} "
                              f"non-embedding parameters, not its preset's {want:,}: the study ran at other shapes than "
                              "its presets', which section 6 states")


def cell_shapes(cells: list[dict]) -> dict[tuple[str, str], dict]:
    """(preset, arch) -> its shape, once per pair the cells hold."""
    return {key: shape(*key) for key in dict.fromkeys((c["preset"], c["arch"]) for c in cells)}


def shape(preset: str, arch: str) -> dict:
    """A preset's shape under an arch and its parameters, those of the embedding and LM head apart
    (model/counts.py)."""
    m = from_dict({"model": {"preset": preset, "arch": arch}}).model
    params = count(m, 1).params
    embedding = embedding_params(m)
    return {"d": m.d_model, "layers": m.n_layers, "vocab": m.vocab_size, "params": params, "embedding": embedding,
            "non_embedding": params - embedding, "rank": m.attn_rank}


def size_table(shapes: dict[tuple[str, str], dict]) -> list[str]:
    """Markdown: per preset its shape, then each arch's parameters (non-embedding, and the embedding
    and head's share)."""
    presets, archs = (list(dict.fromkeys(k[i] for k in shapes)) for i in (0, 1))
    columns = [f"{a} params (non-embedding; embedding + head)" for a in archs]
    lines = ["| preset | d | layers | vocab | factor rank | " + " | ".join(columns) + " |",
             "|---|---|---|---|---|" + "---|" * len(archs)]
    for p in presets:
        first = next(s for (q, _), s in shapes.items() if q == p)
        cols = [f"{s['params']:,} ({s['non_embedding']:,}; {100 * s['embedding'] / s['params']:.0f}%)"
                if (s := shapes.get((p, a))) else "-" for a in archs]
        lines.append(f"| {p} | {first['d']} | {first['layers']} | {first['vocab']:,} | {first['rank']} | "
                     + " | ".join(cols) + " |")
    return lines


def plot(r: dict):
    """The figure of IMAGE: each curve's cells (seeds as dots, means as markers, early ones hollow)
    and its fitted law over the compute it was fitted on."""
    import matplotlib  # optional: matplotlib (the dev and notebooks extras)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fits = {f["curve"]: f for f in r["fits"]}
    for key in dict.fromkeys(f"{c['arch']}/{c['optimizer']}" for c in r["cells"]):
        cells = [c for c in r["cells"] if f"{c['arch']}/{c['optimizer']}" == key and c["mean"] is not None]
        if not cells:
            continue
        kept = [c for c in cells if not c["early"]]
        line, = ax.plot([c["train_flops"] for c in kept], [c["mean"] for c in kept], "o", label=key)
        color = line.get_color()
        ax.plot([c["train_flops"] for c in cells if c["early"]], [c["mean"] for c in cells if c["early"]], "o",
                mfc="none", color=color)
        for c in cells:
            seeds = [x for x in c["seeds"] if x is not None]
            ax.plot([c["train_flops"]] * len(seeds), seeds, ".", ms=3, color=color, alpha=0.5)
        f = fits.get(key)
        if f is not None and f.get("form") and kept:
            flops = np.geomspace(min(c["train_flops"] for c in kept), max(c["train_flops"] for c in kept), 100)
            ax.plot(flops, f["E"] + f["A"] * flops ** -f["alpha"], "-", color=color, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title("study: loss against compute, fitted per arch/optimizer (hollow: early)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def study_page_section(r: dict) -> list[str]:
    """Markdown: section 6, a saved `python -m boost_jax.study --json` (bench/py)."""
    pct = round(100 * r["interval"])
    readings = [multiplier_reading(m, pct) for m in r["multipliers"]
                if m["value"] is not None and m["interval"] is not None]
    return render("study", **slots(r),
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
