"""The parallel plan and the scheme / arch tables: strict logical names, knobs refused where they do
nothing, and no hidden state choosing a code path."""

from pathlib import Path

import jax
import pytest

from boost_jax.config import ConfigError, load_config
from boost_jax.config.archs import ARCHS
from boost_jax.config.schemes import KNOB_DEFAULTS, LOGICAL_AXES, SCHEMES
from boost_jax.parallel import abstract_plan, make_plan, single_device_plan
from boost_jax.parallel.projections import STRATEGIES, BTPProjections, MegatronProjections, VanillaProjections


def tiny(*overrides):
    return load_config(None, ["model.preset=llama-tiny", "train.batch_size=8", *overrides])


@pytest.fixture(scope="module")
def btp_plan():
    return make_plan(tiny("parallel.tp=4"))  # dp=2 x tp=4 on the 8 simulated devices


def test_misspelt_logical_axis_raises(btp_plan):
    with pytest.raises(ValueError, match="unknown logical axis 'act_embd'"):
        btp_plan.spec(("batch", "seq", "act_embd"))
    assert btp_plan.spec(("batch", "seq", "act_embed")) == jax.sharding.PartitionSpec(("dp", "fsdp"), "cp", "tp")


def test_two_dimensions_on_one_mesh_axis_raise(btp_plan):
    # Under btp both d (embed) and heads are split over tp: a tensor cannot have both split.
    with pytest.raises(ValueError, match="dimensions 0 and 1 both map to mesh axis 'tp'"):
        btp_plan.spec(("embed", "heads"))


def test_scheme_table_is_consistent():
    for scheme in SCHEMES.values():
        assert set(scheme.rules) <= LOGICAL_AXES, scheme.name
        assert set(scheme.archs) <= set(ARCHS), scheme.name
        assert set(scheme.knobs) <= set(KNOB_DEFAULTS), scheme.name
    # Every arch has a scheme, and every scheme its projection strategy (and no strategy lacks a scheme).
    assert set(ARCHS) == {a for s in SCHEMES.values() for a in s.archs}
    assert list(STRATEGIES) == list(SCHEMES)


@pytest.mark.parametrize("overrides, needle", [
    (["model.arch=cola", "parallel.scheme=vanilla", "model.kernels=pallas"],
     "model.kernels: 'pallas' has no effect under parallel.scheme=vanilla"),
    (["model.arch=dense", "model.norm=sync"], "model.norm: 'sync' has no effect under parallel.scheme=megatron"),
    (["model.arch=svd", "parallel.scheme=vanilla", "model.norm=sync"],
     "model.norm: 'sync' has no effect under parallel.scheme=vanilla"),
    (["model.attn_rank=0"], "model.attn_rank: must be a positive integer, got 0 (null means the default"),
    (["model.mlp_rank=0"], "model.mlp_rank: must be a positive integer, got 0"),
])
def test_knobs_without_effect_and_zero_ranks_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        tiny(*overrides)


def test_null_rank_is_the_default():
    assert tiny("model.attn_rank=null").model.attn_rank == 64 // 4


def test_single_device_is_a_plan_with_one_device():
    cfg = tiny("model.arch=lax")
    plan = single_device_plan(cfg.model)
    assert plan.mesh.size == 1 and plan.scheme.name == "btp" and plan.projections is BTPProjections
    assert single_device_plan(tiny("model.arch=dense").model).projections is MegatronProjections
    assert single_device_plan(cfg.model, "vanilla").projections is VanillaProjections


def test_an_abstract_plan_takes_the_default_dp_as_one():
    """`bench memory model.preset=llama-7b parallel.tp=4` (dp left at its default, -1: fill the
    devices) prices one data-parallel replica, as a benchmark simulates it."""
    cfg = load_config(None, ["model.preset=llama-7b", "parallel.tp=4", "train.batch_size=4"])
    assert cfg.parallel.dp == -1
    assert abstract_plan(cfg).mesh.shape == {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 4}


def test_no_module_state_chooses_a_code_path():
    src = Path(__file__).parents[1] / "boost_jax"
    offenders = [str(p) for p in src.rglob("*.py") if "contextvars" in p.read_text() or "ContextVar" in p.read_text()]
    assert offenders == []


def test_a_new_scheme_is_a_table_entry_and_a_strategy(monkeypatch):
    """docs/design.md's worked example, for a low-rank model: a scheme that replicates every weight
    over tp (a table entry: its rules) running the vanilla strategy equals one device, with nothing
    changed in the layers or the model."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from boost_jax.model import Model
    from boost_jax.parallel.plan import Plan

    base = SCHEMES["vanilla"]
    replicated = dataclasses.replace(base, name="replicated", rules={k: v for k, v in base.rules.items()
                                                                     if k in ("batch", "layers")})
    monkeypatch.setitem(STRATEGIES, "replicated", VanillaProjections)
    cfg = tiny("model.arch=cola", "parallel.tp=4")
    mesh = make_plan(cfg).mesh
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (8, 16)))
    run = lambda plan: nnx.jit(lambda m, t: m(t, plan=plan))(Model(cfg.model, rngs=nnx.Rngs(0)), tokens)
    got = run(Plan(mesh, replicated, replicated.rules))
    want = run(single_device_plan(cfg.model))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
