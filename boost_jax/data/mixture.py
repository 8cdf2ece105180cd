"""A mixture of prepared datasets (`data.source=mixture`): each global batch's rows drawn from them in
proportion to their weights by a stateless rule, so the batch of step k is a pure function of the
seed, k and the weights' history, and resuming is exact.

Row n = 0, 1, ... of the mixed stream: with integer proportions p_i (the weights, to 1e-6) summing
to R, the first n rows hold c_0(n) = n - floor(n (R - p_0) / R) rows of dataset 0, and the other
n - c_0(n) rows are apportioned the same way among datasets 1, 2, ... Each c_i(n) is within one row
of n p_i / R and grows by 0 or 1 from n to n + 1, so row n is from the one dataset whose count grows
there, and it is row c_i(n) of that dataset's own stream: its windows in a seeded per-epoch
permutation, as a single dataset's (data/loader.py). A process takes its contiguous rows of each
global batch.

The weights may change when a run resumes (`data.mixture` is not frozen): the run's checkpoints
record each stretch of steps with its weights (`Stretch`), and every dataset's stream continues
where the earlier stretches left it, so no sequence is skipped or drawn twice by the change.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import grain
import numpy as np

from boost_jax.data.loader import Batch, Split, to_batch
from boost_jax.runtime.errors import ConfigError

PRECISION = 10**6  # weights are apportioned as integers of this resolution


def proportions(weights: Sequence[float]) -> list[int]:
    """Integer proportions of the weights (a positive weight never rounds to 0)."""
    total = sum(weights)
    return [max(1, round(w / total * PRECISION)) if w > 0 else 0 for w in weights]


def counts(n: int, props: Sequence[int]) -> list[int]:
    """Rows of each dataset among the first n rows of the mixed stream (module docstring)."""
    out, remaining = [], sum(props)
    for p in props:
        rest = n * (remaining - p) // remaining if remaining else 0
        out.append(n - rest)
        n, remaining = rest, remaining - p
    return out


def dataset_seed(seed: int, name: str) -> int:
    """Each dataset's own permutation seed: datasets of one run never share an order."""
    return int.from_bytes(hashlib.sha256(f"boost_jax:{seed}:{name}".encode()).digest()[:4], "big")


@dataclass(frozen=True)
class Stretch:
    """Steps from `start` on, drawn with `weights` (dataset name -> weight)."""

    start: int
    weights: dict[str, float]


class Mixture:
    """The mixed training stream of named Splits, drawn by `history` (the newest stretch's weights
    from its start step on). `batch` and `batches` are a Split's."""

    def __init__(self, splits: dict[str, Split], weights: dict[str, float], batch_size: int):
        self.splits, self.batch_size = splits, batch_size
        self.streams = {name: s.stream() for name, s in splits.items()}
        self.history = [Stretch(0, dict(weights))]
        self.num_windows = sum(s.num_windows for s in splits.values())
        for name, s in splits.items():
            if weights[name] > 0 and batch_size > s.num_windows:
                raise ConfigError(f"mixture dataset {name!r} has {s.num_windows} windows, fewer than "
                                  f"train.batch_size={batch_size}; add data or shrink the batch or seq_len")

    def resume(self, recorded: list[dict] | None, step: int) -> str | None:
        """Continue a run's recorded history at `step` (None: a run that started here or had no
        mixture); a new stretch begins at `step` if the weights changed. Returns a note when they did."""
        current = self.history[-1].weights
        # Stretches of datasets since dropped from data.mixture stay: they say where the others stopped.
        past = [Stretch(**s) for s in recorded or [] if s["start"] < step] or [Stretch(0, current)]
        if past[-1].weights == current:
            self.history = past
            return None
        self.history = [*past, Stretch(step, current)]
        return (f"data.mixture weights change at step {step}: {past[-1].weights} -> {current} "
                "(recorded in the checkpoints; each dataset continues where it stopped)")

    def record(self) -> list[dict]:
        """The history as a checkpoint records it."""
        return [asdict(s) for s in self.history]

    def rows(self, step: int) -> list[tuple[str, int]]:
        """(dataset, position in its stream) of each row of global batch `step`."""
        b = self.batch_size
        start, stretch = self._offsets(step)
        names = list(stretch.weights)
        props = proportions([stretch.weights[n] for n in names])
        n = (step - stretch.start) * b
        before = counts(n, props)
        out = []
        for row in range(n, n + b):
            after = counts(row + 1, props)
            i = next(i for i, (x, y) in enumerate(zip(before, after)) if y > x)
            out.append((names[i], start.get(names[i], 0) + before[i]))
            before = after
        return out

    def _offsets(self, step: int) -> tuple[dict[str, int], Stretch]:
        """Rows each dataset gave before the stretch holding `step`, and that stretch."""
        done: dict[str, int] = {}
        for stretch, nxt in zip(self.history, [*self.history[1:], None]):
            if nxt is None or step < nxt.start:
                return done, stretch
            names = list(stretch.weights)
            given = counts((nxt.start - stretch.start) * self.batch_size, proportions([stretch.weights[n] for n in names]))
            for name, c in zip(names, given):
                done[name] = done.get(name, 0) + c
        raise AssertionError("unreachable: the last stretch holds every later step")

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch `step`: rows [p * B/P, (p + 1) * B/P)."""
        if batch_size != self.batch_size:
            raise ValueError(f"this mixture draws batches of {self.batch_size} rows, not {batch_size}")
        if batch_size % process_count:
            raise ConfigError(f"train.batch_size={batch_size} must be divisible by the number of processes "
                              f"({process_count})")
        per = batch_size // process_count
        mine = self.rows(step)[process_index * per:(process_index + 1) * per]
        eos = next(iter(self.splits.values())).eos_id
        return to_batch(np.stack([self.streams[name][pos] for name, pos in mine]), eos)

    def batches(self, start: int, batch_size: int, process_index: int = 0, process_count: int = 1,
                prefetch: int = 2) -> Iterator[Batch]:
        """`batch(start)`, `batch(start + 1)`, ..., read `prefetch` batches ahead on a background thread."""
        steps = _Steps(lambda k: self.batch(start + k, batch_size, process_index, process_count))
        ds = grain.MapDataset.source(steps)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))


class _Steps:
    """A random-access source whose element k is a function of k (as many as an index holds)."""

    def __init__(self, fn):
        self.fn = fn

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, k: int):
        return self.fn(k)
