"""Orbax checkpoints of the train state plus a small JSON record (step, data position, loss, identity).

Saves are asynchronous and atomic (Orbax commits a finished step directory by rename), so an
interrupted save never hides the previous checkpoint. Restoring takes the target's shardings,
so a checkpoint loads onto any mesh. Each checkpoint carries its run's identity (the frozen config
keys) and restoring checks it, so no edited or missing config.yaml can pair it with another model.
It sits beside the model, below training/: every inference command reads checkpoints through it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils

from boost_jax.model.train_state import TrainState
from boost_jax.runtime.errors import CheckpointError

T = TypeVar("T")


# Keys that must not change when a run dir is resumed: they change what the checkpoint means. A
# mixture's datasets and weights may (the run records each change: data/mixture.py), and so may
# the compilation cache (where compiled programs are kept).
FROZEN_ON_RESUME = ("model", "data", "train.batch_size", "train.seq_len", "train.seed")
MAY_CHANGE_ON_RESUME = ("data.mixture", "data.compile_cache", "data.compile_cache_dir")


# Model keys that change how a model computes, not what its parameters mean: a saved model is served
# (generate, eval) under any values of these.
COMPUTE_ONLY = ("model.dtype", "model.attention", "model.attention_query_block", "model.kernels", "model.norm",
                "model.grouping")


def model_identity(config: dict) -> dict[str, Any]:
    """What the parameters of a config dict's model mean: its `model` keys less COMPUTE_ONLY."""
    return {k: v for k, v in identity(config, ("model",)).items() if k not in COMPUTE_ONLY}


def identity(config: dict, keys: tuple[str, ...] = FROZEN_ON_RESUME) -> dict[str, Any]:
    """The frozen keys (or those under `keys`) of a config dict (`Config.to_dict()`), as flat dotted names."""
    under = lambda key, prefixes: any(key == f or key.startswith(f + ".") for f in prefixes)
    return {k: v for k, v in _flatten(config).items() if under(k, keys) and not under(k, MAY_CHANGE_ON_RESUME)}


def changed_keys(saved: dict, now: dict) -> list[str]:
    """The dotted keys whose values differ between two identities."""
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    return {k: v for key, value in d.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}


