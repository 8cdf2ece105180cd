"""`python -m boost_jax.study [study.yaml] [section.key=value ...] [--json]`: a fair comparison.

For each cell (arch x optimizer x preset x budget of the `study` section, boost_jax/configs/base.yaml)
the learning rate is searched on study.lrs, extended until the best rate has a worse neighbour on both
sides (at most study.max_extensions added), then the best rate runs with every seed (study.seeds). Every
cell of a preset and budget trains on the same tokens, batch, data order and schedule. Each run is an
ordinary run dir under study.dir, evaluated on study.eval_tokens held-out tokens (refused before any
training when the validation split holds fewer) and, with study.tasks, on those lm-eval tasks (each
found and loaded before any training, else refused by name). A rerun (after kill -9 too) skips finished runs and
resumes unfinished ones from their checkpoints; a study.dir of another spec, or one that cannot be written
or whose study.json cannot be read, is refused before any work, and a finished run whose study_result.json
cannot be read back is said in one line and computed again from its checkpoints. SIGTERM or SIGINT stops
the study (the run in progress saves its step; between runs, none is started) with a message and exit
status 1, its report not made: rerun the same command to resume it. The report:
every grid point, each cell's seeds, mean and spread, loss against training FLOPs fitted per (arch,
optimizer), and the compute multipliers of each low-rank arch against dense and of each optimizer
against adamw, with bootstrap intervals over seeds. --json prints it as one object.
"""

from __future__ import annotations

import json
import sys

from boost_jax.comparison import grid, report, runs, spec as specs, tasks
from boost_jax.launch.prepare import prepare_jax
from boost_jax.runtime.cli import config_parser, refuse_retired_flags, run_main
from boost_jax.training.preemption import Preemption

PROG = "python -m boost_jax.study"


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def _main(argv: list[str]) -> None:
    p = config_parser(PROG, __doc__, "[study.yaml] [section.key=value ...]")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    refuse_retired_flags(argv)
    a = p.parse_intermixed_args(argv)
    out = study(a.config, log=runs.note)
    print(json.dumps(out, indent=1) if a.json else "\n".join(report.table(out)))


def study(args: list[str], log=print) -> dict:
    """Run (or resume) the study of a command line's config and return its report."""
    spec = specs.load(args)
    specs.check(spec)  # study.dir, before any work
    s = spec.study
    prepare_jax(spec.run_config(spec.cells[0], s.lrs[0], 0))
    for preset in s.presets:  # each preset's vocabulary is its own tokenizer and dataset
        cell = next(c for c in spec.cells if c.preset == preset)
        runs.check_eval_split(spec.run_config(cell, s.lrs[0], 0), s.eval_tokens)
    manager = tasks.task_manager(s)  # every downstream task found and loaded, before anything is written
    specs.claim(spec)
    # SIGTERM or SIGINT between two runs stops the study before the next one (within a run, the loop saves its step)
    signals = Preemption()
    try:
        rows = [cell_row(spec, cell, manager, log, lambda: signals.received) for cell in spec.cells]
    finally:
        signals.close()
    return report.report(spec, rows, " ".join([PROG, *args]))


def cell_row(spec: specs.Spec, cell: specs.Cell, manager, log, stopped=lambda: None) -> dict:
    """One cell: its learning-rate search on seed 0, then the best rate with every seed (and each seed
    scored on study.tasks); `stopped` as runs.result takes it."""
    s = spec.study
    log(f"{cell.name}: {cell.steps} steps, {cell.tokens:,} tokens ({cell.tokens_per_param:.1f} per non-embedding "
        "parameter)")
    run = lambda lr, seed: runs.result(spec.run_config(cell, lr, seed), s.eval_tokens, log, stopped)
    found = grid.search(s.lrs, lambda lr: run(lr, 0)["loss"], s.max_extensions)
    seeds = [run(found.best, seed) for seed in range(s.seeds)]  # seed 0 is the grid's run, read back
    scored = [None if r["loss"] is None else tasks.scores(spec.run_config(cell, found.best, seed), s, manager, log)
              for seed, r in enumerate(seeds)] if manager is not None else []
    return {**report.cell_row(cell, found, seeds, s.early_below), "tasks": tasks.per_cell(scored)}


if __name__ == "__main__":
    main(sys.argv[1:])
