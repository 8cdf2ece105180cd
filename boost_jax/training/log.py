"""Run outputs: a progress bar, log lines, `metrics.jsonl` (one JSON object per step), TensorBoard
events and (log.wandb) the same scalars in Weights & Biases."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path

from tqdm import tqdm

from boost_jax.config import LogConfig
from boost_jax.runtime.paths import disk_full, is_disk_full

NOT_SCALARS = ("step", "time")  # a row's index and its wall clock: metrics.jsonl keeps them, TensorBoard and W&B not


class RunLog:
    """Writes only on the primary process (process 0 of a multi-process run)."""

    def __init__(self, run_dir: Path, cfg: LogConfig, *, total_steps: int, start_step: int, primary: bool = True,
                 run_config: dict | None = None):
        """`run_config`: the run's whole config, which a Weights & Biases run records."""
        self.path = run_dir / "metrics.jsonl"
        self.primary, self.failed = primary, False
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=None if cfg.progress and primary else True, file=sys.stderr)  # None: off unless a TTY
        if primary:
            self._truncate_after(start_step)  # a resumed run rewrites the steps it repeats
        self.file = self.path.open("a") if primary else open(os.devnull, "w")
        self.row_bytes, self.rows_left = 0, total_steps - start_step  # what the rest of the run appends
        self.every, self.total_steps = cfg.every, total_steps
        self.tb, self.tb_failure, self.excepthook = None, None, threading.excepthook
        if cfg.tensorboard and primary:
            self.tb = summary_writer_class()(str(run_dir / "tensorboard"), purge_step=start_step + 1)
            threading.excepthook = self._tb_thread_failed
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

    def _tb_thread_failed(self, args) -> None:
        """tensorboardX writes events on a thread of its own: a full disk there is kept for `flush`
        to report (not a thread's traceback), and once the run failed so is its writer's fall after
        it (a closed queue); anything else goes to the hook as it was."""
        if type(args.thread).__module__.startswith("tensorboardX") and (self.failed or is_disk_full(args.exc_value)):
            self.tb_failure, self.failed = self.tb_failure or args.exc_value, True
        else:
            self.excepthook(args)

    def due(self, step: int) -> bool:
        """A log line after step `step`: every `log.every` steps and at the end."""
        return step % self.every == 0 or step == self.total_steps

    def record(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        self.row_bytes, self.rows_left = max(self.row_bytes, len(line)), self.rows_left - 1
        with self._space(self.path, "metrics rows"):
            self.file.write(line)
        scalars = {k: v for k, v in row.items() if k not in NOT_SCALARS and isinstance(v, (int, float))}
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
        with self._space(self.path, "metrics rows"):
            self.file.flush()
        if self.tb is not None:
            with self._space(self.tb.logdir, "TensorBoard events"):
                if self.tb_failure:
                    raise self.tb_failure
                self.tb.flush()

    @contextlib.contextmanager
    def _space(self, path, what: str):
        """A write that found the disk full: one message with the space the rest of the run's rows
        need. The rows already on disk stay (a torn last line is set aside on resume)."""
        try:
            yield
        except OSError as e:
            if not is_disk_full(e):
                raise
            self.failed = True
            raise disk_full(path, what, max(self.rows_left, 1) * max(self.row_bytes, 1024),
                            "the rows and checkpoints already written are kept") from None

    def close(self) -> None:
        self.bar.close()
        with contextlib.suppress(OSError) if self.failed else contextlib.nullcontext():  # reported already
            self.file.close()
            if self.tb is not None:
                self.tb.close()
        if self.failed and self.tb is not None and self.tb.file_writer is not None:
            # tensorboardX's close stopped at the full disk: end its writer thread, and mark the writer
            # closed, or its atexit close would flush into the full disk again
            writer = self.tb.file_writer.event_writer
            with contextlib.suppress(Exception):
                writer._worker.stop()
            writer._closed = True
        if not (self.failed and self.tb is not None):  # a failed writer's thread may still fall: stay quiet
            threading.excepthook = self.excepthook
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: Path, cfg: LogConfig, run_config: dict):
    """A Weights & Biases run for this run dir: one id per run dir (a resumed run continues it), its
    files under <run_dir>/wandb; WANDB_MODE=offline logs with no network (`wandb sync` uploads later)."""
    import wandb  # optional: log.wandb=true needs it (pyproject's wandb extra)

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


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without PyTorch where this process has not imported it:
    tensorboardX.writer imports torch whenever it is installed, only to accept torch tensors (1.2 s of
    every train start on a machine with torch; the run logs floats)."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
        from tensorboardX import SummaryWriter  # optional: tensorboardX (log.tensorboard), loaded with torch hidden
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter
