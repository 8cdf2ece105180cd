"""Orbax checkpoints of the train state plus a small JSON record (step, data position, config).

Saves are asynchronous and atomic (Orbax commits a finished step directory by rename), so an
interrupted save never hides the previous checkpoint. Restoring takes the target's shardings,
so a checkpoint loads onto any mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from boost_jax.errors import CheckpointError


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int, *, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore `step` into arrays shaped and sharded like the `like` pytree."""
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        try:
            out = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # Orbax raises many types for a damaged directory
            raise CheckpointError(
                f"cannot restore checkpoint step {step} from {self.directory}: {type(e).__name__}: {e}. "
                "Fix or move that step directory aside to resume from an older one; nothing was changed."
            ) from e
        return out.state, dict(out.meta)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
