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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SATURATING, POWER = "L = E + A*C^-alpha", "L = A*C^-alpha"
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
    if len(set(c.tolist())) >= 4:
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
