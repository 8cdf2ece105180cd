"""Every command fails safe (tests/test_fault_battery.py runs the whole battery): one writer per run dir,
bad values refused by name before any work, files that are not what they should be named, multi-
process settings checked, and the Python API's arguments checked."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from boost_jax import api
from boost_jax.config import ConfigError, ParallelConfig, load_config
from boost_jax.runtime.paths import check_writable_dir, check_writable_file, lock_dir
from boost_jax.training.run import train


def command_error(main, argv) -> str:
    """A command-line main's one-message exit (run_main turns a BoostJaxError into SystemExit)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code not in (0, None)
    return str(e.value.code)


# ----------------------------------------------------------------------------- one writer


def test_a_run_dir_has_one_writer_and_a_dead_holder_is_no_obstacle(tiny_overrides, tmp_path):
    cfg = load_config(None, [*tiny_overrides, "train.steps=2", "train.eval_every=0", "checkpoint.every=0",
                             "parallel.dp=1", f"run_dir={tmp_path / 'run'}"])
    held = lock_dir(tmp_path / "run", "run_dir")
    with pytest.raises(ConfigError, match=rf"run_dir: .*run is in use by another run \(pid {os.getpid()} on "):
        train(cfg, jax.devices()[:1])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything was written
    held.close()
    # A holder killed with SIGKILL leaves its lock file, not its lock.
    code = (f"from boost_jax.runtime.paths import lock_dir\nimport os, signal\nlock_dir({str(tmp_path / 'run')!r}, 'run_dir')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL
    assert len(train(cfg, jax.devices()[:1])["losses"]) == 2


# ----------------------------------------------------------------------------- values, before any work


@pytest.mark.parametrize("argv, needle", [
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--shard-mb", "0"], "--shard-mb must be at least 1"),
    (["--sample-mb", "-1"], "--sample-mb must be at least 1"),
    (["--max-bytes", "-1"], "--max-bytes must be at least 0"),
    (["--vocab-size", "10"], "--vocab-size must be in 260.."),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
])
def test_prepare_refuses_values_by_flag(argv, needle, tmp_path):
    from boost_jax.data.__main__ import main

    (tmp_path / "doc.txt").write_text("text\n")
    assert needle in command_error(main, ["prepare", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "4", "--tp", "3"], "--tp 3: each size must divide --gpus 4"),
    (["--gpus", "4", "--cp", "3"], "--cp 3: each size must divide --gpus 4"),
    (["--gpus", "4", "--pp", "1", "--pp-repeats", "2"], "--pp-repeats > 1 applies to pipelines"),
    (["--gpus", "4", "--top", "0"], "--top must be at least 1"),
    (["--gpus", "4", "--workers", "-1"], "--max-priced and --workers >= 0"),
    (["--gpus", "4", "--pp", "2", "--pp-repeats", "0"], "--pp-repeats 0: each must be at least 1"),
    (["--gpus", "3", "--tp", "1", "--pp", "1", "--cp", "1"], "train.batch_size=8 does not divide"),
])
def test_plan_refuses_searches_that_cannot_give_a_layout(argv, needle):
    from boost_jax.plan import main

    args = ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=8", "train.seq_len=64", *argv]
    assert needle in command_error(main, args)


def test_prepare_of_an_empty_corpus_is_a_data_error_and_writes_nothing(tmp_path):
    from boost_jax.data.__main__ import main

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n")
    error = command_error(main, ["prepare", str(tmp_path / "empty.txt"), str(tmp_path / "blank.txt"), "--out",
                                 str(tmp_path / "out")])
    assert error.startswith("data error: the corpus (2 files") and "empty.txt" in error and "holds no documents with any text" in error
    assert not (tmp_path / "out").exists()


def test_run_dir_commands_refuse_a_negative_step(tmp_path):
    from boost_jax.eval import main

    assert "--step must be a checkpoint's step (>= 0), got -1" in command_error(main, [str(tmp_path), "--step", "-1"])


# ----------------------------------------------------------------------------- files, named


def test_files_that_are_not_what_they_should_be_are_named(tmp_path):
    from boost_jax.config.hardware import HARDWARE_FILE as HARDWARE, load_hardware
    from boost_jax.data.corpus import Skipped, files_corpus
    from boost_jax.runtime.errors import DataError

    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=rf"{binary}: not a YAML text file \(byte 128 is not UTF-8\)"):
        load_config(binary)
    with pytest.raises(ConfigError, match=rf"{binary}: not a YAML text file"):
        load_hardware(binary)
    tile = tmp_path / "hw.yaml"
    tile.write_text(HARDWARE.read_text().replace("gemm_tile: [128, 128]", "gemm_tile: 128", 1))
    with pytest.raises(ConfigError, match=r"gemm_tile must be \[rows, cols\] of positive integers, got 128"):
        load_hardware(tile)
    zst = tmp_path / "corpus.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    with pytest.raises(DataError, match=rf"{zst} cannot be decompressed"):
        list(files_corpus([str(zst)]).documents(Skipped()))


