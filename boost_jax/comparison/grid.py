"""The learning-rate search of one cell: the starting log grid, extended past whichever edge holds the
best rate by the grid's own ratio at that edge, until the best has a strictly worse neighbour on both
sides or the cap on extensions is spent (then the report says the best is on an edge)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Search:
    lrs: tuple[float, ...]  # every rate tried, ascending
    losses: tuple[float, ...]  # its seed-0 loss (inf: diverged)
    best: float
    extensions: int  # rates added to the starting grid
    bracketed: bool  # the best has a strictly worse neighbour on both sides


def search(start: Sequence[float], loss_of: Callable[[float], float], max_extensions: int) -> Search:
    """Run `loss_of` on each rate of `start`, then on added rates (see the module's docstring)."""
    losses = {lr: _finite(loss_of(lr)) for lr in sorted(start)}
    extensions = 0
    while True:
        lrs = sorted(losses)
        best = min(lrs, key=lambda lr: (losses[lr], lr))  # a tie goes to the lower rate
        i = lrs.index(best)
        if 0 < i < len(lrs) - 1:
            bracketed = losses[lrs[i - 1]] > losses[best] < losses[lrs[i + 1]]
            break  # interior: an equal neighbour is reported, not chased (no extension moves it)
        if extensions == max_extensions:
            bracketed = False
            break
        new = lrs[0] ** 2 / lrs[1] if i == 0 else lrs[-1] ** 2 / lrs[-2]
        new = float(f"{new:.6g}")  # a short, stable run-dir name
        losses[new] = _finite(loss_of(new))
        extensions += 1
    return Search(tuple(lrs), tuple(losses[lr] for lr in lrs), best, extensions, bracketed)


def _finite(loss: float) -> float:
    """A diverged run (None or NaN) counts as the worst loss."""
    return math.inf if loss is None or not math.isfinite(loss) else loss


def read_json(path: Path) -> tuple[Any, str]:
    """A file the study wrote and reads back: (its JSON value, ""), or (None, why it cannot be read)."""
    try:
        return json.loads(path.read_text()), ""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{type(e).__name__}: {e}"


def finite_number(x) -> bool:
    """A number read back from a saved file that the study can compute with: finite, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
