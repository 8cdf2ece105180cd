"""A study's numbers as one object (`--json`) and as markdown tables: every cell with its grid, seeds,
mean and spread; the fits of loss against training FLOPs; the compute multipliers."""

from __future__ import annotations

import math

import numpy as np

from boost_jax.comparison import fit
from boost_jax.comparison.grid import Search
from boost_jax.comparison.spec import Cell, Spec


def cell_row(cell: Cell, s: Search, seeds: list[dict], early_below: float) -> dict:
    """One cell: its grid (loss None where a run diverged), best rate, each seed's final loss, bits per
    byte and factor spectra, the losses' mean and spread (sample standard deviation; 0 for one seed)."""
    losses = [r["loss"] for r in seeds]
    ok = [x for x in losses if x is not None]
    bpb = [r["bits_per_byte"] for r in seeds if r["bits_per_byte"] is not None]
    return {"arch": cell.arch, "optimizer": cell.optimizer, "preset": cell.preset, "budget": cell.budget,
            "tokens": cell.tokens, "steps": cell.steps, "params_non_embedding": cell.params_non_embedding,
            "tokens_per_param": cell.tokens_per_param, "train_flops": cell.train_flops,
            "lr_grid": list(s.lrs), "lr_losses": [x if math.isfinite(x) else None for x in s.losses],
            "best_lr": s.best, "extensions": s.extensions, "bracketed": s.bracketed,
            "seeds": losses, "bits_per_byte": [r["bits_per_byte"] for r in seeds],
            "spectra": [r.get("spectra", {}) for r in seeds],  # each seed's final factor health (log.health)
            "mean": float(np.mean(ok)) if ok else None, "spread": float(np.std(ok, ddof=1)) if len(ok) > 1 else 0.0,
            "bpb_mean": float(np.mean(bpb)) if bpb else None, "diverged_seeds": len(losses) - len(ok),
            "early": cell.tokens_per_param < early_below}


def curves(rows: list[dict]) -> dict[str, fit.Points]:
    """`arch/optimizer` -> its non-early cells with at least one finished seed."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if not r["early"] and r["mean"] is not None:
            out.setdefault(f"{r['arch']}/{r['optimizer']}", []).append(r)
    return {k: fit.Points(tuple(r["train_flops"] for r in v), tuple(tuple(x for x in r["seeds"] if x is not None)
                                                                    for r in v)) for k, v in out.items()}


def analyse(rows: list[dict], n: int, coverage: float) -> tuple[list[dict], list[dict]]:
    """(fits, multipliers): each curve's fit, then each low-rank arch against dense (same optimizer)
    and each optimizer against adamw (same arch)."""
    points = curves(rows)
    fits = [{"curve": k, **d} for k, p in points.items() if (d := fit.describe(p, n, coverage)) is not None]
    fits += [{"curve": k, "form": None, "points": len(p.compute),
              "note": "fewer than 2 budgets past study.early_below: no fit"} for k, p in points.items()
             if fit.fit(p.compute, p.means()) is None]
    pairs = []
    for key in points:
        arch, opt = key.split("/")
        if arch != "dense" and f"dense/{opt}" in points:
            pairs.append((key, f"dense/{opt}"))
        if opt != "adamw" and f"{arch}/adamw" in points:
            pairs.append((key, f"{arch}/adamw"))
    mults = [{"of": x, "against": y, **m} for x, y in pairs if (m := fit.compare(points[x], points[y], n, coverage))]
    return fits, mults


def report(spec: Spec, rows: list[dict], command: str) -> dict:
    s = spec.study
    fits, mults = analyse(rows, s.bootstrap, s.interval)
    return {"cells": rows, "fits": fits, "multipliers": mults, "skipped": list(spec.skipped),
            "eval_tokens": s.eval_tokens, "interval": s.interval, "early_below": s.early_below, "command": command}


def table(r: dict) -> list[str]:
    """Markdown: the cells, the fits and the multipliers."""
    f = lambda x, fmt=".4f": "-" if x is None else format(x, fmt)
    lines = [("| preset | arch | optimizer | tokens | tok/param | lr grid (seed-0 loss) | best lr | seeds | mean | spread "
              "| bpb | early |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["cells"]:
        grid = ", ".join(f"{lr:g}: {f(x)}" for lr, x in zip(c["lr_grid"], c["lr_losses"]))
        edge = "" if c["bracketed"] else f" (not bracketed after {c['extensions']} extensions)"
        lines.append(f"| {c['preset']} | {c['arch']} | {c['optimizer']} | {c['tokens']:,} | {c['tokens_per_param']:.1f} "
                     f"| {grid} | {c['best_lr']:g}{edge} | {' / '.join(f(x) for x in c['seeds'])} | {f(c['mean'])} "
                     f"| {f(c['spread'])} | {f(c['bpb_mean'])} | {'early' if c['early'] else ''} |")
    lines += ["", "| curve | form | E | A | alpha | points |", "|---|---|---|---|---|---|"]
    for c in r["fits"]:
        lines.append(f"| {c['curve']} | {c['form'] or c['note']} | {f(c.get('E'))} | {f(c.get('A'), '.4g')} | "
                     f"{f(c.get('alpha'))} | {c['points']} |")
    pct = round(100 * r["interval"])
    lines += ["", f"| compute multiplier of | against | value | {pct}% interval | at loss |", "|---|---|---|---|---|"]
    for m in r["multipliers"]:
        ci = "-" if m["interval"] is None else f"[{m['interval'][0]:.3g}, {m['interval'][1]:.3g}]"
        lines.append(f"| {m['of']} | {m['against']} | {f(m['value'], '.3g')} | {ci} | {m['at_loss']:.4f} |")
    lines += [f"skipped: {s}" for s in r["skipped"]]
    return lines
