"""`bench profile`: a traced llama-tiny step, its time by category, and the op classification rules."""

import pytest

from boost_jax.analysis.program import config_for
from boost_jax.analysis.timeline import CATEGORIES, _category, _sweep
from boost_jax.bench.profile import profile
from boost_jax.errors import ConfigError


def test_profile_puts_a_tiny_steps_time_in_categories(tmp_path):
    cfg = config_for("llama-tiny", "cola", tp=2, batch=2, seq=32, dtype="fp32")
    r = profile(cfg, steps=1, trace_dir=tmp_path / "trace", top=5)
    cats = r["categories"]
    assert set(cats) == {*CATEGORIES, "host_gaps"} and r["devices"] == 2
    for name in ("gemm", "attention", "loss", "optimizer", "collectives", "elementwise"):
        assert cats[name] > 0, name
    assert cats["other"] == 0  # every traced op is one of the compiled module's
    assert sum(cats.values()) <= r["step_s"] * 1.001  # one device's ops and gaps fit in its step
    assert 0 < r["ops_fraction"] < r["accounted_fraction"] <= 1.001
    assert len(r["top_ops"]) == 5 and r["top_ops"][0]["s_per_step"] >= r["top_ops"][-1]["s_per_step"]
    assert list((tmp_path / "trace").glob("plugins/profile/*/*.trace.json.gz")) == [tmp_path / r["trace_file"]]


def test_op_categories_follow_op_kind_then_jax_name():
    layer = "jit(train_step)/transpose(jvp())/while/body/closed_call"
    assert _category("all-reduce-start", {"all-reduce-start"}, f"{layer}/psum", "") == "collectives"
    assert _category("fusion", {"multiply", "add"}, "jit(train_step)/add", "") == "optimizer"
    assert _category("fusion", {"dot"}, f"{layer}/attention/checkpoint/vmap(BTNH,BSNH->BNTS)/dot_general", "") == "attention"
    assert _category("custom-call", {"custom-call"}, f"{layer}/x", "__cudnn$fmhaSoftmax") == "attention"
    assert _category("fusion", {"dot"}, "jit(train_step)/jvp()/dot_general", "") == "loss"  # the LM head
    assert _category("fusion", {"dot", "add"}, f"{layer}/dot_general", "") == "gemm"
    assert _category("custom-call", {"custom-call"}, f"{layer}/dot_general", "__cublas$gemm") == "gemm"
    assert _category("fusion", {"parameter", "dynamic-update-slice"}, f"{layer}/dynamic_update_slice", "") == "copies"
    assert _category("copy", {"copy"}, "", "") == "copies"  # XLA's own layout copies carry no name
    assert _category("fusion", {"multiply", "exp"}, f"{layer}/silu", "") == "elementwise"


def test_overlapping_ops_share_the_time_they_overlap():
    d = _sweep([(0.0, 2.0, "a"), (1.0, 3.0, "b"), (5.0, 6.0, "a")])
    assert d.ops == {"a": 2.5, "b": 1.5} and d.busy_s == 4.0 and d.span_s == 6.0


@pytest.mark.parametrize("override", ["parallel.pp=2", "train.microbatches=2", "train.loss_chunk=16"])
def test_loops_around_the_layers_are_refused_before_any_work(override, tmp_path):
    extra = ["train.microbatches=2"] if override == "parallel.pp=2" else []
    cfg = config_for("llama-tiny", "cola", tp=1, batch=4, seq=32, dtype="fp32", overrides=[override, *extra])
    with pytest.raises(ConfigError, match="bench profile: pipelines, micro-batch accumulation and a chunked loss"):
        profile(cfg, steps=1, trace_dir=tmp_path / "trace", top=5)
    assert not (tmp_path / "trace").exists()
