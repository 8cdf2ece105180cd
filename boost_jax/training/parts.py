"""The named parts of a training run, each with one job and deciding for itself when it acts;
`training.run.train` is the loop over them.

    RunDir          checks the run dir before any work (resume compatibility, writable folders),
                    holds it against a second run, and claims it once a step has run (config.yaml,
                    tokenizer.json)
    Checkpointing   Orbax saves (in the background) every `checkpoint.every` steps and
                    `checkpoint.every_minutes` (and every `checkpoint.local_every` to each host's
                    `checkpoint.local_dir`), and the resume from the newest of either tier
    Preemption      SIGTERM or SIGINT: save the current step and stop; a second signal exits at once
    Meter           throughput and MFU of the steps since the last log line, eval and saves excluded
    Evaluator       the mean loss over the same `train.eval_batches` validation batches (per
                    dataset of a mixture)
    NonFiniteGuard  a NaN or inf loss or gradient norm stops the run before its next checkpoint
    Profiler        a JAX profiler trace of `log.profile_steps` steps from `log.profile_start`
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from boost_jax.config import Config, ConfigError, from_dict, load_yaml
from boost_jax.launch.peaks import remeasured_cpu_peak
from boost_jax.model.checkpoint import CheckpointError, CheckpointStore, changed_keys, identity
from boost_jax.runtime.cache import cache_root
from boost_jax.runtime.errors import DivergenceError
from boost_jax.runtime.paths import LOCK, check_writable_dir, disk_full, is_disk_full, lock_dir, refused_write
from boost_jax.training.local_tier import LocalTier, local_path
from boost_jax.training.step import OPTIONAL_STATE, device_batch


class RunDir:
    """A run's folder: checked before any slow work, claimed once the first step has run."""

    def __init__(self, cfg: Config, primary: bool = True):
        """`primary`: the process that holds the run dir (process 0; the others write only through it
        and Orbax)."""
        self.cfg, self.path = cfg, Path(cfg.run_dir)
        self.saved = check_resume_compatible(cfg, self.path)  # the saved config of a run being resumed
        check_writable_dir(self.path, "run_dir")
        for name in ("metrics.jsonl", LOCK):  # files the run writes: a folder in their place is named now
            if (self.path / name).is_dir():
                raise ConfigError(f"run_dir: {self.path / name} is a folder, not a file; move it aside "
                                  "(the run writes that file)")
        if saves_checkpoints(cfg):
            check_writable_dir(self.path / "checkpoints", "run_dir")
        if cfg.checkpoint.local_dir:
            check_writable_dir(local_path(cfg.checkpoint.local_dir), "checkpoint.local_dir")
        self.lock = lock_dir(self.path, "run_dir") if primary else None  # one writer: before anything is written
        self.primary, self.claimed = primary, False

    def release(self) -> None:
        """Let another run have the run dir."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def claim(self, tokenizer, first_step) -> None:
        """Write config.yaml and the tokenizer once the first step (`first_step`: its metrics) has run:
        only a run that got through one step claims the run dir, so a failed start leaves no
        config.yaml to refuse the corrected command."""
        if self.primary and not self.claimed:
            jax.block_until_ready(first_step)
            self.cfg.dump(self.path / "config.yaml")
            tokenizer.save(str(self.path / "tokenizer.json"))  # travels with the run (and its export)
            self.claimed = True

    def schedule_note(self) -> str | None:
        """A note when train.steps changed since the saved run without a fixed schedule horizon."""
        t = self.cfg.train
        before = self.saved and (self.saved.get("train") or {}).get("steps")
        if before and before != t.steps and not t.schedule_steps:
            return (f"note: train.steps changed {before} -> {t.steps}: the LR schedule horizon changed with it "
                    "(fix train.schedule_steps to keep one schedule across extensions)")
        return None


def check_resume_compatible(cfg: Config, run_dir: Path) -> dict | None:
    """The saved config of an existing run, after checking the frozen keys did not change. (Each
    checkpoint checks them again on restore, so this only fails earlier, before any work.)"""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return None
    aside = "move it aside to resume (each checkpoint carries the frozen keys, so the resume stays checked)"
    try:
        saved = load_yaml(saved_path)
    except ConfigError as e:
        raise ConfigError(f"{e}; {aside}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{saved_path} is damaged (not a mapping of config keys); {aside}")
    try:
        from_dict(saved)  # an unknown section or key in it is named, as eval and generate name it
    except ConfigError as e:
        raise ConfigError(f"{saved_path} is damaged or edited: {e}; {aside}") from None
    changed = changed_keys(identity(saved), identity(cfg.to_dict()))
    if changed:
        raise ConfigError(
            f"run_dir {run_dir} holds a run with a different {', '.join(changed)}; "
            "use a new run_dir (the existing run was left untouched)"
        )
    check_optimizer_switch((saved.get("train") or {}).get("optimizer", "adamw"), cfg, f"run_dir {run_dir}")
    return saved


def check_optimizer_switch(saved: str, cfg: Config, where: str) -> bool:
    """Whether a resume switches train.optimizer (from `saved`), which only train.reset_optimizer allows:
    the parameters resume, the optimizer state starts fresh."""
    now = cfg.train.optimizer
    if saved != now and not cfg.train.reset_optimizer:
        raise ConfigError(f"train.optimizer: {where} was trained with {saved!r}, now {now!r}: its optimizer state "
                          f"does not carry over; set train.reset_optimizer=true to resume the parameters with a "
                          f"fresh {now} state, or use a new run_dir (the existing run was left untouched)")
    return saved != now


def saves_checkpoints(cfg: Config) -> bool:
    """Whether the run checkpoints: by steps (`checkpoint.every`), by time (`checkpoint.every_minutes`) or both."""
    return cfg.checkpoint.every > 0 or cfg.checkpoint.every_minutes > 0


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

    def resume(self, state):
        """(state, step) from the newest checkpoint of either tier
        (the persistent one on a tie; step 0: an import's, `python -m boost_jax.convert`), or the
        fresh state at step 0. The checkpoint's record stays in `meta`, where it came from in
        `source`; parts of the state a persistent one lacks (`OPTIONAL_STATE`, e.g. the spike window
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

    def _restore(self, state, start: int):
        """(state, record) of persistent checkpoint `start`."""
        saved_optimizer = self.ckpt.record(start).get("optimizer", "adamw")  # older checkpoints: AdamW's
        switch = check_optimizer_switch(saved_optimizer, self.cfg, f"checkpoint step {start} in {self.ckpt.directory}")
        if switch:  # the checkpoint's optimizer state stays unread; this run's fresh one takes its place
            like = {k: v for k, v in state.items() if k != "opt_state"}
            restored, meta = self.ckpt.restore(start, like, self.identity, optional=(*OPTIONAL_STATE, "opt_state"))
            # A fresh optimizer state is the same for every layer (zeros, the same start vectors), so
            # the relayout to this run's layer order below leaves it as it is.
            state, meta = {**restored, "opt_state": state["opt_state"]}, {**meta, "optimizer_reset": saved_optimizer}
        else:
            state, meta = self.ckpt.restore(start, state, self.identity, optional=OPTIONAL_STATE)
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
        """`checkpoint.every_minutes` have passed since the last save (or the start)."""
        minutes = self.cfg.checkpoint.every_minutes
        return self.ckpt is not None and minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes

    def asked(self, stopped: str | None) -> bool:
        """A save the clock asks for on any process (a collective: called by all at the same step), or
        the run's stop (`stopped`: what stopped it) where checkpointing is on."""
        return any_process(self.overdue()) or (stopped is not None and self.enabled)

    def save(self, done: int, state, loss: float | None, record: dict | None = None) -> None:
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

    def save_local(self, done: int, state, loss: float | None, record: dict | None = None) -> None:
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


class Preemption:
    """SIGTERM (a preemption notice) or SIGINT (Ctrl-C): the loop saves the step it is at and stops,
    exit status 0. A second signal exits at once, with status 128 + its number: Orbax commits a
    checkpoint by renaming its finished directory, so what is on disk stays usable. Handlers exist
    only on the main thread (a run started from another thread keeps the default behaviour)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received:
            print(f"{name} again: exiting now; the newest committed checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received = name
        print(f"{name}: saving the current step and stopping (send it again to exit at once)", file=sys.stderr,
              flush=True)

    def stop(self) -> str | None:
        """What stops the run at this step: the signal this process received, or another process's
        (a collective: all processes call it at the same step, and all stop alike); None to go on."""
        if any_process(self.received is not None):
            return self.received or "a signal to another process"
        return None

    @staticmethod
    def line(stopped: str, done: int, directory: Path | None) -> str:
        """The log line of a run `stopped` after step `done`, saved in `directory` (None: checkpointing is off)."""
        saved = f"saved step {done} in {directory}" if directory else "checkpointing is off: not saved"
        return f"stopped by {stopped} after step {done}: {saved}; rerun the same command to resume"

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (a collective in a multi-process run: every process calls
    it at the same step, so all decide alike)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


class Meter:
    """Tokens/s, model FLOP/s and MFU of the steps since the last reading, time spent paused (eval,
    checkpoints) excluded. An MFU over 100% is no measurement but a peak measured low: a CPU's peak
    (measured once, on a host that may have been busy, and cached) is measured again, once, and kept
    in the cache when higher; while the throughput still passes it, the row has no "mfu"."""

    def __init__(self, cfg: Config, n_devices: int, start: int, flops_per_token: float, peak_flops: float):
        t = cfg.train
        self.tokens_per_step, self.flops_per_token = t.batch_size * t.seq_len, flops_per_token
        # Simulated CPU devices share the host's cores: the measured peak is per host, not per device.
        on_cpu = jax.devices()[0].platform == "cpu"
        self.hosts = jax.process_count() if on_cpu else n_devices
        self.peak = self.hosts * peak_flops
        remeasure = lambda: remeasured_cpu_peak(cfg.model.dtype, cache_root(cfg.data.cache_dir), peak_flops)
        self.remeasure = remeasure if on_cpu else None
        self.tick, self.tick_step, self.paused_s = time.perf_counter(), start, 0.0

    @contextlib.contextmanager
    def paused(self, state):
        """Wait for the steps in flight (computing `state`), then charge the time inside to the pause,
        not to training."""
        jax.block_until_ready(state)
        since = time.perf_counter()
        yield
        self.paused_s += time.perf_counter() - since

    def read(self, done: int) -> dict:
        """The throughput of the steps since the last reading, up to step `done`."""
        now = time.perf_counter()
        step_time = (now - self.tick - self.paused_s) / (done - self.tick_step)
        tok_s = self.tokens_per_step / step_time
        flops_s = tok_s * self.flops_per_token
        if flops_s > self.peak and self.remeasure is not None:
            self.peak, self.remeasure = self.hosts * self.remeasure(), None
            now = time.perf_counter()  # measuring is not training
        self.tick, self.tick_step, self.paused_s = now, done, 0.0
        mfu = {"mfu": flops_s / self.peak} if flops_s <= self.peak else {}
        return {"tokens_per_s": tok_s, "step_time_s": step_time, "tflops_per_s": flops_s / 1e12, **mfu}


class Evaluator:
    """Loss, perplexity and bits per byte over the first `batches` (default `train.eval_batches`)
    batches of a split (always the same ones). Bits per byte: the summed loss in bits over the UTF-8
    bytes of the evaluated tokens' decoded text, comparable across tokenizers. A mixture's datasets
    are each evaluated (`eval_loss/<name>`, `eval_bpb/<name>`), and `eval_loss` and `eval_bpb` are
    their means weighted by the mixture's current weights."""

    def __init__(self, cfg: Config, run, data, process: tuple[int, int], split: str = "val",
                 batches: int | None = None):
        self.cfg, self.run, self.data, self.process = cfg, run, data, process
        self.sets = data.eval_sets(split)
        self.weights = data.train.history[-1].weights if data.parts else {"": 1.0}
        self.batches = batches or cfg.train.eval_batches
        self._bytes: dict[str, int] = {}

    def due(self, done: int) -> bool:
        """An eval after step `done`: every `train.eval_every` steps and at the end (if there is val data)."""
        t = self.cfg.train
        return bool(self.sets) and t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps)

    def __call__(self, state) -> dict:
        t = self.cfg.train
        out, losses, bpbs, counted = {}, {}, {}, {}
        for name, split in self.sets.items():
            step_losses = [self.run.eval_step(state["params"], device_batch(b, self.run.batch_sharding))
                           for b in split.eval_batches(self.batches, t.batch_size, *self.process)]
            # Each batch's loss is the mean over its targets: weighted by their numbers, the split's.
            per_batch = self.targets(name)
            losses[name] = float(np.average(jax.device_get(step_losses), weights=per_batch))
            counted[name] = sum(per_batch)
            bpbs[name] = losses[name] * counted[name] / (self.bytes(name) * math.log(2))
            if name:
                out.update({f"eval_loss/{name}": losses[name], f"eval_bpb/{name}": bpbs[name]})
        weights = {n: self.weights[n] for n in self.sets}
        if not sum(weights.values()):  # only datasets the mixture no longer draws from have val data
            weights = dict.fromkeys(self.sets, 1.0)
        mean = lambda values: sum(weights[n] * values[n] for n in values) / sum(weights.values())
        loss = mean(losses)
        return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_bpb": mean(bpbs),
                "eval_tokens": sum(counted.values()), **out}

    def targets(self, name: str = "") -> list[int]:
        """The target tokens of each evaluated batch of one dataset, every process's rows: all its
        positions, or those a loss mask weighs (instruction data, data/packing.py)."""
        t = self.cfg.train
        return [int((b["weights"] > 0).sum()) if "weights" in b else t.batch_size * t.seq_len
                for b in self.sets[name].eval_batches(self.batches, t.batch_size)]

    def bytes(self, name: str = "") -> int:
        """UTF-8 bytes of the evaluated targets' text of one dataset, every process's rows (counted once)."""
        if name not in self._bytes:
            t, tok = self.cfg.train, self.data.tokenizer
            rows = [[i for i, w in zip(row, weights, strict=True) if w > 0] if "weights" in b else row
                    for b in self.sets[name].eval_batches(self.batches, t.batch_size)
                    for row, weights in zip(b["targets"].tolist(), b.get("weights", b["targets"]).tolist(),
                                            strict=True)]
            self._bytes[name] = max(1, sum(len(text.encode()) for text in tok.decode_batch(rows)))
        return self._bytes[name]


