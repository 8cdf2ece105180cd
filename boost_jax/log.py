"""Run outputs: a progress bar, log lines, `metrics.jsonl` (one JSON object per step) and TensorBoard events."""

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

    def __init__(self, run_dir: Path, cfg: LogConfig, *, total_steps: int, start_step: int, primary: bool = True):
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

    def _truncate_after(self, step: int) -> None:
        """Keep the rows of steps <= `step`. A line that is no row (a write cut short by a crash or
        a full disk) is dropped, and the file as it was is set aside, not fatal."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text(errors="replace").splitlines() if line.strip()]
        steps = [_step_of(line) for line in lines]
        if damaged := steps.count(None):
            aside = self.path.with_name(self.path.name + ".damaged")
            shutil.copyfile(self.path, aside)
            self.line(f"{self.path}: dropped {damaged} damaged line(s); the file as it was is in {aside}")
        kept = [line for line, at in zip(lines, steps) if at is not None and at <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def record(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

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


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl row; None if the line is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None
