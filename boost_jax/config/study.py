"""`study.*`: the axes of a fair comparison (`python -m boost_jax.study`, boost_jax/study/).

Read by the study command only; a train run carries the section at its defaults. Validated with the
rest of the config, so an unknown arch, optimizer or preset in an axis is named before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from boost_jax.config.archs import ARCHS
from boost_jax.config.presets import PRESETS
from boost_jax.runtime.errors import ConfigError


@dataclass(frozen=True)
class StudyConfig:
    """`study.*`: every (arch, optimizer, preset, budget) cell, its learning-rate search and seeds."""

    archs: tuple[str, ...] = ("dense", "cola")
    optimizers: tuple[str, ...] = ("adamw", "muon")
    presets: tuple[str, ...] = ("llama-mini",)
    # Training budgets, in `tokens_unit`: tokens per non-embedding parameter (per_param) or tokens
    tokens: tuple[float, ...] = (20.0,)
    tokens_unit: Literal["per_param", "absolute"] = "per_param"
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)  # the starting log grid, extended until the best is interior
    max_extensions: int = 4  # grid points added per cell at most; a cell whose best stays on an edge says so
    seeds: int = 3  # the best rate's runs (seed 0 is the grid's)
    eval_tokens: int = 200_000  # held-out tokens of every final eval (refused before training if the split holds fewer)
    # Cells below this many tokens per non-embedding parameter are "early in training": left out of the fits
    # (cells above the law of the cells of more compute are too: comparison/fit.early)
    early_below: float = 10.0
    bootstrap: int = 1000  # resamples of the seeds behind each interval
    interval: float = 0.9  # the intervals' coverage
    # lm-eval tasks scored on each seed of each cell's best rate, from study.tasks_path's YAML files or lm-eval's
    tasks: tuple[str, ...] = ()
    tasks_path: str | None = None
    tasks_limit: int = 0  # documents per task (0: all)
    dir: str = "runs/study"


def validate_study(s: StudyConfig, optimizers: tuple[str, ...]) -> None:
    """Each axis non-empty and of known names, budgets and counts positive, a grid of >= 2 rates."""
    for key, values, known in (("archs", s.archs, tuple(ARCHS)), ("optimizers", s.optimizers, optimizers),
                               ("presets", s.presets, tuple(PRESETS))):
        if not values:
            raise ConfigError(f"study.{key}: empty axis; name at least one of {list(known)}")
        if bad := [v for v in values if v not in known]:
            raise ConfigError(f"study.{key}: unknown {key[:-1]} {bad[0]!r}; choose from {list(known)}")
        if len(set(values)) != len(values):
            raise ConfigError(f"study.{key}: {list(values)} names a value twice")
    if not s.tokens:
        raise ConfigError("study.tokens: empty axis; give at least one training budget")
    if bad := [t for t in s.tokens if t <= 0]:
        raise ConfigError(f"study.tokens: budget {bad[0]} is not positive")
    if not s.lrs:
        raise ConfigError("study.lrs: empty grid; give at least two learning rates (the starting log grid, "
                          "extended until its best has a worse neighbour on both sides)")
    if len(s.lrs) < 2:
        raise ConfigError(f"study.lrs: {list(s.lrs)} is one value; a grid needs at least two rates to be extended "
                          "until its best has a worse neighbour on both sides")
    if bad := [lr for lr in s.lrs if lr <= 0]:
        raise ConfigError(f"study.lrs: learning rate {bad[0]} is not positive")
    if len(set(s.lrs)) != len(s.lrs):
        raise ConfigError(f"study.lrs: {list(s.lrs)} names a rate twice")
    for key in ("seeds", "eval_tokens", "bootstrap"):
        if getattr(s, key) < 1:
            raise ConfigError(f"study.{key}: must be >= 1, got {getattr(s, key)}")
    if len(set(s.tasks)) != len(s.tasks):
        raise ConfigError(f"study.tasks: {list(s.tasks)} names a task twice")
    if s.tasks_limit < 0:
        raise ConfigError(f"study.tasks_limit: must be >= 0 documents per task (0: all), got {s.tasks_limit}")
    if s.max_extensions < 0:
        raise ConfigError(f"study.max_extensions: must be >= 0, got {s.max_extensions}")
    if s.early_below < 0:
        raise ConfigError(f"study.early_below: must be >= 0 tokens per parameter, got {s.early_below}")
    if not 0 < s.interval < 1:
        raise ConfigError(f"study.interval: must be in (0, 1), got {s.interval}")
    if not s.dir:
        raise ConfigError("study.dir: must not be empty")
