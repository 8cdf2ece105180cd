"""The model path takes where its tokens sit from the caller: positions, document segments and a KV
cache. A forward in chunks through a cache is the full forward; packed documents kept apart by
their segment ids are the documents run alone; the pipeline hands each micro-batch its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from boost_jax.config import ConfigError, ModelConfig, load_config
from boost_jax.data.loader import segment_ids
from boost_jax.layers.kv_cache import empty
from boost_jax.model import Model
from boost_jax.model.weights import abstract_model, place_params, relayout_layers
from boost_jax.ops.attention import Positions
from boost_jax.parallel import make_plan, single_device_plan

EOS = 2


def tiny(arch, **kw) -> ModelConfig:
    return ModelConfig(preset="llama-tiny", arch=arch, **kw).resolved()  # GQA: 8 heads, 2 kv heads


@functools.cache
def model_of(arch):
    return Model(tiny(arch), rngs=nnx.Rngs(0))


def full_logits(model, tokens, where=Positions()):
    plan = single_device_plan(model.cfg)
    return nnx.jit(lambda m, t, w: m(t, plan=plan, where=w))(model, tokens, where)


def assert_close(got, want, rtol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert np.abs(got - want).max() <= rtol * np.abs(want).max(), (np.abs(got - want).max(), np.abs(want).max())


# LaX (its crossing too) and dense; svd and cola take the same path as LaX less the crossing.
@pytest.mark.parametrize("arch", ["dense", "lax"])
def test_prefill_then_steps_through_the_cache_equal_the_full_forward(arch):
    """Three rows whose prompts have 10, 7 and 4 tokens, right-padded to 10 with junk, prefilled in one
    forward; then 6 steps, each row one token at its own next position. Every logit equals the full
    forward of that row's true sequence at that position (LaX's latent crossing included)."""
    model, plan = model_of(arch), single_device_plan(tiny(arch))
    lengths, steps, width = np.array([10, 7, 4]), 6, 10
    seqs = np.asarray(jax.random.randint(jax.random.key(1), (3, width + steps), 3, 512))
    want = np.asarray(full_logits(model, seqs))  # row i's tokens are seqs[i, :lengths[i] + steps]
    prompt = np.where(np.arange(width) < lengths[:, None], seqs[:, :width], 511)  # junk after each prompt
    decode = nnx.jit(lambda m, t, c, p: m.decode(t, c, plan=plan, positions=p))
    cache = empty("full", model.cfg, 3, 16)
    logits, cache = decode(model, prompt, cache, jnp.broadcast_to(jnp.arange(width), (3, width)))
    for i, n in enumerate(lengths):
        assert_close(logits[i, :n], want[i, :n])
    for t in range(steps):
        pos = lengths + t
        logits, cache = decode(model, seqs[np.arange(3), pos][:, None], cache, pos[:, None])
        assert_close(logits[:, 0], want[np.arange(3), pos])


def test_a_chunk_of_a_long_sequence_attends_to_the_cached_ones():
    """Chunks of 5, 1 and 8 tokens (a prefill, a step, a chunk) give the full forward's logits."""
    model = model_of("cola")
    plan = single_device_plan(model.cfg)
    seq = jax.random.randint(jax.random.key(2), (2, 14), 0, 512)
    want, cache, got = full_logits(model, seq), empty("full", model.cfg, 2, 14), []
    for lo, hi in [(0, 5), (5, 6), (6, 14)]:
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo))
        logits, cache = nnx.jit(lambda m, t, c, p: m.decode(t, c, plan=plan, positions=p))(model, seq[:, lo:hi], cache, pos)
        got.append(logits)
    assert_close(jnp.concatenate(got, axis=1), want)


def test_document_mask_keeps_packed_documents_apart():
    """A row packing document A (ending in <eos>) and document B: with segment ids, A is unchanged and
    B's logits are B's alone (at positions restarting from 0 they are B's own forward, to float
    rounding; at the window's positions RoPE's relative angles give the same up to its rounding);
    without them B attends to A."""
    model = model_of("cola")
    a = np.array([[5, 9, 33, 47, 12, 80, 6, 101, EOS]])
    b = np.asarray(jax.random.randint(jax.random.key(3), (1, 15), 3, 512))
    row = np.concatenate([a, b], axis=1)
    seg = segment_ids(row, EOS)
    np.testing.assert_array_equal(seg[0], [0] * 9 + [1] * 15)
    alone = full_logits(model, b)[0]
    packed = full_logits(model, row)[0]
    masked = full_logits(model, row, Positions(segments=jnp.asarray(seg)))[0]
    restarted = np.concatenate([np.arange(9), np.arange(15)])[None]
    masked_restarted = full_logits(model, row, Positions(jnp.asarray(restarted), jnp.asarray(seg)))[0]
    np.testing.assert_array_equal(masked[:9], packed[:9])  # A sees only A either way
    assert_close(masked_restarted[9:], alone)
    assert_close(masked[9:], alone, rtol=1e-4)
    assert np.abs(np.asarray(packed[9:]) - np.asarray(alone)).max() > 1e-2 * np.abs(np.asarray(alone)).max()


def test_segment_ids_number_each_rows_documents():
    rows = np.array([[7, EOS, 8, 9, EOS, EOS, 4], [EOS, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_ids(rows, EOS), [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]])


def pipeline_config(pp, micro):
    return load_config(None, ["model.preset=llama-tiny", "model.n_layers=4", "model.arch=cola", f"parallel.pp={pp}",
                              "parallel.tp=2", "parallel.dp=1", f"train.microbatches={micro}", "train.batch_size=4",
                              "data.document_mask=true"])


def masked_loss_and_grads(cfg, devices):
    """Loss and gradients on rows of several documents each (every micro-batch its own segments)."""
    plan = make_plan(cfg, devices)
    graphdef, _ = abstract_model(cfg)
    params = place_params(cfg, plan)
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (4, 32), 0, 24))  # small ids: many <eos>
    seg = jnp.asarray(segment_ids(tokens, EOS))
    assert len(np.unique(np.asarray(seg)[:, -1])) > 1  # the rows differ in their documents

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, plan=plan, where=Positions(segments=seg))
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(tokens, -1, 1)).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    order = plan.layer_order(cfg.model.n_layers)
    return jax.device_get((value, relayout_layers(grads, order, np.arange(len(order)))))


@pytest.mark.slow  # the inner loop checks the context's indexing in tests/test_pipeline.py (a toy pipeline)
def test_a_pipeline_hands_each_microbatch_its_own_segments():
    value, grads = masked_loss_and_grads(pipeline_config(2, 2), jax.devices()[:4])
    ref_value, ref_grads = masked_loss_and_grads(pipeline_config(1, 1), jax.devices()[:2])
    assert value == pytest.approx(ref_value, rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max() + 1e-7


def test_the_attention_implementation_is_the_plans():
    tiny_cfg = lambda *o: load_config(None, ["model.preset=llama-tiny", "train.batch_size=8", *o])
    assert make_plan(tiny_cfg()).attention == "xla"  # auto, on CPU devices
    with pytest.raises(ConfigError, match="model.attention=cudnn needs GPU devices"):
        make_plan(tiny_cfg("model.attention=cudnn"))
    with pytest.raises(ConfigError, match="model.attention: 'flash' is not one of"):
        tiny_cfg("model.attention=flash")
