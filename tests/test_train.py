"""End-to-end training: loss falls, outputs are written, resume is exact, bad runs fail early."""

import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from boost_jax import api
from boost_jax.config import ConfigError, load_config
from boost_jax.launch.startup import Startup
from boost_jax.model.checkpoint import CheckpointError
from boost_jax.training.run import train


def run(tmp_path, tiny_overrides, *extra, name="run", devices=None):
    cfg = load_config(None, [*tiny_overrides, f"run_dir={tmp_path / name}", *extra])
    return train(cfg, devices), tmp_path / name


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 40 steps
def test_loss_falls_and_outputs_are_written(tmp_path, tiny_overrides):
    out, run_dir = run(tmp_path, tiny_overrides, "train.steps=40", "train.eval_every=20",
                       "checkpoint.every=20", "log.tensorboard=true")
    losses = out["losses"]
    assert len(losses) == 40
    assert losses[0] == pytest.approx(np.log(512), abs=0.15)  # uniform at init
    assert np.mean(losses[-5:]) < losses[0] - 1.0
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops_per_s", "mfu"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert rows[19]["eval_loss"] < np.log(512) and rows[19]["eval_ppl"] == pytest.approx(np.exp(rows[19]["eval_loss"]))
    assert "eval_loss" in rows[39] and "eval_loss" not in rows[20]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["20", "40"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert load_config(run_dir / "config.yaml") == load_config(None, [*tiny_overrides, f"run_dir={run_dir}",
                                                                         "train.steps=40", "train.eval_every=20",
                                                                         "checkpoint.every=20", "log.tensorboard=true"])


@pytest.mark.slow
def test_resume_is_bitwise_exact(tmp_path, tiny_overrides):
    common = ["train.schedule_steps=12", "checkpoint.every=4", "train.eval_every=0"]
    full, _ = run(tmp_path, tiny_overrides, *common, "train.steps=12", name="full")
    # Interrupted at step 7: the newest checkpoint is step 4 (saves at 4 and at the end, 7).
    first, run_dir = run(tmp_path, tiny_overrides, *common, "train.steps=7", name="split")
    assert first["losses"] == full["losses"][:7]
    (run_dir / "checkpoints" / "7").rename(tmp_path / "moved-7")  # as if it crashed before saving 7
    second, _ = run(tmp_path, tiny_overrides, *common, "train.steps=12", name="split")
    assert second["start_step"] == 4
    assert second["losses"] == full["losses"][4:]  # bitwise equal floats
    assert [r["loss"] for r in metrics(run_dir)] == full["losses"]  # repeated steps were rewritten
    # The restored model is the trained one.
    cfg, model, step = api.restore(run_dir)
    assert step == 12 and cfg.train.steps == 12


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, tiny_overrides):
    """A run dir trained 2 steps, checkpointed at 2. Tests work on copies."""
    return run(tmp_path_factory.mktemp("two_steps"), tiny_overrides, "train.steps=2", "checkpoint.every=2",
               "train.eval_every=0")[1]


@pytest.fixture
def run_dir(two_steps, tmp_path):
    return shutil.copytree(two_steps, tmp_path / "run")


def test_resume_refuses_a_different_model(tmp_path, tiny_overrides, run_dir):
    before = sorted(p.name for p in run_dir.rglob("*"))
    config = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="different model"):
        run(tmp_path, tiny_overrides, "train.steps=4", "model.arch=svd")
    assert sorted(p.name for p in run_dir.rglob("*")) == before and (run_dir / "config.yaml").read_text() == config


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_resume_may_move_the_compile_cache_and_times_its_first_step(tmp_path, tiny_overrides, capsys, run_dir):
    cfg = load_config(None, [*tiny_overrides, f"run_dir={run_dir}", "train.steps=3", "checkpoint.every=2",
                             "train.eval_every=0", "data.compile_cache=false", f"data.compile_cache_dir={tmp_path}"])
    assert train(cfg, startup=Startup())["start_step"] == 2
    assert re.search(r"start-up: [0-9.]+ s to the first step = import [0-9.]+ \+ data [0-9.]+ \+ restore [0-9.]+ \+ "
                     r"compile [0-9.]+ \+ run [0-9.]+", capsys.readouterr().err)


def test_corrupt_checkpoint_is_reported_not_overwritten(tmp_path, tiny_overrides, run_dir):
    for f in (run_dir / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="checkpoint step 2"):
        run(tmp_path, tiny_overrides, "train.steps=4", "checkpoint.every=2", "train.eval_every=0")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]


def test_data_parallel_matches_one_device(tmp_path, tiny_overrides):
    args = ["train.steps=3", "checkpoint.every=0", "train.eval_every=0"]
    dp8, _ = run(tmp_path, tiny_overrides, *args, "parallel.dp=8", name="dp8")
    one, _ = run(tmp_path, tiny_overrides, *args, name="one", devices=jax.devices()[:1])
    np.testing.assert_allclose(dp8["losses"], one["losses"], rtol=1e-5)


def test_indivisible_batch_fails_early(tmp_path, tiny_overrides):
    with pytest.raises(ConfigError, match="batch_size=6 must divide by dp x fsdp = 8"):
        run(tmp_path, tiny_overrides, "train.batch_size=6")


def test_cli_reports_config_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "boost_jax.train", "model.achr=cola"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "model.achr" in proc.stderr and "model.arch" in proc.stderr
    assert not (tmp_path / "runs").exists()  # failed before any work