@pytest.mark.parametrize("where, needle", [("a_file/sub", "is a file"), ("/proc/boost_jax_out", "cannot write in /proc")])
def test_outputs_that_cannot_be_written_are_named_before_work(where, needle, tmp_path):
    (tmp_path / "a_file").write_text("x")
    path = where if where.startswith("/") else tmp_path / where
    with pytest.raises(ConfigError, match=needle):
        check_writable_dir(path, "--out")
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        check_writable_file(tmp_path, "--out")


# ----------------------------------------------------------------------------- multi-process settings


@pytest.mark.parametrize("coordinator, needle", [
    ("localhost", "expected host:port"), ("localhost:99999", "expected host:port"), (":4321", "expected host:port"),
])
def test_coordinator_addresses_are_checked_before_the_runtime_starts(coordinator, needle):
    from boost_jax.parallel.mesh import init_distributed

    with pytest.raises(ConfigError, match=needle):
        init_distributed(ParallelConfig(coordinator=coordinator, num_processes=2, process_id=1))
    with pytest.raises(ConfigError, match="0 <= parallel.process_id < num_processes"):
        init_distributed(ParallelConfig(coordinator="localhost:1234", num_processes=2, process_id=2))


@pytest.mark.slow  # a process waiting out its timeout
def test_a_rendezvous_that_never_completes_is_one_message(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "boost_jax.train", "model.preset=llama-tiny",
                           "parallel.coordinator=localhost:23457", "parallel.num_processes=2", "parallel.process_id=0",
                           "parallel.coordinator_timeout_s=5", f"run_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "@ " not in proc.stderr, proc.stderr
    assert "did not join within 5 s (parallel.coordinator_timeout_s)" in proc.stderr
    assert time.monotonic() - t0 < 60


# ----------------------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def model():
    return api.build_model(api.config("llama-tiny"))


@pytest.mark.parametrize("call, needle", [
    (lambda m: api.forward(m, jnp.array([[1, 512]])), r"token id 512 is outside the model's vocabulary \[0, 512\)"),
    (lambda m: api.forward(m, jnp.array([[-1, 2]])), "token id -1 is outside"),
    (lambda m: api.forward(m, jnp.ones((1, 3))), "tokens must be integer ids"),
    (lambda m: api.forward(m, jnp.array([1, 2])), r"tokens must be \[batch, seq\]"),
    (lambda m: api.forward("model", jnp.array([[1]])), "model must be a boost_jax Model"),
    (lambda m: api.build_model("llama-tiny"), "api.build_model takes a Config"),
    (lambda m: api.config("llama-tiny", 3), "each override is a 'section.key=value' string"),
    (lambda m: api.generate(m, [1, 2], max_new_tokens=2), "prompts is a list of token-id lists"),
    (lambda m: api.generate_text(m, None, ["x"], max_new_tokens=2), "tokenizer must be a tokenizers.Tokenizer"),
    (lambda m: api.restore(Path("/nowhere"), step="last"), "step must be a checkpoint's step"),
    (lambda m: api.restore(5), "run_dir must be a path"),
    (lambda m: api.forward(m, jnp.zeros((1, 0), jnp.int32)), "with at least one token"),
    (lambda m: api.generate(m, [[1, 600]], max_new_tokens=2), "token id 600 is outside"),
    (lambda m: api.generate(m, [[1, 2]], max_new_tokens=2, temperature="hot"), "temperature must be a number"),
    (lambda m: api.generate(m, [[1, 2]], max_new_tokens=2, temperature=float("inf")),
     "temperature must be >= 0 and finite .*, got inf"),
    (lambda m: api.generate(m, [[1, 2]], max_new_tokens=10**9),
     r"the longest prompt \(2 tokens\) \+ max_new_tokens=1000000000 is more than max_len=32768 positions"),
    (lambda m: api.generate(m, [[1, 2]], max_new_tokens=7, max_len=8), "is more than max_len=8 positions"),
    (lambda m: train({"model": {}}), "training.run.train takes a Config .*, got dict"),
])
def test_the_api_checks_its_arguments(model, call, needle):
    with pytest.raises(ConfigError, match=needle):
        call(model)
    assert api.forward(model, [[1, 2, 3]]).shape == (1, 3, 512)  # a nested list of ids works


def test_a_benchmark_of_several_runs_stops_with_a_stopped_run(monkeypatch, tiny_overrides, tmp_path):
    """SIGTERM stops the run it reaches (saved); a benchmark that trains several (bench quality,
    checkpoint, data) must not start the next one."""
    from boost_jax.bench.common import train_to_end
    from boost_jax.training import run as train_module

    monkeypatch.setattr(train_module, "train", lambda cfg, devices=None: {"stopped_by": "SIGTERM", "losses": [1.0]})
    cfg = load_config(None, [*tiny_overrides, f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit, match=rf"stopped by SIGTERM: {tmp_path / 'run'} is saved; rerun the same command"):
        train_to_end(cfg)
    monkeypatch.setattr(train_module, "train", lambda cfg, devices=None: {"losses": [1.0]})
    assert train_to_end(cfg) == {"losses": [1.0]}