# Orbax splits the save of an array held by several replicas (a dp- or tp-replicated weight) among
# them, each slicing its part on device first: one dispatch per slice, 90% of a llama-tiny save on 8
# devices. An array whose per-replica slice would be smaller than this is written whole by one replica.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The train state through Orbax's pytree handler (the format StandardSave writes), its arrays
    through an ArrayHandler that splits only slices of MIN_REPLICA_SLICE_BYTES or more; the
    record as JSON."""
    arrays = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES)
    state = ocp.PyTreeCheckpointHandler(type_handler_registry=ocp.type_handlers.create_type_handler_registry(
        (jax.Array, arrays)))
    meta = ocp.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, handler, args in (("state", state, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)),
                                ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore))):
        for a in args:
            registry.add(item, a, handler)
    return registry


class CheckpointStore:
    """The Orbax store of one checkpoints folder: save, restore and list its steps. It decides nothing:
    when to save and what to resume are the train loop's (training/checkpointing.py's `Checkpointing`)."""

    def __init__(self, directory: str | Path, keep: int, *, read_only: bool = False, async_save: bool = True):
        self.directory = Path(directory).absolute()
        # A save's step folder is made in `save` itself, not by a background thread: Orbax's writer
        # threads wait for that thread's signal, which never comes when making the folder fails (made
        # read-only mid-run), and, not daemons, they then held the process at exit for Orbax's 300 s
        # timeout. Made in `save`, a refused folder raises there with no writer started (save returns
        # ~10 ms later on a local disk: 21 against 11 ms, llama-tiny-sized state).
        in_save = ocp.AsyncOptions(create_directories_asynchronously=False)
        self.manager = listed(lambda: ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only,
                                                 enable_async_checkpointing=async_save, async_options=in_save),
            handler_registry=_handlers(),
        ))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def read_live(self, step: int, read: Callable[[int], T], *, asked: bool) -> tuple[T, int]:
        """(`read(s)`, s) of checkpoint `step`, in a folder a live run may be writing: its retention
        (checkpoint.keep) can delete the step while it is read, which is no damage. A step the caller
        chose as the newest (`asked` False) gives way to the newest step left, named on stderr; a step
        asked for by number is named as deleted. A step still there when its read failed is damaged."""
        while True:
            try:
                return read(step), step
            except CheckpointError:
                if not self._deleted(step):
                    raise
            left = self._steps()
            gone = (f"checkpoint step {step} in {self.directory} was deleted by its run's retention "
                    f"(checkpoint.keep, a run still training there) while it was read")
            if asked or not left:
                raise CheckpointError(f"{gone}; the folder now holds steps {left}: ask for one of them "
                                      "(nothing was changed)")
            print(f"note: {gone}; reading step {left[-1]}, the newest now", file=sys.stderr, flush=True)
            step = left[-1]

    def _deleted(self, step: int) -> bool:
        """Whether `step` was deleted by a live run's retention: gone from the folder, or, where a newer
        step exists (retention deletes a step only after a newer one is committed), gone within
        DELETING_S. Orbax deletes a step file by file, and the folder stays listed until its last file
        is gone: a read in between finds files missing, which is no damage."""
        deadline = time.monotonic() + DELETING_S
        while True:
            steps = self._steps()
            if step not in steps:
                return True
            if steps[-1] == step or time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _steps(self) -> list[int]:
        """The committed steps on disk now (not the manager's list from when it was made)."""
        listed(self.manager.reload)
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, meta: dict) -> None:
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state.tree()), meta=ocp.args.JsonSave(meta))
        )

    def record(self, step: int) -> dict:
        """A checkpoint's JSON record (step, data position, identity, ...) without its arrays."""
        return dict(self._restore(step, meta=ocp.args.JsonRestore()).meta)

    def restore(self, step: int, like: TrainState, run_identity: dict, optional: tuple[str, ...] = (), *,
                subset: bool = False) -> tuple[TrainState, dict]:
        """Restore `step` into arrays shaped and sharded like the `like` state, after checking the
        checkpoint's identity agrees on every key of `run_identity`. Parts named in `optional` may be
        missing from the checkpoint (they keep `like`'s values) or from `like` (they are not read).
        `subset`: `like` holds only the parts to read (e.g. the parameters alone); the checkpoint's
        other parts are never read."""
        like = like.tree()
        meta = self.record(step)
        if "identity" not in meta:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} records no run identity "
                                  "(frozen config keys), so it cannot be checked against this config")
        if changed := changed_keys({k: meta["identity"].get(k) for k in run_identity}, run_identity):
            values = "; ".join(f"{k}: {meta['identity'].get(k)!r} in the checkpoint, {run_identity.get(k)!r} now"
                               for k in changed[:4]) + ("; ..." if len(changed) > 4 else "")
            raise CheckpointError(f"checkpoint step {step} in {self.directory} belongs to a run with a different "
                                  f"{', '.join(changed)} ({values}); use a new run_dir (nothing was changed)")
        saved = set(self._saved_keys(step))
        fresh, unread = set(like) - saved, saved - set(like)
        if subset and fresh:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} holds no {', '.join(sorted(fresh))} "
                                  f"(its state parts are {sorted(saved)}); nothing was changed")
        if bad := sorted((fresh | (set() if subset else unread)) - set(optional)):
            raise CheckpointError(f"checkpoint step {step} in {self.directory} holds state parts {sorted(saved)}, this "
                                  f"run has {sorted(like)} ({bad} differ); nothing was changed")
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              {k: v for k, v in like.items() if k in saved})
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        state = self._restore(step, state=ocp.args.PyTreeRestore(target, restore_args=restore_args,
                                                                 partial_restore=bool(unread))).state
        return TrainState.of({**{k: like[k] for k in fresh}, **state}), {**meta, "fresh_state": sorted(fresh)}

    def _saved_keys(self, step: int) -> list[str]:
        """The top-level keys of a checkpoint's state."""
        try:
            return list(self.manager.item_metadata(step)["state"].tree)
        except Exception as e:  # Orbax raises many types for a damaged directory
            raise CheckpointError(f"cannot read checkpoint step {step} in {self.directory}: {type(e).__name__}: "
                                  f"{_first_line(e)}. Fix or move that step directory aside to resume from an "
                                  "older one; nothing was changed.") from e

    def _restore(self, step: int, **items: Any) -> Any:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax raises many types for a damaged directory
            raise CheckpointError(
                f"cannot restore checkpoint step {step} from {self.directory}: {type(e).__name__}: "
                f"{_first_line(e)}. Fix or move that step directory aside to resume from an older one; "
                "nothing was changed."
            ) from e

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


# How long a step that failed to read, with a newer one beside it, is given to vanish (being deleted
# by retention) before it is called damaged. Deleting a step's files takes milliseconds locally.
DELETING_S = 2.0


def listed(fn: Callable[[], T]) -> T:
    """`fn()`, Orbax listing the step folders (making or reloading a manager), again where a step
    vanished while it was listed: a live run's retention deleted it."""
    for attempt in range(20):
        try:
            return fn()
        except (FileNotFoundError, NotADirectoryError):
            if attempt == 19:
                raise
            time.sleep(0.05)


def _run_sync_draining(coro):
    """Orbax's `_run_sync_via_new_loop` (one event loop per save or restore), draining the loop when
    the coroutine fails: Orbax closes it at once, while the reads of the other arrays are in flight;
    when they end, each reports into the closed loop ("Event loop is closed", "Task exception was
    never retrieved", a traceback per array) after the one clean message of a damaged checkpoint."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except BaseException:
        if pending := asyncio.all_tasks(loop):
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


if hasattr(asyncio_utils, "_run_sync_via_new_loop"):  # orbax 0.12's; a later one may manage without
    asyncio_utils._run_sync_via_new_loop = _run_sync_draining


def _first_line(e: Exception) -> str:
    """Orbax/TensorStore errors can carry pages of context; the first line names the problem."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""
