"""A study's numbers as one object (`--json`) and as markdown tables: every cell with its grid, seeds,
mean and spread; the fits of loss against training FLOPs; the compute multipliers."""

from __future__ import annotations

import math

import numpy as np

from boost_jax.comparison import fit
from boost_jax.comparison.grid import Search, finite_number
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
            **floor(cell.tokens_per_param, early_below)}


def floor(tokens_per_param: float, early_below: float) -> dict:
    """The user's floor on training: a cell under study.early_below tokens per parameter is early."""
    below = tokens_per_param < early_below
    return {"early": below, "early_reason": f"{tokens_per_param:.1f} tokens per non-embedding parameter < "
                                            f"study.early_below={early_below:g}" if below else None}


def flag_early(rows: list[dict], n: int) -> tuple[list[dict], dict[str, bool]]:
    """The rows with every cell the data shows early flagged (fit.early, per arch/optimizer curve, on
    the cells past the floor), and per curve whether its regime could be tested."""
    rows = [dict(r) for r in rows]
    tested = {}
    for key, (points, members) in _curves(rows).items():
        regime = fit.early(points, n)
        tested[key] = regime.tested
        for i, reason in zip(members, regime.reasons):
            if reason is not None:
                rows[i].update(early=True, early_reason=reason)
    return rows, tested


def curves(rows: list[dict]) -> dict[str, fit.Points]:
    """`arch/optimizer` -> its non-early cells with at least one finished seed."""
    return {k: points for k, (points, _) in _curves(rows).items()}


