"""The typed train state (model/train_state.py): a checkpoint written when the state was a plain dict
(`{"params", "opt_state", "step", "rng"}` and with train.spike_skip `"spike"`) restores through it,
bitwise, because its checkpoint layout is that dict."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from boost_jax.config import load_config
from boost_jax.model.checkpoint import CheckpointStore, identity
from boost_jax.model.train_state import TrainState
from boost_jax.parallel import make_plan
from boost_jax.training.checkpointing import Checkpointing
from boost_jax.training.loss import device_batch
from boost_jax.training.step import setup


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_checkpoint_of_the_dict_layout_restores_bitwise(tmp_path, tiny_overrides):
    cfg = load_config(None, [*tiny_overrides, f"run_dir={tmp_path / 'run'}", "train.steps=4", "checkpoint.every=1",
                             "train.eval_every=0", "train.spike_skip=3", "train.spike_window=4", "parallel.dp=2"])
    run, state = setup(cfg, make_plan(cfg, jax.devices()[:2]))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 64), dtype=np.int32)
    trained, _ = run.train_step(state, device_batch({"inputs": tokens, "targets": tokens}, run.batch_sharding))
    host = jax.device_get(trained)
    # The checkpoint as the dict-state code wrote it: Orbax's pytree of a plain dict, and the JSON record.
    legacy = {"params": trained.params, "opt_state": trained.opt_state, "step": trained.step, "rng": trained.rng,
              "spike": trained.spike}
    record = {"step": 1, "data_position": cfg.train.batch_size, **run.checkpoint_meta(), "loss": None,
              "identity": identity(cfg.to_dict()), "optimizer": cfg.train.optimizer}
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep=2)
    store.manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(legacy), meta=ocp.args.JsonSave(record)))
    store.close()

    _, fresh = setup(cfg, make_plan(cfg, jax.devices()[:2]))
    ckpt = Checkpointing(cfg, run, tmp_path / "run")
    restored, step = ckpt.resume(fresh)
    ckpt.close()
    assert step == 1 and isinstance(restored, TrainState) and restored.spike is not None
    assert jax.tree.structure(restored) == jax.tree.structure(host)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), host)
    assert jax.tree.map(lambda x: x.sharding, restored) == run.state_shardings

