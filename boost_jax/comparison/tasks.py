"""A study's downstream tasks (`study.tasks`): lm-evaluation-harness tasks the user has locally, run
through our adapter (boost_jax/model/harness.py) on each seed of every cell's best rate. Every task is
looked up and its data loaded before any training, so an unknown or unavailable one is refused by
name; each run's scores go to <run_dir>/study_tasks.json, so a rerun scores only what is missing."""

from __future__ import annotations

import json
import math
from pathlib import Path

from boost_jax.comparison.grid import finite_number, read_json
from boost_jax.config import Config, ConfigError
from boost_jax.config.study import StudyConfig
from boost_jax.runtime.cache import atomic_write
from boost_jax.runtime.errors import PackageError

SCORES = "study_tasks.json"


def task_manager(s: StudyConfig):
    """lm-eval's index of its tasks and study.tasks_path's, with every task of study.tasks in it and
    its documents loaded (refused by name otherwise); None without study.tasks."""
    if not s.tasks:
        return None
    try:
        from lm_eval.tasks import TaskManager  # optional: lm_eval (the eval extra)
    except ImportError:
        raise PackageError("study.tasks needs lm-eval: pip install -e \".[eval]\" (or pip install lm-eval)") from None
    if s.tasks_path is not None and not Path(s.tasks_path).is_dir():
        raise ConfigError(f"study.tasks_path {s.tasks_path}: no such folder (it names a folder of lm-eval task YAML files)")
    manager = TaskManager(include_path=s.tasks_path)
    if unknown := [t for t in s.tasks if t not in manager.all_tasks]:
        raise ConfigError(f"study.tasks: lm-eval has no task {unknown[0]!r} (`lm-eval ls tasks` lists them; "
                          "study.tasks_path names a folder of local task YAML files)")
    for name in s.tasks:
        try:
            manager.load([name])  # loads the task's documents: what is not here fails now
        except Exception as e:  # the datasets library's many errors: the task is named, the cause kept
            raise ConfigError(f"study.tasks: task {name!r} cannot be loaded here ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return manager


def scores(cfg: Config, s: StudyConfig, manager, log=print) -> dict[str, dict[str, float]]:
    """task -> metric -> value of one finished run: read back where scored before, the rest scored now
    (study.tasks_limit documents per task; 0 all of them)."""
    path = Path(cfg.run_dir) / SCORES
    done = read_scores(path, log) if path.is_file() else {}
    todo = [t for t in s.tasks if t not in done]
    if todo:
        from lm_eval import simple_evaluate  # optional: lm_eval

        from boost_jax.model.harness import BoostLM  # optional: lm_eval (the harness subclasses its model)

        out = simple_evaluate(model=BoostLM(run_dir=cfg.run_dir), tasks=todo, task_manager=manager,
                              limit=s.tasks_limit or None, log_samples=False, bootstrap_iters=0)
        for task in todo:
            done[task] = {k: float(v) for k, v in out["results"][task].items()
                          if isinstance(v, (int, float)) and "stderr" not in k and math.isfinite(v)}
        atomic_write(path, lambda f: f.write(json.dumps(done).encode()))
        log(f"  {cfg.run_dir}: " + ", ".join(f"{t} {m} {v:.4f}" for t in todo for m, v in done[t].items()))
    return {t: done[t] for t in s.tasks}


def read_scores(path: Path, log) -> dict[str, dict[str, float]]:
    """A run's saved scores (task -> metric -> value); a file that cannot be read back is said in one
    line and its tasks scored again."""
    done, why = read_json(path)
    why = why or "not task -> metric -> value"
    if isinstance(done, dict) and all(isinstance(m, dict) and all(map(finite_number, m.values())) for m in done.values()):
        return done
    log(f"  {path} is damaged ({why}): scoring its tasks again")
    return {}


def per_cell(runs: list[dict[str, dict[str, float]] | None]) -> dict[str, dict[str, list[float | None]]]:
    """The seeds' scores as task -> metric -> [value per seed] (None: the seed diverged, unscored)."""
    first = next((r for r in runs if r is not None), None)
    if first is None:
        return {}
    return {t: {m: [None if r is None else r[t][m] for r in runs] for m in first[t]} for t in first}