def _curves(rows: list[dict]) -> dict[str, tuple[fit.Points, list[int]]]:
    """`arch/optimizer` -> (its non-early cells with a finished seed, their indices in `rows`)."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if not r["early"] and r["mean"] is not None:
            out.setdefault(f"{r['arch']}/{r['optimizer']}", []).append(i)
    return {k: (fit.Points(tuple(rows[i]["train_flops"] for i in v),
                           tuple(tuple(x for x in rows[i]["seeds"] if x is not None) for i in v)), v)
            for k, v in out.items()}


def analyse(rows: list[dict], n: int, coverage: float) -> tuple[list[dict], list[dict]]:
    """(fits, multipliers) of rows already flagged (flag_early): each curve's fit, then each low-rank
    arch against dense (same optimizer) and each optimizer against adamw (same arch)."""
    points = curves(rows)
    fits = [{"curve": k, **d} for k, p in points.items() if (d := fit.describe(p, n, coverage)) is not None]
    fits += [{"curve": k, "form": None, "points": len(p.compute),
              "note": "fewer than 2 computes in the regime: no fit"} for k, p in points.items()
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
    rows, tested = flag_early(rows, s.bootstrap)
    fits, mults = analyse(rows, s.bootstrap, s.interval)
    fits = [{**f, "regime_tested": tested[f["curve"]]} for f in fits]
    return {"cells": rows, "fits": fits, "multipliers": mults, "skipped": list(spec.skipped),
            "eval_tokens": s.eval_tokens, "interval": s.interval, "early_below": s.early_below, "command": command}


_number = finite_number
_count = lambda x: isinstance(x, int) and not isinstance(x, bool)
_maybe = lambda ok: lambda x: x is None or ok(x)
_numbers = lambda ok: lambda x: isinstance(x, list) and all(map(ok, x))
_text = lambda x: isinstance(x, str)
_flag = lambda x: isinstance(x, bool)
# What `table` and the results page read of a saved report (`--json`): key -> the test its value passes.
SAVED = {"eval_tokens": _count, "interval": lambda x: _number(x) and 0 < x < 1, "early_below": _number,
         "command": _text, "skipped": _numbers(_text)}
SAVED_CELL = {"preset": _text, "arch": _text, "optimizer": _text, "tokens": _count, "tokens_per_param": _number,
              "train_flops": lambda x: _number(x) and x > 0, "params_non_embedding": _count,
              "lr_grid": _numbers(_number), "lr_losses": _numbers(_maybe(_number)), "best_lr": _number,
              "extensions": _count, "bracketed": _flag, "seeds": lambda x: bool(x) and _numbers(_maybe(_number))(x),
              "mean": _maybe(_number), "spread": _maybe(_number), "bpb_mean": _maybe(_number), "early": _flag,
              "early_reason": _maybe(_text),
              "tasks": _maybe(lambda x: isinstance(x, dict) and all(  # task -> metric -> a value per seed
                  isinstance(m, dict) and all(map(_numbers(_maybe(_number)), m.values())) for m in x.values()))}
SAVED_FIT = {"curve": _text, "form": _maybe(_text), "points": _count, "regime_tested": _flag,
             **dict.fromkeys(("E", "A", "alpha"), _maybe(_number))}
SAVED_MULTIPLIER = {"of": _text, "against": _text, "value": _number, "at_loss": _number,
                    "interval": _maybe(lambda x: isinstance(x, list) and len(x) == 2 and all(map(_number, x)))}


def saved_problem(r) -> str | None:
    """What is wrong with a saved report `r` for `table` and the page (the first key whose value is
    missing or of another kind, as `cells[2].mean: 'abc'`), or None when nothing is."""
    if not isinstance(r, dict):
        return "not a JSON object"
    for key, ok in SAVED.items():
        if not ok(r.get(key)):
            return f"{key}: {r.get(key)!r}"
    for key, schema, fits_one in (("cells", SAVED_CELL, True), ("fits", SAVED_FIT, False),
                                  ("multipliers", SAVED_MULTIPLIER, False)):
        rows = r.get(key)
        if not isinstance(rows, list) or (fits_one and not rows):
            return f"{key}: {rows!r}" + (" (a study has at least one cell)" if fits_one else "")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                return f"{key}[{i}]: {row!r}"
            if bad := next((k for k, ok in schema.items() if not ok(row.get(k))), None):
                return f"{key}[{i}].{bad}: {row.get(bad)!r}"
    return None


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
    early = [f"- early: {c['preset']}/{c['arch']}-{c['optimizer']}: {c['early_reason']}"
             for c in r["cells"] if c["early"]]
    lines += ["", *early] if early else []  # a line under a table without a blank one would be read as its row
    scored = [(c, t, m, v) for c in r["cells"] for t, ms in c.get("tasks", {}).items() for m, v in ms.items()]
    if scored:
        lines += ["", "| preset | arch | optimizer | task | metric | seeds | mean |", "|---|---|---|---|---|---|---|"]
        for c, t, m, v in scored:
            done = [x for x in v if x is not None]
            lines.append(f"| {c['preset']} | {c['arch']} | {c['optimizer']} | {t} | {m} | {' / '.join(f(x) for x in v)} "
                         f"| {f(float(np.mean(done)) if done else None)} |")
    lines += ["", "| curve | form | E | A | alpha | points | regime |", "|---|---|---|---|---|---|---|"]
    for c in r["fits"]:
        regime = "tested" if c["regime_tested"] else f"untested (< {fit.SATURATING_POINTS + 1} computes)"
        lines.append(f"| {c['curve']} | {c['form'] or c['note']} | {f(c.get('E'))} | {f(c.get('A'), '.4g')} | "
                     f"{f(c.get('alpha'))} | {c['points']} | {regime} |")
    pct = round(100 * r["interval"])
    lines += ["", f"| compute multiplier of | against | value | {pct}% interval | at loss |", "|---|---|---|---|---|"]
    for m in r["multipliers"]:
        ci = "-" if m["interval"] is None else f"[{m['interval'][0]:.3g}, {m['interval'][1]:.3g}]"
        lines.append(f"| {m['of']} | {m['against']} | {f(m['value'], '.3g')} | {ci} | {m['at_loss']:.4f} |")
    lines += ["", *(f"- skipped: {s}" for s in r["skipped"])] if r["skipped"] else []
    return lines
