"""A study's spec: the `study` section and the run config every cell shares, the cells, each run's
config, and the record in study.dir that keeps one study dir to one spec."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boost_jax.comparison.grid import read_json
from boost_jax.config import Config, ConfigError, from_dict, raw_args
from boost_jax.config.archs import ARCHS
from boost_jax.config.study import StudyConfig
from boost_jax.model.counts import count, embedding_params
from boost_jax.runtime.cache import atomic_write
from boost_jax.runtime.paths import check_writable_dir

SPEC_FILE = "study.json"
# Keys the study sets per run: a command line or recipe that sets them is refused.
PER_RUN = ("model.preset", "model.arch", "train.optimizer", "train.lr", "train.seed", "train.steps",
           "train.warmup_steps", "train.eval_every", "run_dir", "parallel.dp")
# Where caches live: no run's numbers depend on them, so a study resumes with them changed.
UNRECORDED_DATA = ("cache_dir", "compile_cache", "compile_cache_dir")
# The study keys no run's training depends on: a study resumes with them changed (tasks scored later).
UNRECORDED_STUDY = ("dir", "tasks", "tasks_path", "tasks_limit")
# Optimizers that update factor pairs: a dense cell has none, so the study skips it (said in the report).
FACTOR_ONLY = ("spectron", "invariant_muon")


@dataclass(frozen=True)
class Cell:
    """One (arch, optimizer, preset, budget): its runs share tokens, batch, data order and schedule."""

    arch: str
    optimizer: str
    preset: str
    budget: float  # as study.tokens gives it
    steps: int
    tokens: int  # steps x tokens per step
    params_non_embedding: int
    train_flops: float  # tokens x training FLOPs per token

    @property
    def name(self) -> str:
        return f"{self.preset}/{self.arch}-{self.optimizer}/budget{self.budget:g}"

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params_non_embedding


@dataclass(frozen=True)
class Spec:
    """The study config, the run config (raw mapping, study section and per-run keys out) and its cells."""

    study: StudyConfig
    base: dict[str, Any]
    cells: tuple[Cell, ...]
    skipped: tuple[str, ...]  # cells no run can make (a factor-pair optimizer on dense)

    @property
    def dir(self) -> Path:
        return Path(self.study.dir)

    def run_config(self, cell: Cell, lr: float, seed: int) -> Config:
        """One run of `cell`: the shared config with the cell's model, optimizer, rate, seed and steps;
        warmup a tenth of the steps (the same schedule shape at every budget); one device; no evals
        during training (the final eval on study.eval_tokens is the measure)."""
        return from_dict(_with(self.base, {
            "model.preset": cell.preset, "model.arch": cell.arch, "train.optimizer": cell.optimizer,
            "train.lr": lr, "train.seed": seed, "train.steps": cell.steps,
            "train.warmup_steps": max(1, cell.steps // 10), "train.eval_every": 0, "parallel.dp": 1,
            "run_dir": str(self.dir / cell.preset / f"{cell.arch}-{cell.optimizer}" / f"budget{cell.budget:g}"
                           / f"lr{lr:g}-seed{seed}")}))

    def record(self) -> dict[str, Any]:
        """What study.json holds: everything that decides a run's numbers (not the dir itself, the
        downstream tasks, the log, or where caches live)."""
        run = {k: v for k, v in self.base.items() if k != "log"}
        if "data" in run:
            run["data"] = {k: v for k, v in run["data"].items() if k not in UNRECORDED_DATA}
        study = {k: v for k, v in dataclasses.asdict(self.study).items() if k not in UNRECORDED_STUDY}
        return json.loads(json.dumps({"study": study, "run": run}))  # as study.json reads back (tuples as lists)


def load(args: list[str]) -> Spec:
    """The spec of a command line (an optional YAML file, then section.key=value overrides): validated,
    its cells sized, nothing written."""
    raw = raw_args(args)
    cfg = from_dict(raw)  # every key checked, the study section's axes included
    set_here = [key for key in PER_RUN if _get(raw, key) is not None]
    if set_here:
        raise ConfigError(f"{set_here[0]}: the study sets it for each run (study.archs, study.optimizers, "
                          "study.presets, study.lrs, study.seeds, study.tokens say what to run)")
    if cfg.checkpoint.every == 0 and cfg.checkpoint.every_minutes == 0:
        raise ConfigError("checkpoint.every: 0 saves nothing, and a study run is evaluated from its final checkpoint "
                          "and resumed from its last one")
    base = copy.deepcopy(raw)
    base.pop("study", None)
    s = cfg.study
    per_step = cfg.train.batch_size * cfg.train.seq_len
    cells, skipped = [], []
    for preset in s.presets:
        dense = _counts(base, preset, "dense", cfg.train.seq_len)
        for budget in s.tokens:
            wanted = budget * _non_embedding(dense[0], dense[1]) if s.tokens_unit == "per_param" else budget
            steps = max(1, math.ceil(wanted / per_step))  # at least the budget: a cell never falls short of it
            for arch in s.archs:
                m, c = _counts(base, preset, arch, cfg.train.seq_len)
                for opt in s.optimizers:
                    if opt in FACTOR_ONLY and not ARCHS[arch].low_rank:
                        skipped.append(f"{preset}/{arch}-{opt}: {opt} updates factor pairs; {arch} has none")
                        continue
                    cells.append(Cell(arch, opt, preset, budget, steps, steps * per_step, _non_embedding(m, c),
                                      steps * per_step * c.train_flops_per_token))
    if not cells:
        raise ConfigError(f"study: no cell to run ({'; '.join(dict.fromkeys(skipped))}); add a low-rank arch to "
                          "study.archs or another optimizer to study.optimizers")
    return Spec(s, base, tuple(cells), tuple(dict.fromkeys(skipped)))


def check(spec: Spec) -> None:
    """Refuse, before any work and writing nothing, a study.dir that cannot be written (a file, under a
    file, read-only), one whose study.json cannot be read, one that holds another spec's runs, or a
    non-empty folder that is not a study dir."""
    check_writable_dir(spec.dir, "study.dir")
    path = spec.dir / SPEC_FILE
    mine = spec.record()
    if path.is_file():
        theirs = read_record(path)
        if theirs != mine:
            diff = sorted(k for k in set(_flat(theirs)) | set(_flat(mine)) if _flat(theirs).get(k) != _flat(mine).get(k))
            raise ConfigError(f"study.dir {spec.dir} holds the runs of another spec (it differs in {', '.join(diff)}); "
                              "use another study.dir, or the same spec to resume it (runs are never mixed)")
    elif spec.dir.is_dir() and any(spec.dir.iterdir()):
        raise ConfigError(f"study.dir {spec.dir} is not empty and holds no {SPEC_FILE}: not a study dir; use another")


def read_record(path: Path) -> dict[str, Any]:
    """A study dir's study.json, or one ConfigError naming it and what is wrong (nothing is changed)."""
    record, why = read_json(path)
    why = why or "not a study's record (no study and run sections)"
    if not (isinstance(record, dict) and isinstance(record.get("study"), dict) and isinstance(record.get("run"), dict)):
        raise ConfigError(f"study.dir: {path} is damaged ({why}); it records which spec the runs beside it belong to, "
                          "so they are not resumed without it: restore it, or use another study.dir")
    return record


def claim(spec: Spec) -> None:
    """Write the spec in study.dir (the first time; `check` has passed) so a later run of another spec
    is refused by name."""
    path = spec.dir / SPEC_FILE
    if not path.is_file():
        spec.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(spec.record(), indent=1, sort_keys=True).encode()))


def _counts(base: dict, preset: str, arch: str, seq_len: int):
    m = from_dict(_with(base, {"model.preset": preset, "model.arch": arch, "train.optimizer": "adamw"})).model
    return m, count(m, seq_len)


def _non_embedding(m, c) -> int:
    """Parameters outside the embedding and the (untied) LM head."""
    return c.params - embedding_params(m)


def _with(raw: dict, values: dict[str, Any]) -> dict:
    """A deep copy of `raw` with dotted keys set."""
    out = copy.deepcopy(raw)
    for key, value in values.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _get(raw: dict, key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    return {k: v for key, sub in d.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
