"""Loss against training compute, per (arch, optimizer), and the compute multipliers between curves.

The form is the simplest the points support: L = E + A C^-alpha (saturating power law, 3 parameters)
from 4 distinct compute values on, L = A C^-alpha (2 parameters, a line in log-log) from 2, no fit
below. The saturating form is least squares in L: for each alpha of a log grid, then of a finer grid
around the best, (E, A) are the linear least-squares solution; it is kept when E >= 0 and A > 0, else
the power form stands. Intervals come from a bootstrap over seeds:
each cell's seeds resampled with replacement, the cell means refitted.

The compute multiplier of curve X against curve Y at loss L* is C_Y(L*) / C_X(L*): how many times the
compute Y needs to reach the loss X reaches (> 1: X is cheaper). L* is the higher of the two curves'
losses at their largest measured compute, a loss both reach inside their data; it is fixed at the
point fit, so every resample measures the same quantity.

Early in training (`early`): a curve's law is set by its cells of most compute, the fewest the
saturating form needs (SATURATING_POINTS); from there down, each next cell is tested against the
law fitted on the cells above it that passed: it is early when its mean loss lies above that law's
EARLY_QUANTILE bootstrap bound at its compute by more than EARLY_Z standard errors of its mean (the
seeds' standard deviation pooled over the curve's cells, / sqrt(n): one cell's 3 seeds alone often
show a tenth of the noise they have). The bound is wide on purpose: extrapolated from 4 points, the
study's 90% interval made 4 of 20 synthetic draws flag a cell on the law. The first early cell ends
the walk: it and every cell of less compute have not come down to the law the larger budgets
follow. Only the saturating form tests (a line in log-log through fewer points lies below a
saturating law off its ends, so every smaller cell would look early); a curve of fewer than
SATURATING_POINTS + 1 computes is untested, and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SATURATING, POWER = "L = E + A*C^-alpha", "L = A*C^-alpha"
SATURATING_POINTS = 4  # distinct computes the saturating form needs
EARLY_QUANTILE = 0.99  # the bootstrap bound of the curve above a cell that the cell's loss is tested against
EARLY_Z = 3.0  # standard errors of a cell's mean past that bound that make it early
ALPHAS = np.geomspace(1e-3, 3.0, 400)  # the saturating form's search over alpha, refined around its best


@dataclass(frozen=True)
class Curve:
    form: str
    E: float
    A: float
    alpha: float
    c_max: float  # the largest compute measured

    def loss(self, c: float) -> float:
        return self.E + self.A * c ** -self.alpha

    def compute(self, loss: float) -> float:
        """The compute at which the curve reaches `loss` (inf where it never does)."""
        if loss <= self.E or self.alpha <= 0:
            return math.inf
        return (self.A / (loss - self.E)) ** (1 / self.alpha)


def fit(compute: Sequence[float], loss: Sequence[float]) -> Curve | None:
    """The simplest form of the module's docstring through (compute, loss) points; None below 2 computes."""
    c, y = np.asarray(compute, float), np.asarray(loss, float)
    if len(set(c.tolist())) < 2 or not np.all(np.isfinite(y)) or np.any(y <= 0):
        return None
    if len(set(c.tolist())) >= SATURATING_POINTS:
        ref = float(np.exp(np.mean(np.log(c))))  # compute in units of its geometric mean: no overflow
        grid, best = ALPHAS, None
        for _ in range(2):  # the log grid, then a finer one between the best's neighbours
            e, a, sse = _linear(c / ref, y, grid)
            sse = np.where((e >= 0) & (a > 0), sse, np.inf)
            i = int(np.argmin(sse))
            if not np.isfinite(sse[i]):
                break
            best = (float(e[i]), float(a[i]), float(grid[i]))
            grid = np.linspace(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], 200)
        if best is not None:
            e, a, alpha = best
            return Curve(SATURATING, e, a * ref ** alpha, alpha, float(c.max()))
    slope, icept = np.polyfit(np.log(c), np.log(y), 1)
    return Curve(POWER, 0.0, math.exp(icept), -slope, float(c.max()))


