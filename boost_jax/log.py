"""Run outputs: a progress bar, log lines, `metrics.jsonl` (one JSON object per step), TensorBoard
events and (log.wandb) the same scalars in Weights & Biases."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from boost_jax.config import LogConfig


class RunLog:
    """Writes only on the primary process (process 0 of a multi-process run)."""

    def __init__(self, run_dir: Path, cfg: LogConfig, *, total_steps: int, start_step: int, primary: bool = True,
                 run_config: dict | None = None):
        """`run_config`: the run's whole config, which a Weights & Biases run records."""
        self.path = run_dir / "metrics.jsonl"
        self.primary = primary
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=None if cfg.progress and primary else True, file=sys.stderr)  # None: off unless a TTY
        if primary:
            self._truncate_after(start_step)  # a resumed run rewrites the steps it repeats
        self.file = self.path.open("a") if primary else open(os.devnull, "w")
        self.tb = None
        if cfg.tensorboard and primary:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self.wandb = _wandb_run(run_dir, cfg, run_config or {}) if cfg.wandb and primary else None

    def _truncate_after(self, step: int) -> None:
        """Keep the rows of steps <= `step`. A line that is no row (a write cut short by a crash or
        a full disk) is dropped, and the file as it was is set aside, not fatal. Rows after `step`
        (the run starts again from an older checkpoint, or from step 0 with none) are rewritten
        by this run: the file as it was is set aside first, so no row is lost."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text(errors="replace").splitlines() if line.strip()]
        steps = [_step_of(line) for line in lines]
        if damaged := steps.count(None):
            aside = self.path.with_name(self.path.name + ".damaged")
            shutil.copyfile(self.path, aside)
            self.line(f"{self.path}: dropped {damaged} damaged line(s); the file as it was is in {aside}")
        if after := [at for at in steps if at is not None and at > step]:
            aside = _free_name(self.path.with_name(f"{self.path.name}.before-step-{step}"))
            shutil.copyfile(self.path, aside)
            self.line(f"{self.path}: this run starts after step {step}, and the file holds rows up to step "
                      f"{max(after)}, which it rewrites; the file as it was is in {aside}")
        kept = [line for line, at in zip(lines, steps) if at is not None and at <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def record(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def line(self, text: str) -> None:
        if not self.primary:
            return
        if self.bar.disable:
            print(text, file=sys.stderr, flush=True)
        else:
            tqdm.write(text, file=sys.stderr)

    def advance(self, n: int = 1, **postfix) -> None:
        self.bar.update(n)
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    def flush(self) -> None:
        self.file.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: Path, cfg: LogConfig, run_config: dict):
    """A Weights & Biases run for this run dir: one id per run dir (a resumed run continues it), its
    files under <run_dir>/wandb; WANDB_MODE=offline logs with no network (`wandb sync` uploads later)."""
    import hashlib

    import wandb

    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=cfg.wandb_project, id=run_id, name=run_dir.name, dir=str(run_dir), config=run_config,
                      resume="allow")


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist."""
    n, free = 0, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}.{n}")
    return free


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl row; None if the line is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None
