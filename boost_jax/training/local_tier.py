"""`checkpoint.local_dir`: the frequent tier of a run's checkpoints, on each host's own disk.

Every `checkpoint.local_every` steps each process keeps a whole copy of the train state (host arrays;
gathered first where the state is sharded over processes) with its JSON record, through an Orbax
CheckpointManager of its own (active_processes = this process: no barrier with a peer, so a lost
peer's folder is never waited for). Every host holding the whole state is the replication: any one
survivor's folder restores the run, on any number of processes and any mesh. The process holding the
newest local step reads it and broadcasts it to the others (jax.experimental.multihost_utils).

Why not Orbax's own emergency CheckpointManager: docs/design.md, "Two checkpoint tiers".
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from boost_jax.config import Config
from boost_jax.runtime.errors import CheckpointError, ConfigError
from boost_jax.runtime.paths import check_writable_dir, is_disk_full, refused_write
from boost_jax.training.checkpoint import _first_line, changed_keys, listed

# The step being written and the newest committed one: a kill mid-save leaves the older one whole.
LOCAL_KEEP = 2


def local_path(template: str) -> Path:
    """`checkpoint.local_dir` of this process: "{process}" is its index."""
    return Path(template.replace("{process}", str(jax.process_index()))).expanduser().absolute()


class LocalTier:
    """One process's folder of local checkpoints. Making one, `restore` and `save` of a gathered
    state are collectives: every process calls them at the same point."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.path, self.run_dir = local_path(cfg.checkpoint.local_dir), str(Path(run_dir).absolute())
        check_writable_dir(self.path, "checkpoint.local_dir")
        self.path.mkdir(parents=True, exist_ok=True)
        check_not_shared(self.path)
        me = jax.process_index()
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                                   barrier_sync_key_prefix=f"local-tier-{me}")
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, handler, args in (
                ("state", ocp.PyTreeCheckpointHandler(multiprocessing_options=alone),
                 (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)),
                ("meta", ocp.JsonCheckpointHandler(multiprocessing_options=alone),
                 (ocp.args.JsonSave, ocp.args.JsonRestore))):
            for a in args:
                registry.add(item, a, handler)
        self.manager = listed(lambda: ocp.CheckpointManager(
            self.path, handler_registry=registry,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=LOCAL_KEEP, create=False, multiprocessing_options=alone,
                enable_async_checkpointing=cfg.checkpoint.async_save,
                # Orbax signals a step folder made in the background through the coordination
                # service, under a key every process shares: made at once, this process waits on no one.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False))))
        self._check_own()

    def _check_own(self) -> None:
        """A folder holding another run's local checkpoints is refused on every process alike (its
        steps would be mistaken for this run's, or deleted by its retention)."""
        newest = self.manager.latest_step()
        foreign = newest is not None and self._read_record(newest).get("run_dir") not in (None, self.run_dir)
        if who := [i for i, f in enumerate(all_processes(int(foreign))) if f]:
            raise ConfigError(f"checkpoint.local_dir: the folder of process(es) {who}"
                              + (f" ({self.path})" if foreign else "") + " holds local checkpoints of another "
                              "run_dir; give each run its own local_dir (nothing was changed)")

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Keep step `step`: the state copied to this host (a collective where it is sharded over
        processes), written in the background."""
        host = jax.tree.map(to_host, state)
        with self._writes():
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(host),
                meta=ocp.args.JsonSave({**meta, "run_dir": self.run_dir, "state_keys": sorted(state)})))

    def restore(self, like: dict, newer_than: int | None, run_identity: dict, optimizer: str
                ) -> tuple[dict, dict, str] | None:
        """(state laid out like `like`, its record, where it came from) of the newest local step of
        any process, if newer than `newer_than` (the persistent tier's newest) and made by this run's
        setup; else None, after a line on stderr saying why a newer one was passed over."""
        newest = self.manager.latest_step()
        steps = all_processes(-1 if newest is None else newest)
        best = max(steps)
        if best < 0 or best <= (newer_than if newer_than is not None else -1):
            return None
        source = int(np.argmax(steps))  # the lowest process index holding it
        zeros = {k: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), v) for k, v in like.items()}
        host, meta = zeros, None
        if jax.process_index() == source:  # read whole before the others hear of it: a failure is told to all
            meta = self._read_record(best)
            if _unusable(meta, like, run_identity, optimizer) is None:
                try:
                    host = self._read_state(best, zeros)
                except Exception as e:  # noqa: BLE001 (as _read_record)
                    meta = {"error": f"cannot be read ({type(e).__name__}: {_first_line(e)})"}
        meta = broadcast_json(meta, source)
        if why := _unusable(meta, like, run_identity, optimizer):
            _note(f"local checkpoint step {best} of process {source} {why}: resuming from the persistent tier")
            return None
        host = multihost_utils.broadcast_one_to_all(host, is_source=jax.process_index() == source)
        state = jax.tree.map(lambda h, x: jax.make_array_from_callback(x.shape, x.sharding, lambda i: np.asarray(h)[i]),
                             host, like)
        return state, meta, f"local tier of process {source}, {meta.get('local_dir', self.path)}"

    def _read_record(self, step: int) -> dict:
        """The record of `step`, or {"error": ...} where it cannot be read (the others learn it too)."""
        try:
            return {**self._record(step), "local_dir": str(self.path)}
        except Exception as e:  # noqa: BLE001 (Orbax raises many types for a damaged directory; told to all)
            return {"error": f"cannot be read ({type(e).__name__}: {_first_line(e)})"}

    def _record(self, step: int) -> dict:
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def _read_state(self, step: int, zeros: dict) -> dict:
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), zeros)
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(zeros, restore_args=as_numpy))).state

    def drop_after(self, step: int) -> None:
        """Delete this folder's steps after `step`: a resume from an older step abandons them (and a
        later save of the same step number would find them in its way)."""
        for s in self.manager.all_steps():
            if s > step:
                self.manager.delete(s)

    @contextlib.contextmanager
    def _writes(self):
        """A refused write or a full disk in the local dir: one message (Orbax's own is a page)."""
        try:
            yield
        except Exception as e:
            if why := refused_write(e) or ("no space left on the device" if is_disk_full(e) else None):
                raise CheckpointError(f"cannot write a local checkpoint in {self.path} (checkpoint.local_dir): {why}; "
                                      "the persistent checkpoints in run_dir are untouched") from None
            raise

    def close(self) -> None:
        with self._writes():
            self.manager.close()


def _unusable(meta: dict, like: dict, run_identity: dict, optimizer: str) -> str | None:
    """Why a local step's record cannot resume this run (None: it can)."""
    if "error" in meta:
        return meta["error"]
    if changed := changed_keys({k: meta.get("identity", {}).get(k) for k in run_identity}, run_identity):
        return f"belongs to a run with a different {', '.join(changed)}"
    if meta.get("optimizer") != optimizer or sorted(meta.get("state_keys", [])) != sorted(like):
        return f"holds state parts {meta.get('state_keys')} of train.optimizer={meta.get('optimizer')}, not this run's"
    return None


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of a global array on this host: its own copy where replicated here, else gathered."""
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def all_processes(value: int) -> list[int]:
    """`value` of every process, by process index (a collective)."""
    if jax.process_count() == 1:
        return [value]
    return [int(v) for v in np.ravel(multihost_utils.process_allgather(np.int32(value)))]


def broadcast_json(value: dict | None, source: int) -> dict:
    """Process `source`'s `value` on every process (a collective)."""
    if jax.process_count() == 1:
        return value
    me = jax.process_index() == source
    data = json.dumps(value).encode() if me else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data)), is_source=me))
    buf = np.frombuffer(data, np.uint8) if me else np.zeros(size, np.uint8)
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=me))))


