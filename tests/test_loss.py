"""The chunked LM head + cross-entropy (`train.loss_chunk`): the same loss and gradients, less memory."""

import jax
import numpy as np
import pytest

from boost_jax.analysis.program import build, config_for, peak_bytes
from boost_jax.config import ConfigError, load_config


def program(chunk, *overrides, **knobs):
    return build(config_for("llama-tiny", "cola", "btp", dtype="float32", overrides=[f"train.loss_chunk={chunk}", *overrides],
                            **knobs))


def test_chunked_loss_equals_the_whole_under_tp():
    whole, chunked = program(0, tp=2, dp=2, batch_size=4, seq=32), program(8, tp=2, dp=2, batch_size=4, seq=32)
    params = jax.device_put(jax.tree.map(lambda s: np.random.default_rng(0).normal(0, 0.05, s.shape).astype(s.dtype),
                                         whole.params), jax.tree.map(lambda s: s.sharding, whole.params))
    tokens = np.random.default_rng(1).integers(0, whole.cfg.model.vocab_size, (4, 32)).astype(np.int32)
    batch = jax.device_put({"inputs": tokens, "targets": np.roll(tokens, -1, 1)}, whole.batch["inputs"].sharding)
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(p.loss))(params, batch) for p in (whole, chunked))
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


@pytest.mark.slow
def test_chunks_never_hold_the_whole_logits():
    """A vocab of 8192 x 128 positions x batch 16 in fp32 is 64 MiB of logits (with as much again for
    their gradient); in chunks of 16 positions the gradient's peak drops by more than that."""
    peak = {}
    for chunk in (0, 16):
        p = program(chunk, "model.vocab_size=8192", tp=1, batch_size=16, seq=128)
        peak[chunk] = peak_bytes(jax.jit(jax.grad(p.loss)).lower(p.params, p.batch).compile())
    logits = 16 * 128 * 8192 * 4
    assert peak[0] - peak[16] > logits, {c: v / 2**20 for c, v in peak.items()}


def test_a_chunk_that_does_not_divide_the_sequence_is_refused():
    with pytest.raises(ConfigError, match="train.loss_chunk: must be 0 .* or divide train.seq_len=64, got 48"):
        load_config(None, ["train.seq_len=64", "train.loss_chunk=48"])
