"""The train state: one typed pytree of sharded arrays that init, the abstract state, the train
step, checkpointing and the compile analysis all use. It sits below training/ beside the checkpoint
store because inference reads a checkpoint's parameters by the same names (model/weights.py).

On disk a checkpoint holds `tree()`, a dict of the parts present by their field names: the layout
checkpoints had when the state was a plain dict, so those still restore. A part that is None is
absent: the spike window without train.spike_skip, or the parts a partial read leaves unread (the
parameters alone for inference; no optimizer state where train.reset_optimizer starts a fresh one).
A new part is one more field here (with a default of None where a checkpoint may lack it, named in
OPTIONAL).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import struct


@struct.dataclass
class TrainState:
    params: Any  # the model's parameters, a pure dict (model/weights.py)
    opt_state: Any = None  # the optimizer's state (training/optimizers.py)
    step: Any = None  # int32 []: the steps applied
    rng: Any = None  # the key data advanced every step (reserved for stochastic layers)
    spike: Any = None  # train.spike_skip's window: {"losses": [spike_window], "seen": []} (training/step.py)

    # Parts a checkpoint may lack (they start fresh) or hold beyond this run's (they are not read).
    OPTIONAL: ClassVar[tuple[str, ...]] = ("spike",)

    def tree(self) -> dict[str, Any]:
        """The checkpoint layout: the parts present, by name."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def of(cls, tree: dict[str, Any]) -> TrainState:
        """The state of a checkpoint layout (`tree`); a part it lacks is None."""
        return cls(**tree)

    def absent(self) -> tuple[str, ...]:
        """The names of the parts this state leaves out (None)."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None)
