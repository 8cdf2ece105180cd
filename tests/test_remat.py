"""Activation checkpointing presets: what each keeps, and that low-rank checkpointing never
recomputes a collective (docs/design.md section 6)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.analysis.comm import measure
from boost_jax.analysis.program import build, config_for
from boost_jax.config import load_config
from boost_jax.model import Model, loss_fn
from boost_jax.parallel import single_device_plan


def saved_per_layer(arch: str, mode: str, capsys) -> list[str]:
    """Shapes of the activations the scanned layer saves for the backward pass."""
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}"])
    graphdef, params = nnx.split(Model(cfg.model, rngs=nnx.Rngs(0)))
    t = jnp.zeros((3, 16), jnp.int32)
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: loss_fn(nnx.merge(graphdef, p), {"inputs": t, "targets": t}, single_device_plan(cfg.model), mode),
        params)
    lines = capsys.readouterr().out.splitlines()
    # Stacked over the 2 layers (leading 2); the scan's final carry [3, 16, 64] is not per layer.
    return sorted(m.group(1) for line in lines if "output of scan" in line
                  and (m := re.match(r"(f32\[2,\S+)", line)))


def test_lowrank_saves_exactly_the_all_reduce_outputs_and_residuals(capsys):
    # llama-tiny: d=64, r=16, T=3*16. Per layer: the post-all-reduce buffers of q|k|v (+1 norm
    # statistic column), o, gate|up (+1), down, and the residual after attention and after the MLP.
    latents = ["f32[2,48,49]", "f32[2,48,16]", "f32[2,48,33]", "f32[2,48,16]"]
    assert saved_per_layer("cola", "lowrank", capsys) == sorted(latents + ["f32[2,3,16,64]"] * 2)
    # Without the fused btp path (dense) nothing is low-rank: only the residuals are saved.
    assert saved_per_layer("dense", "lowrank", capsys) == ["f32[2,3,16,64]"] * 2


def test_full_saves_only_layer_inputs_and_none_saves_more(capsys):
    assert saved_per_layer("cola", "full", capsys) == ["f32[2,3,16,64]"]
    assert len(saved_per_layer("cola", "none", capsys)) > 6


@pytest.mark.parametrize("arch", ["lax", pytest.param("dense", marks=pytest.mark.slow)])
def test_remat_keeps_the_gradients(arch):
    """Both presets' gradients are those of no remat (the reference computed once for the two)."""
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}"])
    graphdef, params = nnx.split(Model(cfg.model, rngs=nnx.Rngs(0)))
    t = jax.random.randint(jax.random.key(0), (2, 16), 0, 512)
    plan = single_device_plan(cfg.model)
    grad = lambda m: jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), {"inputs": t, "targets": t}, plan, m)))(params)
    want = jax.tree.leaves(grad("none"))
    for mode in ("lowrank", "full"):
        for a, b in zip(want, jax.tree.leaves(grad(mode))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=mode)


def backward(scheme, mode):
    cfg = config_for("llama-tiny", "cola", scheme, tp=4, batch_size=4, seq=64, dtype="bfloat16",
                     overrides=["model.n_kv_heads=8", f"train.remat={mode}"])
    r = measure(build(cfg))
    return r["layer_backward_collectives"], r["layer_backward_bytes"]


def test_btp_lowrank_recomputes_no_collective():
    none, lowrank, full = (backward("btp", m) for m in ("none", "lowrank", "full"))
    assert lowrank == none  # the saved latents are the all-reduce outputs
    assert full[0] > none[0] and full[1] > none[1]  # full remat repeats the forward all-reduces
