"""Where every process of a run meets: the per-step decisions all must take at the same step (stop
on a signal, save now, stop on a non-finite loss). One process saving or stopping while another
goes on into the next step's collectives hangs a multi-host run, so the rule is written once, here:

- every process meets after the same steps (`Meeting.meets`): with several processes, those after
  which a save, a local save or a log line is due by the step count, which all know alike; with
  one, every step (no one to wait for: a signal stops the run at the step it came);
- at a meeting each process puts in what it alone may know (`Asks`: a signal it received, its
  clock's `checkpoint.every_minutes`; a non-finite row its guard found) and one collective, the max
  of a small vector of flags over the processes, gives every process the same `Decision`;
- the loop acts on the decision alone: stop as diverged (no checkpoint after it), save, stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils

from boost_jax.training.checkpointing import Checkpointing
from boost_jax.training.preemption import Preemption


@dataclass(frozen=True)
class Asks:
    """What this process alone asks for after a step (read once: a clock read twice may disagree)."""

    signal: str | None  # the signal it received (SIGTERM, SIGINT), or None
    clock: bool  # checkpoint.every_minutes have passed since its last save

    @property
    def any(self) -> bool:
        return self.signal is not None or self.clock


@dataclass(frozen=True)
class Decision:
    """What every process does after a step, the same on all."""

    stop: str | None  # what stops the run (a signal, this process's or another's); None: go on
    save: bool  # save the state after this step (the persistent tier)
    diverged: bool  # a non-finite row stops the run, with no checkpoint after it


class Meeting:
    def __init__(self, preemption: Preemption, ckpt: Checkpointing):
        self.preemption, self.ckpt, self.alone = preemption, ckpt, jax.process_count() == 1

    def meets(self, synced: bool) -> bool:
        """Whether the processes meet after this step; `synced`: a save, a local save or a log line is
        due after it by the step count."""
        return self.alone or synced

    def asks(self) -> Asks:
        return Asks(signal=self.preemption.received, clock=self.ckpt.overdue())

    def decide(self, asks: Asks, save: bool, diverged: bool) -> Decision:
        """The decision after a step at which `save` is due by the step count (alike on every process),
        this process `asks` and its guard found a non-finite row (`diverged`): one collective."""
        mine = np.array([asks.signal is not None, asks.clock, diverged], np.int32)
        agreed = mine if self.alone else np.max(multihost_utils.process_allgather(mine), axis=0)
        signal, clock, diverged = (bool(x) for x in agreed)
        if diverged:
            return Decision(stop=None, save=False, diverged=True)
        stop = (asks.signal or "a signal to another process") if signal else None
        return Decision(stop=stop, save=save or clock or (stop is not None and self.ckpt.enabled), diverged=False)
