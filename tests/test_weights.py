"""boost_jax/model/weights.py: a checkpoint's parameters are read alone (Orbax never deserializes an
optimizer moment) straight into a plan's shardings, whatever layout trained them; a run dir whose
newest checkpoint holds no parameters, or belongs to another model, and a serving mesh that does
not divide the model are each one message from every inference command, with nothing written."""

import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx

from boost_jax import api, eval as boost_eval, generate
from boost_jax.model.checkpoint import CheckpointStore
from boost_jax.model.train_state import TrainState
from boost_jax.model.weights import param_shardings, restore_params
from boost_jax.parallel import make_plan
from boost_jax.runtime.errors import CheckpointError
from boost_jax.training.evaluate import evaluate


@pytest.fixture(scope="module")
def run_dir(tiny_run_dir):
    """A cola run dir trained 4 steps on one device, checkpointed at step 4."""
    return tiny_run_dir


def test_restoring_reads_the_parameters_alone_into_the_plans_shardings(run_dir, monkeypatch):
    read = []
    deserialize = ocp.type_handlers.ArrayHandler.deserialize

    async def recording(self, infos, args=None):
        read.extend(info.name for info in infos)
        return await deserialize(self, infos, args)

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", recording)
    cfg = api.run_config(run_dir, ["parallel.tp=2", "parallel.dp=1"])
    plan = make_plan(cfg, jax.devices()[:2])
    params, step = restore_params(run_dir, cfg, plan)
    # The checkpoint holds the optimizer's moments (twice the parameters' bytes in AdamW) ...
    ckpt = CheckpointStore(run_dir / "checkpoints", 1, read_only=True)
    saved = ckpt.manager.item_metadata(4)["state"].tree
    ckpt.close()
    assert step == 4 and jax.tree.leaves(saved["opt_state"])
    # ... and only the parameters were read, every one of them.
    assert sorted(read) == sorted("params." + ".".join(path) for path, _ in _flat(saved["params"]))
    assert jax.tree.map(lambda x: x.sharding, params) == param_shardings(cfg, plan)
    embed = params["embed"]  # vocab-parallel: each device holds its half of the rows
    assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0] // 2, embed.shape[1])}
    _, one, _ = api.restore(run_dir)  # the same values as on one device
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params),
                 jax.device_get(nnx.to_pure_dict(nnx.state(one, nnx.Param))))


def _flat(tree, prefix=()):
    for k, v in tree.items():
        yield from (_flat(v, (*prefix, k)) if isinstance(v, dict) else [((*prefix, k), v)])


def snapshot(path):
    """Every file under `path` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


def no_params_at_newest(run):
    """A newer checkpoint (step 6) whose state holds the step counter alone: no parameters."""
    ckpt = CheckpointStore(run / "checkpoints", 3)
    meta = ckpt.manager.restore(4, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    ckpt.save(6, TrainState(params=None, step=jax.numpy.asarray(6, jax.numpy.int32)), {**meta, "step": 6})
    ckpt.wait()
    ckpt.close()


def another_vocabulary(run):
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["model"]["vocab_size"] = 1024
    (run / "config.yaml").write_text(yaml.safe_dump(raw))


@pytest.mark.parametrize("damage, args, needle", [
    (no_params_at_newest, [], "checkpoint error: checkpoint step 6 in .* holds no params"),
    (another_vocabulary, [], r"different model.vocab_size \(model.vocab_size: 512 in the checkpoint, 1024 now\)"),
    (None, ["parallel.tp=3", "parallel.dp=1"], r"model.vocab_size=512 must divide by tp x pp = 3"),
])
def test_inference_commands_refuse_bad_input_in_one_message_writing_nothing(run_dir, tmp_path, damage, args, needle):
    run = shutil.copytree(run_dir, tmp_path / "run")
    if damage:
        damage(run)
    before = snapshot(run)
    for command, flags in ((generate.main, ["--prompt", "def main(", "--max-new-tokens", "2"]),
                           (boost_eval.main, ["--max-tokens", "100"])):
        with pytest.raises(SystemExit) as e:
            command([str(run), *flags, *args])
        assert isinstance(e.value.code, str)  # the message, exit status 1 (cli.run_main)
        assert "Traceback" not in e.value.code and len(e.value.code.splitlines()) <= 2, e.value.code
        assert e.value.code.startswith(("config error", "checkpoint error")), e.value.code
        assert re.search(needle, e.value.code), e.value.code
    assert snapshot(run) == before


def test_api_restore_names_a_checkpoint_without_parameters(run_dir, tmp_path):
    run = shutil.copytree(run_dir, tmp_path / "run")
    no_params_at_newest(run)
    with pytest.raises(CheckpointError, match=r"holds no params \(its state parts are \['step'\]\)"):
        api.restore(run)
    assert api.restore(run, step=4)[2] == 4  # an older checkpoint still serves


@pytest.mark.slow  # a pipelined training run: ~30 s
def test_a_pipelined_run_is_served_on_another_layout(tmp_path, tiny_overrides, capsys):
    """A checkpoint stores the layers in the pipeline's order; restored for tp=2 (and for one device)
    they are back in the model's: eval equals the training loop's own eval at that step, and both
    layouts generate the same tokens."""
    import json

    from boost_jax.config import load_config
    from boost_jax.training.run import train

    run = tmp_path / "pp"
    train(load_config(None, [*tiny_overrides, f"run_dir={run}", "train.steps=4", "checkpoint.every=4",
                             "train.eval_every=4", "parallel.dp=1", "parallel.pp=2", "parallel.pp_repeats=2",
                             "model.n_layers=4", "train.microbatches=2"]), jax.devices()[:2])
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]
    for layout in (["parallel.pp=1", "parallel.pp_repeats=1", "parallel.tp=2"], ["parallel.pp=1", "parallel.pp_repeats=1"]):
        assert evaluate(run, layout)["loss"] == pytest.approx(logged, rel=1e-5)
    outs = []
    for layout in (["parallel.pp=1", "parallel.pp_repeats=1", "parallel.tp=2"], ["parallel.pp=1", "parallel.pp_repeats=1"]):
        generate.main([str(run), "--prompt", "def main(", "--max-new-tokens", "8", "--json", *layout])
        outs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outs[0] == outs[1] and outs[0][0]
