"""`bench profile`: a traced llama-tiny step, its time by category, and the op classification rules."""

import pytest

from boost_jax.analysis.program import config_for
from boost_jax.analysis.timeline import CATEGORIES, Interval, Op, _category, _sweep, op_seconds
from boost_jax.bench.profile import profile
from boost_jax.errors import ConfigError


def test_profile_puts_a_tiny_steps_time_in_categories(tmp_path):
    cfg = config_for("llama-tiny", "cola", tp=2, batch_size=2, seq=32, dtype="float32")
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
    d = _sweep([Interval(0.0, 2.0, "a", 2.0), Interval(1.0, 3.0, "b", 3.0), Interval(5.0, 6.0, "a", 6.0)])
    assert d.ops == {"a": 2.5, "b": 1.5} and d.busy_s == 4.0 and d.span_s == 6.0


def test_an_asynchronous_op_fills_only_the_time_no_other_op_claims():
    """CPU trace events as XLA's runtime writes them: a matmul launched at 1 returns at 2 and its
    result is ready at 6 (`end: dot`); `late`'s end event comes after its result was used."""
    ev = lambda name, ts, dur, **args: {"ph": "X", "name": name, "ts": ts * 1e6, "dur": dur * 1e6, "pid": 7,
                                        "args": args}
    op = lambda name, ts, dur: ev(name, ts, dur, hlo_module="jit_train_step", hlo_op=name, device_ordinal="0")
    events = [op("late", 0, 1), op("dot", 1, 1), op("add", 3, 1), ev("end: late", 3.5, 0), ev("end: dot", 6, 0),
              op("copy", 8, 1), ev("end: add", 4, 0), ev("end: copy", 9, 0)]
    ops = {name: Op("fusion", "elementwise", "") for name in ("late", "dot", "add", "copy")}
    d = op_seconds(events, "jit_train_step", ops)["0"]
    # dot: its launch (1-2), alone after add (4-6) and half of 2-3 shared with late; add: its own event.
    assert d.ops == {"late": 1.5, "dot": 3.5, "add": 1.0, "copy": 1.0}
    assert d.busy_s == 7.0 and d.span_s == 9.0  # 6-8: a gap


@pytest.mark.parametrize("override", ["parallel.pp=2", "train.microbatches=2", "train.loss_chunk=16"])
def test_loops_around_the_layers_are_refused_before_any_work(override, tmp_path):
    extra = ["train.microbatches=2"] if override == "parallel.pp=2" else []
    cfg = config_for("llama-tiny", "cola", tp=1, batch_size=4, seq=32, dtype="float32", overrides=[override, *extra])
    with pytest.raises(ConfigError, match="bench profile: pipelines, micro-batch accumulation and a chunked loss"):
        profile(cfg, steps=1, trace_dir=tmp_path / "trace", top=5)
    assert not (tmp_path / "trace").exists()