def check_not_shared(path: Path) -> None:
    """Refuse, on every process alike, a local dir that another process sees too (one folder on a
    shared disk, or several processes of one machine without "{process}" in it): their saves would
    overwrite each other. Each process leaves a marker named with a token of this launch, then looks
    for the others'."""
    if jax.process_count() == 1:
        return
    token = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(31))))
    mine = path / f".local-tier-process-{jax.process_index()}.{token}"
    mine.touch()
    try:
        multihost_utils.sync_global_devices("local tier markers written")
        seen = sorted(int(p.name.split("-")[-1].split(".")[0]) for p in path.glob(f".local-tier-process-*.{token}"))
        shared = all_processes(int(len(seen) > 1))
        multihost_utils.sync_global_devices("local tier markers read")
    finally:
        mine.unlink(missing_ok=True)
    if any(shared):
        where = f"{path} is seen by processes {seen}" if len(seen) > 1 else "another process's folder is shared"
        raise ConfigError(f"checkpoint.local_dir: {where}: each process needs a folder of its own; put "
                          "{process} (the process index) in it, e.g. checkpoint.local_dir=/local/ckpt/{process}")


def _note(text: str) -> None:
    if jax.process_index() == 0:
        print(f"note: {text}", file=sys.stderr, flush=True)