def _linear(c: np.ndarray, y: np.ndarray, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each alpha: (E, A, squared error) of the least-squares y = E + A c^-alpha."""
    x = c[None, :] ** -alphas[:, None]  # [alphas, points]
    xm, ym = x.mean(1), y.mean()
    a = ((x - xm[:, None]) * (y - ym)).sum(1) / ((x - xm[:, None]) ** 2).sum(1)
    e = ym - a * xm
    return e, a, ((e[:, None] + a[:, None] * x - y) ** 2).sum(1)


@dataclass(frozen=True)
class Points:
    """One curve's cells: the compute of each and its seeds' losses."""

    compute: tuple[float, ...]
    seeds: tuple[tuple[float, ...], ...]

    def means(self) -> list[float]:
        return [float(np.mean(s)) for s in self.seeds]

    def resample(self, rng: np.random.Generator) -> list[float]:
        """Each cell's mean over its seeds drawn with replacement, their deviations from the cell's mean
        widened by sqrt(n / (n - 1)): drawn as they are, n seeds' spread comes out (n-1)/n too small."""
        out = []
        for s in self.seeds:
            mean, n = float(np.mean(s)), len(s)
            draw = np.asarray(s)[rng.integers(0, n, n)]
            out.append(mean + float(np.mean(draw - mean)) * (math.sqrt(n / (n - 1)) if n > 1 else 1.0))
        return out


def bootstrap_curves(points: Points, n: int, seed: int = 0) -> list[Curve | None]:
    rng = np.random.default_rng(seed)
    return [fit(points.compute, points.resample(rng)) for _ in range(n)]


def level(x: Curve, y: Curve) -> float:
    """L*: the higher of the two curves' losses at their largest measured compute."""
    return max(x.loss(x.c_max), y.loss(y.c_max))


def multiplier(x: Curve, y: Curve, at: float) -> float:
    """C_y(at) / C_x(at) (module docstring); nan where either curve never reaches `at`."""
    cx, cy = x.compute(at), y.compute(at)
    return cy / cx if math.isfinite(cx) and math.isfinite(cy) and cx > 0 else math.nan


def compare(x: Points, y: Points, n: int, coverage: float) -> dict | None:
    """The multiplier of x against y with its bootstrap interval (x's and y's seeds resampled
    independently); None when either has no fit."""
    fx, fy = fit(x.compute, x.means()), fit(y.compute, y.means())
    if fx is None or fy is None:
        return None
    at = level(fx, fy)
    boots = [multiplier(a, b, at) for a, b in zip(bootstrap_curves(x, n, 1), bootstrap_curves(y, n, 2))
             if a is not None and b is not None]
    boots = np.asarray([m for m in boots if math.isfinite(m)])
    tail = (1 - coverage) / 2
    interval = [float(np.quantile(boots, tail)), float(np.quantile(boots, 1 - tail))] if len(boots) else None
    value = multiplier(fx, fy, at)  # None where a point fit never reaches L* (JSON has no nan)
    return {"value": value if math.isfinite(value) else None, "interval": interval, "at_loss": at,
            "resamples": len(boots)}


@dataclass(frozen=True)
class Regime:
    """Which of a curve's cells are early (the module's docstring), and why."""

    reasons: tuple[str | None, ...]  # per cell, in the Points' order: None where in the regime
    tested: bool  # whether any cell had enough cells of more compute to be tested


def early(points: Points, n: int) -> Regime:
    """The cells of `points` that are early in training (the module's docstring)."""
    order = sorted(range(len(points.compute)), key=lambda i: -points.compute[i])  # most compute first
    reasons: list[str | None] = [None] * len(order)
    tested = False
    sd = pooled_sd(points.seeds)
    k = SATURATING_POINTS
    while k < len(order) and len({points.compute[j] for j in order[:k]}) < SATURATING_POINTS:
        k += 1  # equal computes: the law needs SATURATING_POINTS distinct ones
    for depth, i in enumerate(order[k:], start=k):
        above = Points(tuple(points.compute[j] for j in order[:depth]), tuple(points.seeds[j] for j in order[:depth]))
        curve = fit(above.compute, above.means())
        if curve is None or curve.form != SATURATING:
            break
        tested = True
        c, seeds = points.compute[i], np.asarray(points.seeds[i], float)
        boots = [b.loss(c) for b in bootstrap_curves(above, n) if b is not None]
        top = float(np.quantile(boots, EARLY_QUANTILE))
        se = sd / math.sqrt(len(seeds))
        if seeds.mean() - EARLY_Z * se > top:
            why = (f"mean {seeds.mean():.4f} above the fit of the {depth} cells of more compute (upper bound "
                   f"{top:.4f} at {c:.3g} FLOPs, + {EARLY_Z:g} standard errors of {se:.4f})")
            for j in order[depth:]:
                reasons[j] = why if j == i else f"less compute than an early cell ({why})"
            break
    return Regime(tuple(reasons), tested)


def pooled_sd(seeds: Sequence[Sequence[float]]) -> float:
    """The seeds' standard deviation pooled over cells (each cell's squared deviations from its own
    mean over their degrees of freedom); 0 where no cell has two seeds."""
    dof = sum(len(s) - 1 for s in seeds)
    return math.sqrt(sum(float(np.sum((np.asarray(s) - np.mean(s)) ** 2)) for s in seeds) / dof) if dof else 0.0


def describe(points: Points, n: int, coverage: float) -> dict | None:
    """A curve's point fit and the bootstrap interval of each parameter."""
    f = fit(points.compute, points.means())
    if f is None:
        return None
    boots = [b for b in bootstrap_curves(points, n) if b is not None and b.form == f.form]
    tail = (1 - coverage) / 2
    ci = lambda k: ([float(np.quantile([getattr(b, k) for b in boots], q)) for q in (tail, 1 - tail)]
                    if boots else None)
    return {"form": f.form, "E": f.E, "A": f.A, "alpha": f.alpha, "intervals": {k: ci(k) for k in ("E", "A", "alpha")},
            "points": len(points.compute)}
