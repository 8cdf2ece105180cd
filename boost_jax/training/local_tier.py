"""`checkpoint.local_dir`: the frequent tier of a run's checkpoints, on each host's own disk.

Every `checkpoint.local_every` steps each process keeps a whole copy of the train state (host arrays;
gathered first where the state is sharded over processes) with its JSON record, through an Orbax
CheckpointManager of its own (active_processes = this process: no barrier with a peer, so a lost
peer's folder is never waited for). Every host holding the whole state is the replication: any one
survivor's folder restores the run, on any number of processes and any mesh. The lowest process holding
the newest local step reads it and broadcasts it to the others (jax.experimental.multihost_utils); a
copy it cannot read gives way to the next process's copy of that step, then to older steps.

Why not Orbax's own emergency CheckpointManager: docs/design.md, "Two checkpoint tiers".
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from boost_jax.config import Config
from boost_jax.config.config import LOCAL_DIR_PROCESS
from boost_jax.model.checkpoint import _first_line, changed_keys, listed
from boost_jax.model.train_state import TrainState
from boost_jax.runtime.errors import CheckpointError, ConfigError
from boost_jax.runtime.paths import check_writable_dir, is_disk_full, refused_write

# The step being written and the newest committed one: a kill mid-save leaves the older one whole.
LOCAL_KEEP = 2

# Orbax writes a numpy array from process 0 only (NumpyHandler: "replicated numpy arrays"), which left
# every other process's local step without its arrays, and refuses an array on one process's device
# alone. An array replicated on a CPU device of each process, written with no primary host and no
# replica choice (the handler Orbax's emergency manager gives its local tier), puts this process's copy
# in this process's folder; numpy's handler reads it back to the host.
EVERY_PROCESS = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)),
    (np.ndarray, ocp.type_handlers.NumpyHandler()))


def local_path(template: str) -> Path:
    """`checkpoint.local_dir` of this process: "{process}" is its index."""
    return Path(template.replace(LOCAL_DIR_PROCESS, str(jax.process_index()))).expanduser().absolute()


class LocalTier:
    """One process's folder of local checkpoints. Making one, `restore` and `save` of a gathered
    state are collectives: every process calls them at the same point."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.path, self.run_dir = local_path(cfg.checkpoint.local_dir), str(Path(run_dir).absolute())
        check_writable_dir(self.path, "checkpoint.local_dir")
        self.path.mkdir(parents=True, exist_ok=True)
        check_not_shared(self.path)
        me = jax.process_index()
        self.cpus = {d.process_index: d for d in reversed(jax.devices("cpu"))}  # the first CPU device of each
        self.replicated = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array([self.cpus[p] for p in sorted(self.cpus)]), ("process",)),
            jax.sharding.PartitionSpec())
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                                   barrier_sync_key_prefix=f"local-tier-{me}")
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, handler, args in (
                ("state", ocp.PyTreeCheckpointHandler(multiprocessing_options=alone,
                                                      type_handler_registry=EVERY_PROCESS),
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

    def save(self, step: int, state: TrainState, meta: dict) -> None:
        """Keep step `step`: the state copied to this host (a collective where it is sharded over
        processes), written in the background."""
        state = state.tree()
        host = jax.tree.map(lambda x: self._copy(to_host(x)), state)
        with self._writes():
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(host),
                meta=ocp.args.JsonSave({**meta, "run_dir": self.run_dir, "state_keys": sorted(state)})))

    def _copy(self, host: np.ndarray) -> jax.Array:
        """`host` as one array replicated on a CPU device of each process, this process's copy its own:
        Orbax writes that copy here (a host-local array it refuses under several processes)."""
        local = jax.device_put(host, self.cpus[jax.process_index()])
        return jax.make_array_from_single_device_arrays(host.shape, self.replicated, [local])

    def restore(self, like: TrainState, newer_than: int | None, run_identity: dict, optimizer: str
                ) -> tuple[TrainState, dict, str] | None:
        """(state laid out like `like`, its record, where it came from) of the newest local step that
        any process can restore whole and this run's setup made, if newer than `newer_than` (the
        persistent tier's newest: it wins a tie); else None. A copy that cannot be read (damaged, cut
        short) or is another setup's gives way, with a line on stderr, to the same step in the next
        process's folder, then to older steps, then to the persistent tier."""
        like, floor = like.tree(), newer_than if newer_than is not None else -1
        held = all_processes_steps([s for s in self.manager.all_steps() if s > floor])
        # Newest step first, and of a step the lowest process index holding it.
        candidates = sorted(((s, p) for p, steps in enumerate(held) for s in steps), key=lambda sp: (-sp[0], sp[1]))
        zeros = {k: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), v) for k, v in like.items()}
        for i, (step, source) in enumerate(candidates):
            host, meta = zeros, None
            if jax.process_index() == source:  # read whole before the others hear of it: a failure is told to all
                meta = self._read_record(step)
                if _unusable(meta, like, run_identity, optimizer) is None:
                    try:
                        host = self._read_state(step, zeros)
                    except Exception as e:  # noqa: BLE001 (as _read_record)
                        meta = {"error": f"cannot be read ({type(e).__name__}: {_first_line(e)})"}
            meta = broadcast_json(meta, source)
            if why := _unusable(meta, like, run_identity, optimizer):
                after = (f"trying step {candidates[i + 1][0]} of process {candidates[i + 1][1]}"
                         if i + 1 < len(candidates) else "resuming from the persistent tier"
                         if newer_than is not None else "starting from step 0")
                _note(f"local checkpoint step {step} of process {source} {why}: {after}")
                continue
            host = multihost_utils.broadcast_one_to_all(host, is_source=jax.process_index() == source)
            state = jax.tree.map(lambda h, x: jax.make_array_from_callback(
                x.shape, x.sharding, lambda idx: np.asarray(h)[idx]), host, like)
            return TrainState.of(state), meta, f"local tier of process {source}, {meta.get('local_dir', self.path)}"
        return None

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


def all_processes_steps(steps: list[int]) -> list[list[int]]:
    """`steps` of every process, by process index (a collective)."""
    if jax.process_count() == 1:
        return [list(steps)]
    width = max(all_processes(len(steps)))
    if width == 0:
        return [[] for _ in range(jax.process_count())]
    padded = np.full(width, -1, np.int32)
    padded[:len(steps)] = steps
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, width)
    return [[int(s) for s in row if s >= 0] for row in gathered]


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