def perplexity(loss: float) -> float:
    """exp(loss); a diverged model's loss beyond ~709 overflows a float: its perplexity is inf."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class NonFiniteGuard:
    """`train.on_nonfinite=stop`: the first row with a NaN or inf loss or gradient norm stops the run,
    before any checkpoint after it (`skip` drops such updates inside the step and counts them, as
    train.spike_skip counts the loss spikes it drops)."""

    def __init__(self, cfg: Config):
        self.cfg, self.skipped, self.spikes = cfg, 0, 0

    def first_bad(self, row: dict) -> bool:
        """Count a skipped update; True if this row must stop the run."""
        self.skipped += int(row.get("skipped", 0))
        self.spikes += int(row.get("spike_skipped", 0))
        return self.cfg.train.on_nonfinite == "stop" and not finite(row)

    def stop(self, row: dict, saved_step: int) -> DivergenceError:
        """The error that stops the run at `row`, naming the last checkpoint kept."""
        kept = f"; checkpoints up to step {saved_step} are kept" if saved_step else ""
        return DivergenceError(
            f"non-finite loss ({row['loss']}) or gradient norm ({row['grad_norm']}) at step {row['step']}: the run "
            f"stopped there and wrote no checkpoint after it{kept}. Lower train.lr (now {self.cfg.train.lr:g}) or "
            "model.init_std, or set train.on_nonfinite=skip to drop such updates")


def finite(row: dict) -> bool:
    """A metrics row whose loss and gradient norm are finite."""
    return math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


class Profiler:
    """A JAX profiler trace of steps [log.profile_start, + log.profile_steps) into <run_dir>/profile
    (TensorBoard's profile plugin or ui.perfetto.dev reads it); off when profile_start is 0."""

    def __init__(self, cfg: Config, run_dir: Path):
        log = cfg.log
        self.first, self.last = log.profile_start, log.profile_start + log.profile_steps - 1
        self.directory, self.active = run_dir / "profile", False

    def before(self, step: int) -> None:
        """Called before step `step` (1-based) runs."""
        if self.first and step == self.first:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, metrics) -> None:
        """Called after step `step` was dispatched: the trace stops once its last step has run."""
        if self.active and step >= self.last:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        """Stop a trace still running (the run ended inside it)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
