"""`train.on_nonfinite=stop`: a NaN or inf loss or gradient norm stops the run before its next
checkpoint."""

from __future__ import annotations

import math

from boost_jax.config import Config
from boost_jax.runtime.errors import DivergenceError


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
