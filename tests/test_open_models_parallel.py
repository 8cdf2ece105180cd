"""The open models' switches (Llama 3's RoPE scaling, Qwen2's q/k/v bias; docs/design/hf-models.md)
under every kind of parallelism: BTP, FSDP, the pipeline and context parallelism each equal one
device (fp32, 1e-5 of each tensor's scale), btp with cp in the inner tier, fsdp with the pipeline and one
case each in the slow tier; over the latent caches a model with a bias decodes what the full cache does."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.analysis.program import build
from boost_jax.config import ConfigError, load_config
from boost_jax.layers.kv_cache import empty
from boost_jax.model import Model
from boost_jax.model.weights import in_plan_order, init_params
from boost_jax.parallel import single_device_plan

# original_max_position_embeddings 8: the 32 positions' frequencies fall in all three llama3 bands
ROPE = ("model.rope_scaling={type: llama3, factor: 4.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
        "original_max_position_embeddings: 8}")
BASE = ["model.preset=llama-tiny", "train.batch_size=4", "train.seq_len=32", "parallel.dp=1", "model.qkv_bias=true",
        ROPE]


def with_biases(params: dict) -> dict:
    """The seed's parameters with random q/k/v biases (they start at zero), so that they count."""
    key = iter(jax.random.split(jax.random.key(7), 16))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: 0.5 * jax.random.normal(next(key), x.shape, x.dtype) if path[-1].key == "bias" else x, params)


def loss_and_grads(arch: str, *overrides: str):
    cfg = load_config(None, [*BASE, f"model.arch={arch}", *overrides])
    prog = build(cfg)
    params = in_plan_order(with_biases(init_params(cfg)), cfg, prog.plan)
    params = jax.device_put(params, jax.tree.map(lambda p: p.sharding, prog.params))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 33)).astype(np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, prog.batch["inputs"].sharding)
    value, grads = jax.device_get(jax.jit(jax.value_and_grad(prog.loss))(params, batch))
    order = np.asarray(prog.plan.layer_order(cfg.model.n_layers))  # the model's layer order again
    return value, {**grads, "layers": jax.tree.map(lambda g: g[np.argsort(order)], grads["layers"])}


@functools.cache
def one_device(arch: str, *model: str):
    return loss_and_grads(arch, *model)


# The inner tier: btp with cp, one program; the slow tier: fsdp with the pipeline, and each kind alone.
@pytest.mark.parametrize("arch, overrides", [
    pytest.param("cola", ["parallel.tp=2", "parallel.scheme=btp", "parallel.cp=2", "parallel.cp_attention=ring"],
                 id="btp-cp"),
    pytest.param("dense", ["parallel.fsdp=2", "parallel.pp=2", "train.microbatches=2"], id="fsdp-pipeline",
                 marks=pytest.mark.slow),
    pytest.param("cola", ["parallel.tp=2", "parallel.scheme=btp"], id="btp", marks=pytest.mark.slow),
    pytest.param("dense", ["parallel.fsdp=2", "parallel.tp=2"], id="fsdp", marks=pytest.mark.slow),
    pytest.param("dense", ["parallel.pp=2", "train.microbatches=2"], id="pipeline", marks=pytest.mark.slow),
    pytest.param("cola", ["parallel.cp=2", "parallel.cp_attention=ring"], id="cp", marks=pytest.mark.slow),
])
def test_rope_scaling_and_biases_equal_one_device(arch, overrides):
    value, grads = loss_and_grads(arch, *overrides)
    ref_value, ref_grads = one_device(arch)
    assert value == pytest.approx(ref_value, rel=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert np.abs(grads["layers"]["attn"]["k"]["bias"]).max() > 0  # the bias is trained
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(g - r).max() <= 1e-5 * np.abs(r).max(), (np.abs(g - r).max(), np.abs(r).max())


def test_cp_over_gathered_latents_refuses_a_bias_by_name():
    with pytest.raises(ConfigError, match="parallel.cp_attention: 'latent' rebuilds k and v"):
        load_config(None, [*BASE, "model.arch=cola", "parallel.cp=2", "parallel.cp_attention=latent"])


def test_the_latent_caches_add_the_bias_as_the_full_cache_does():
    """Prefill and three steps through each cache kind of a cola model with biases and llama3 RoPE:
    k's bias on the keys rebuilt from latents, v's after attention (its weights sum to 1)."""
    cfg = load_config(None, [*BASE, "model.arch=cola"]).model
    model = Model(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, with_biases(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    plan = single_device_plan(cfg)
    seq = jax.random.randint(jax.random.key(5), (2, 12), 0, cfg.vocab_size)
    forward = np.asarray(nnx.jit(lambda m, t: m(t, plan=plan))(model, seq))
    step = nnx.jit(lambda m, t, c, p: m.decode(t, c, plan=plan, positions=p))
    for kind in ("full", "latent_v", "latent"):
        cache, out = empty(kind, cfg, 2, 16), []
        for lo, hi in [(0, 9), (9, 10), (10, 11), (11, 12)]:
            x, cache = step(model, seq[:, lo:hi], cache, jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo)))
            out.append(np.asarray(x))
        logits = np.concatenate(out, axis=1)
        assert np.abs(logits - forward).max() <= 1e-5 * np.abs(forward).max(), kind
