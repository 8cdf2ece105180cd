"""boost_jax/model/checkpoint.py: the train state's round trip across meshes, and checkpoints written by
earlier versions (Orbax's StandardSave) still restore."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.model.checkpoint import MIN_REPLICA_SLICE_BYTES, CheckpointStore
from boost_jax.model.train_state import TrainState
from boost_jax.runtime.errors import CheckpointError

IDENTITY = {"model.preset": "llama-tiny"}


def state_on(mesh_shape, big_spec):
    """An 8 MiB array whose save Orbax splits among its replicas (on 8 devices each replica's slice
    is at least MIN_REPLICA_SLICE_BYTES), and small replicated ones that one replica writes whole."""
    mesh = jax.make_mesh(mesh_shape, ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    big = np.random.default_rng(0).standard_normal((MIN_REPLICA_SLICE_BYTES // 4, 8), np.float32)
    small = np.random.default_rng(1).standard_normal((3, 5), np.float32)
    return TrainState(params={"big": jax.device_put(big, NamedSharding(mesh, big_spec)),
                              "small": jax.device_put(small, NamedSharding(mesh, P()))},
                      step=jax.device_put(np.int32(7), NamedSharding(mesh, P())))


@pytest.mark.parametrize("src, dst", [(((4, 2), P("b")), ((2, 4), P(None, "b"))), (((8, 1), P()), ((1, 8), P("b")))])
def test_state_round_trips_onto_another_mesh(tmp_path, src, dst):
    saved = state_on(*src)
    ckpt = CheckpointStore(tmp_path, keep=2)
    ckpt.save(3, saved, {"identity": IDENTITY})
    ckpt.wait()
    like = state_on(*dst)
    restored, meta = ckpt.restore(3, like, IDENTITY)
    ckpt.close()
    assert meta["identity"] == IDENTITY
    assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(lambda x: x.sharding, like)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(saved))


def test_checkpoints_of_earlier_versions_restore(tmp_path):
    """Earlier versions saved the state with Orbax's StandardSave and the default array handler."""
    saved = state_on((4, 2), P("b"))
    manager = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"))
    manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(saved.tree()),
                                            meta=ocp.args.JsonSave({"identity": IDENTITY})))
    manager.wait_until_finished()
    manager.close()
    ckpt = CheckpointStore(tmp_path, keep=2)
    assert ckpt.latest_step() == 5
    restored, _ = ckpt.restore(5, state_on((2, 4), P(None, "b")), IDENTITY)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(saved))
    with pytest.raises(CheckpointError, match="different model.preset"):
        ckpt.restore(5, saved, {"model.preset": "llama-60m"})
    ckpt.close()
