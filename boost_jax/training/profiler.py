"""A JAX profiler trace of `log.profile_steps` steps from `log.profile_start`."""

from __future__ import annotations

from pathlib import Path

import jax

from boost_jax.config import Config


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
