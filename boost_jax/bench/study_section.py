"""`bench report --study-json FILE`: a saved `python -m boost_jax.study --json` on the results page:
loss against training FLOPs per (arch, optimizer) with each fitted curve, the table of cells (every
grid point's loss, best rate, seeds, mean, spread, early) and the compute multipliers with their
intervals (the study's own tables, comparison/report.py)."""

from __future__ import annotations

import numpy as np

from boost_jax.comparison import report

KEYS = ("cells", "fits", "multipliers", "command")  # what a saved study must hold
IMAGE = "study.png"


def section(r: dict) -> list[str]:
    """Markdown: what was run, then the study's tables."""
    pct = round(100 * r["interval"])
    cells = r["cells"]
    return ["## 6c. A fair comparison: tuned rates, seeds, loss against compute", "",
            f"`{r['command']}`: {len(cells)} cells (arch x optimizer x size x budget), each cell's learning rate "
            "searched on a log grid extended until the best has a worse neighbour on both sides, then run with "
            f"{max(len(c['seeds']) for c in cells)} seeds; each run evaluated on {r['eval_tokens']:,} held-out tokens. "
            "Loss against training FLOPs is fitted per arch and optimizer (the form each curve's points support), and "
            "the compute multiplier is how many times the compute the second curve needs to reach the loss the first "
            f"reaches, with {pct}% bootstrap intervals over seeds. A cell is early when it lies under "
            f"study.early_below={r['early_below']:g} tokens per non-embedding parameter or above the law of the cells of "
            f"more compute (docs/design.md section 14); early cells are left out of the fits ({IMAGE}: hollow).", "",
            *report.table(r), ""]


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
