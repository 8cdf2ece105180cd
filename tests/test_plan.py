"""The parallel plan and the scheme / arch tables: strict logical names, knobs refused where they do
nothing, and no hidden state choosing a code path."""

from pathlib import Path

import jax
import pytest

from boost_jax.archs import ARCHS
from boost_jax.config import ConfigError, load_config
from boost_jax.parallel import SCHEMES, make_plan, single_device_plan
from boost_jax.parallel.schemes import KNOB_DEFAULTS, LOGICAL_AXES


def tiny(*overrides):
    return load_config(None, ["model.preset=llama-tiny", "train.batch_size=8", *overrides])


@pytest.fixture(scope="module")
def btp_plan():
    return make_plan(tiny("parallel.tp=4"))  # dp=2 x tp=4 on the 8 simulated devices


def test_misspelt_logical_axis_raises(btp_plan):
    with pytest.raises(ValueError, match="unknown logical axis 'act_embd'"):
        btp_plan.spec(("batch", "seq", "act_embd"))
    assert btp_plan.spec(("batch", "seq", "act_embed")) == jax.sharding.PartitionSpec(("dp", "fsdp"), None, "tp")


def test_two_dimensions_on_one_mesh_axis_raise(btp_plan):
    # Under btp both d (embed) and heads are split over tp: a tensor cannot have both split.
    with pytest.raises(ValueError, match="dimensions 0 and 1 both map to mesh axis 'tp'"):
        btp_plan.spec(("embed", "heads"))


def test_scheme_table_is_consistent():
    for scheme in SCHEMES.values():
        assert set(scheme.rules) <= LOGICAL_AXES, scheme.name
        assert set(scheme.archs) <= set(ARCHS), scheme.name
        assert set(scheme.knobs) <= set(KNOB_DEFAULTS), scheme.name
    # Every arch has a scheme, and the fused BOOST blocks belong to exactly one.
    assert set(ARCHS) == {a for s in SCHEMES.values() for a in s.archs}
    assert [s.name for s in SCHEMES.values() if s.fused_btp] == ["btp"]


@pytest.mark.parametrize("overrides, needle", [
    (["model.arch=cola", "parallel.scheme=vanilla", "model.kernels=pallas"],
     "model.kernels: 'pallas' has no effect under parallel.scheme=vanilla"),
    (["model.arch=dense", "model.norm=sync"], "model.norm: 'sync' has no effect under parallel.scheme=megatron"),
    (["model.arch=svd", "parallel.scheme=vanilla", "model.grouping=false"],
     "model.grouping: False has no effect under parallel.scheme=vanilla"),
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
    assert plan.mesh.size == 1 and plan.scheme.name == "btp" and plan.scheme.fused_btp
    assert single_device_plan(tiny("model.arch=dense").model).scheme.name == "megatron"
    assert single_device_plan(cfg.model, "vanilla").scheme.name == "vanilla"


def test_no_module_state_chooses_a_code_path():
    src = Path(__file__).parents[1] / "boost_jax"
    offenders = [str(p) for p in src.rglob("*.py") if "contextvars" in p.read_text() or "ContextVar" in p.read_text()]
    assert offenders == []
