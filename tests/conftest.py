"""Tests run on CPU with 8 simulated devices, so every mesh shape can be exercised on a laptop."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many small programs, and compiling is most of their time. Two CPU-only switches
# make a tiny sharded train step compile ~3x faster (the suite: 12.8 -> 6.1 min on 2 cores):
# - LLVM at -O0: the optimised HLO is byte-identical;
# - XLA's elemental fusion emitter instead of the MLIR fusion emitters: fusion boundaries move a
#   little, while the collectives, shardings and GEMMs the tests inspect are identical and the
#   compiled peak memory agrees to < 0.01% (llama-60m cola/btp tp=2). The suite passes with either;
#   `XLA_FLAGS=--xla_backend_optimization_level=0 pytest` runs it on the emitters users get.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")

# One persistent XLA compilation cache, shared by the xdist workers, the subprocesses they start
# (jax reads these variables) and the runs after this one: tests compile many identical programs
# (parameter init, optimizer init, the same tiny train step), and each is compiled once, not once per
# run (the inner tier on 2 cores: 5 min 27 s from a fresh clone, 3 min 21 s the next time). The key
# is the program, its options and the jax/XLA version, so an edit recompiles what it changed; past
# 1 GiB of old programs the folder starts again. It is one of pytest's cache folders, so a cold run
# is `pytest --cache-clear`.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA = Path(__file__).parent.parent / ".pytest_cache" / "d" / "xla"
    if "PYTEST_XDIST_WORKER" not in os.environ and _XLA.is_dir():  # the run's first process, before any compile
        if sum(f.stat().st_size for f in _XLA.iterdir()) > 2**30:
            shutil.rmtree(_XLA, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_XLA)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Likewise one data cache (tokenizer, token arrays, the CPU's measured matmul peak) for the whole
# run: each is built once, not once per worker (boost_jax/data/build.py locks: concurrent builders wait).
if "BOOST_JAX_TEST_DATA_CACHE" not in os.environ:
    os.environ["BOOST_JAX_TEST_DATA_CACHE"] = _DATA = tempfile.mkdtemp(prefix="boost_jax_test_data_")
    atexit.register(shutil.rmtree, _DATA, ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def cache_dir():
    """The run's one data cache, shared by the xdist workers and the processes they start."""
    return Path(os.environ["BOOST_JAX_TEST_DATA_CACHE"])


@pytest.fixture(scope="session")
def tiny_overrides(cache_dir):
    """A run that trains in seconds: llama-tiny on 300 kB of the stdlib corpus. Without the health
    norms, which are most of the train step's compile time (the factors' power iterations): the
    tests of health pass log.health=true."""
    return [
        "model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "train.lr=1e-2",
        "train.warmup_steps=2", "train.eval_batches=2", "data.max_bytes=300000",
        f"data.cache_dir={cache_dir}", "log.progress=false", "log.tensorboard=false", "log.every=5",
        "log.health=false",
    ]


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory, tiny_overrides):
    """One cola run dir for the session's read-only tests (eval, generate, weights; a test that changes
    it works on a copy): 4 steps, evaluated and checkpointed at step 4, with its tokenizer."""
    return train_tiny(tmp_path_factory.mktemp("tiny") / "run", tiny_overrides, "train.eval_every=4")


def train_tiny(path, tiny_overrides, *extra):
    """A llama-tiny run dir at `path`, 4 steps on one device, checkpointed at step 4 (`extra`: more overrides)."""
    from boost_jax.config import load_config
    from boost_jax.training.run import train

    train(load_config(None, [*tiny_overrides, f"run_dir={path}", "train.steps=4", "checkpoint.every=4",
                             "train.eval_every=0", "parallel.dp=1", *extra]), jax.devices()[:1])
    return path
