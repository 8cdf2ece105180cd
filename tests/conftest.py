"""Tests run on CPU with 8 simulated devices, so every mesh shape can be exercised on a laptop."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many small programs: skip LLVM's expensive optimisations (2-3x faster compiles).
# This changes only CPU code generation speed, not the HLO (collectives, shardings) tests inspect.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One data cache (tokenizers, token arrays) shared by the whole session."""
    return tmp_path_factory.mktemp("boost_jax_cache")


@pytest.fixture(scope="session")
def tiny_overrides(cache_dir):
    """A run that trains in seconds: llama-tiny on 300 kB of the stdlib corpus."""
    return [
        "model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "train.lr=1e-2",
        "train.warmup_steps=2", "train.eval_batches=2", "data.max_bytes=300000",
        f"data.cache_dir={cache_dir}", "log.progress=false", "log.tensorboard=false", "log.every=5",
    ]
