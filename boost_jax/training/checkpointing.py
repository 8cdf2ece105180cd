"""The loop's checkpointing: Orbax saves (in the background) every `checkpoint.every` steps and
`checkpoint.every_minutes` (and every `checkpoint.local_every` to each host's `checkpoint.local_dir`),
and the resume from the newest of either tier."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax

from boost_jax.config import Config
from boost_jax.model.checkpoint import CheckpointError, CheckpointStore, identity
from boost_jax.model.train_state import TrainState
from boost_jax.runtime.paths import disk_full, is_disk_full, refused_write
from boost_jax.training.local_tier import LocalTier
from boost_jax.training.run_dir import check_optimizer_switch, saves_checkpoints


class Checkpointing:
    """The loop's checkpointing: when to save (every `checkpoint.every` steps, `checkpoint.every_minutes`,
    the local tier's `checkpoint.local_every`) and what to resume, the newest step of either tier. The
    steps go to a `CheckpointStore` (model/checkpoint.py), each with the run's identity and data position."""

    def __init__(self, cfg: Config, run, run_dir: Path):
        self.cfg, self.run = cfg, run
        c = cfg.checkpoint
        self.ckpt = (CheckpointStore(run_dir / "checkpoints", c.keep, async_save=c.async_save)
                     if saves_checkpoints(cfg) else None)
        self.local = LocalTier(cfg, run_dir) if c.local_dir else None
        self.identity = identity(cfg.to_dict())
        self.saved_step, self.restored, self.meta, self.state_bytes = 0, False, {}, 0
        self.source = None  # where the resumed step came from
        self.last_save = time.monotonic()

    def resume(self, state: TrainState) -> tuple[TrainState, int]:
        """(state, step) from the newest checkpoint of either tier
        (the persistent one on a tie; step 0: an import's, `python -m boost_jax.convert`), or the
        fresh state at step 0. The checkpoint's record stays in `meta`, where it came from in
        `source`; parts of the state a persistent one lacks (`TrainState.OPTIONAL`, e.g. the spike window
        of a run that turned train.spike_skip on) start fresh."""
        start = self.ckpt.latest_step() if self.ckpt else None
        local = self.local and self.local.restore(state, start, self.identity, self.cfg.train.optimizer)
        if local:
            state, meta, self.source = local
            start = meta["step"]
        elif start is None:
            return state, 0
        else:
            state, meta = self._restore(state, start)
            self.source = str(self.ckpt.directory)
        if self.local:
            self.local.drop_after(start)
        state = self.run.adopt(state, meta)
        expected = start * self.cfg.train.batch_size
        if meta.get("data_position") != expected:
            raise CheckpointError(f"checkpoint step {start} in {self.source} records data position "
                                  f"{meta.get('data_position')}, expected {expected}")
        self.saved_step, self.restored, self.meta = start, True, meta
        return state, start

    def _restore(self, state: TrainState, start: int) -> tuple[TrainState, dict]:
        """(state, record) of persistent checkpoint `start`."""
        saved_optimizer = self.ckpt.record(start).get("optimizer", "adamw")  # older checkpoints: AdamW's
        switch = check_optimizer_switch(saved_optimizer, self.cfg, f"checkpoint step {start} in {self.ckpt.directory}")
        if switch:  # the checkpoint's optimizer state stays unread; this run's fresh one takes its place
            like = state.replace(opt_state=None)
            restored, meta = self.ckpt.restore(start, like, self.identity, optional=(*TrainState.OPTIONAL, *like.absent()))
            # A fresh optimizer state is the same for every layer (zeros, the same start vectors), so
            # the relayout to this run's layer order below leaves it as it is.
            state, meta = restored.replace(opt_state=state.opt_state), {**meta, "optimizer_reset": saved_optimizer}
        else:
            state, meta = self.ckpt.restore(start, state, self.identity, optional=TrainState.OPTIONAL)
        return state, meta

    def resume_notes(self, fit_note: str | None) -> list[str]:
        """The log lines of the resume: the step and where it came from, with `fit_note` (the
        micro-batches a resume on fewer devices added, analysis/microbatch_fit.py), and the state
        that starts fresh."""
        if not self.restored:  # a run dir with a config but no checkpoint starts at step 0
            return [fit_note] if fit_note else []
        loss = self.meta.get("loss")
        notes = [f"resumed from step {self.saved_step} ({self.source}"
                 + (f", loss {loss:.4f})" if loss is not None else ")") + (f"; {fit_note}" if fit_note else "")]
        if fresh := self.meta.get("fresh_state"):
            notes.append(f"the checkpoint holds no {', '.join(fresh)} state: it starts fresh")
        if before := self.meta.get("optimizer_reset"):
            t = self.cfg.train
            notes.append(f"train.optimizer {before} -> {t.optimizer} (train.reset_optimizer=true): the parameters "
                         f"resume, the {t.optimizer} state starts fresh")
        return notes

    def due(self, done: int) -> bool:
        """A save after step `done` by the step count: every `checkpoint.every` steps (if > 0) and at the end."""
        every = self.cfg.checkpoint.every
        return self.ckpt is not None and ((every > 0 and done % every == 0) or done == self.cfg.train.steps)

    def local_due(self, done: int) -> bool:
        """A save after step `done` to the local tier: every `checkpoint.local_every` steps."""
        return self.local is not None and done % self.cfg.checkpoint.local_every == 0

    def overdue(self) -> bool:
        """`checkpoint.every_minutes` have passed since the last save (or the start), by this process's
        clock (when a save it asks for is made is decided by all: training/meeting.py)."""
        minutes = self.cfg.checkpoint.every_minutes
        return self.ckpt is not None and minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes

    def save(self, done: int, state: TrainState, loss: float | None, record: dict | None = None) -> None:
        """Save the state after step `done` with its record (data position, layer order, loss,
        identity, and `record`: e.g. a mixture's weights history). Orbax copies the state off the
        devices, then writes it in the background (checkpoint.async_save)."""
        meta = self._record(done, loss, record)
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        with self._space():  # a full disk or a refused write surfaces here, or at the next save or the close (async)
            self._check_room()
            self._check_writable()
            self.ckpt.save(done, state, meta)
        self.saved_step, self.last_save = done, time.monotonic()

    def save_local(self, done: int, state: TrainState, loss: float | None, record: dict | None = None) -> None:
        """Save the state after step `done` to the local tier (each host's own disk), with the same record."""
        self.local.save(done, state, self._record(done, loss, record))

    def _record(self, done: int, loss: float | None, record: dict | None) -> dict:
        return {"step": done, "data_position": done * self.cfg.train.batch_size, **self.run.checkpoint_meta(),
                "loss": loss, "identity": self.identity, "optimizer": self.cfg.train.optimizer, **(record or {})}

    def _check_room(self) -> None:
        """Refuse a save its disk cannot hold before it starts: one that fails midway leaves Orbax's
        writer threads reporting into a closed event loop, a page of tracebacks. Where the room is
        short, a save still in flight (not yet counted in the free space) is waited for first."""
        if shutil.disk_usage(self.directory).free >= 2 * self.state_bytes:
            return
        self.ckpt.wait()
        if shutil.disk_usage(self.directory).free < self.state_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory))

    def _check_writable(self) -> None:
        """Refuse a save into a folder that can no longer be written (made read-only mid-run) before it
        starts, as `_check_room` does a full disk: a probe file, written and removed (a permission
        check alone passes for root on a read-only mount)."""
        try:
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as e:
            raise self._unwritable(e.strerror or str(e)) from None

    def _unwritable(self, why: str) -> CheckpointError:
        committed = self._committed()
        resume = f"resume from step {committed[-1]}" if committed else "start it again"
        return CheckpointError(f"cannot write a checkpoint in {self.directory}: {why}; the committed checkpoints "
                               f"(steps {committed}) are untouched. Make the folder writable and rerun the same "
                               f"command to {resume}")

    def _committed(self) -> list[int]:
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    @contextlib.contextmanager
    def _space(self):
        """A save that found the disk full or its folder unwritable: one message, with the space a
        checkpoint needs or the folder. Orbax commits a step by renaming its finished folder, so the
        committed ones are untouched."""
        try:
            yield
        except CheckpointError:  # the probe's own
            raise
        except Exception as e:
            if why := refused_write(e):
                raise self._unwritable(why) from None
            if not is_disk_full(e):
                raise
            raise disk_full(self.directory, "a checkpoint", self.state_bytes,
                            f"the committed checkpoints (steps {self._committed()}) are untouched") from None

    @property
    def enabled(self) -> bool:
        return self.ckpt is not None

    @property
    def directory(self) -> Path | None:
        """Where the checkpoints are (None: checkpointing is off)."""
        return self.ckpt.directory if self.ckpt else None

    def close(self) -> None:
        """Wait for saves in flight and release Orbax."""
        if self.ckpt:
            with self._space():
                self.ckpt.close()
        if self.local:
            self.local.close()
