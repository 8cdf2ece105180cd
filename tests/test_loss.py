"""The cross-entropy (`layers/cross_entropy.py`: one pass over the logits each way) equals optax's
and its autodiff gradient; the chunked LM head + cross-entropy (`train.loss_chunk`): the same loss
and gradients, less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from boost_jax.analysis.program import build, config_for, peak_bytes
from boost_jax.config import ConfigError, load_config


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
@pytest.mark.parametrize("shape", [(3, 7, 33), (2, 5, 1000)])  # odd sizes; a vocab wider than a SIMD row
def test_cross_entropy_equals_optax_and_its_gradient(shape, z_loss):
    from boost_jax.layers.cross_entropy import cross_entropy_sum

    k1, k2, k3 = jax.random.split(jax.random.key(sum(shape)), 3)
    logits = 4 * jax.random.normal(k1, shape)  # spread wide: the max shift matters
    targets = jax.random.randint(k2, shape[:-1], 0, shape[-1])
    weight = jax.random.normal(k3, ())  # a cotangent other than 1

    def reference(x):
        total = optax.softmax_cross_entropy_with_integer_labels(x, targets).sum()
        return total + z_loss * jnp.square(jax.nn.logsumexp(x, axis=-1)).sum()

    ours = lambda x: cross_entropy_sum(x, targets, z_loss)
    assert float(ours(logits)) == pytest.approx(float(reference(logits)), rel=1e-6)
    g, g_ref = (jax.grad(lambda x: weight * f(x))(logits) for f in (ours, reference))
    np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-6 * float(jnp.abs(g_ref).max()) + 1e-7)


def test_the_loss_backward_writes_the_logits_gradient_once():
    """The gradient program of the loss w.r.t. [T, V] logits writes one [T, V] value, the gradient,
    with no zero-filled scatter of the targets (autodiff of optax's loss writes two or three)."""
    from boost_jax.analysis.hlo import parse_module
    from boost_jax.layers.cross_entropy import cross_entropy_sum

    t, v = 64, 512
    logits, targets = jax.ShapeDtypeStruct((t, v), jnp.float32), jax.ShapeDtypeStruct((t,), jnp.int32)

    def written(f) -> tuple[int, str]:
        text = jax.jit(jax.grad(f)).lower(logits, targets).compile().as_text()
        comps, entry, _ = parse_module(text)
        return sum(i.shape.startswith(f"f32[{t},{v}]") for i in comps[entry].instrs.values()
                   if i.op not in ("parameter", "get-tuple-element", "tuple", "bitcast")), text

    ours, text = written(lambda x, y: cross_entropy_sum(x, y))
    theirs, reference = written(lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).sum())
    assert ours == 1 and "scatter" not in text
    assert theirs >= 2 and "scatter" in reference  # the check sees what it rules out


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
