"""`bench profile`: a traced llama-tiny step, its time by category, its roofline, and the op
classification rules."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from boost_jax.analysis.program import config_for
from boost_jax.analysis.timeline import (
    CATEGORIES,
    LAYOUTS,
    Interval,
    Op,
    _category,
    _sweep,
    classify,
    gemm_layout,
    op_bytes,
    op_seconds,
)
from boost_jax.analysis.work import analyze
from boost_jax.bench.profile import ROOFLINE_ROWS, gemm_work, profile, roofline
from boost_jax.runtime.errors import ConfigError


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_profile_puts_a_tiny_steps_time_in_categories(tmp_path):
    # 128 tokens a device: no llama-tiny weight dim (gemm_layout)
    cfg = config_for("llama-tiny", "cola", tp=2, batch_size=4, seq=32, dtype="float32",
                     overrides=["log.health=false"])  # health: most of the step's compile, in no category asserted
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
    roof = r["roofline"]
    assert list(roof) == list(ROOFLINE_ROWS) and r["matmul_peak_flops"] > 0 and r["bandwidth_bytes_per_s"] > 0
    for name, sec in cats.items():  # a category's rows (`loss.forward`, ...) add up to it
        assert math.isclose(sum(v["s_per_step"] for k, v in roof.items() if k.split(".")[0] == name), sec), name
    assert roof["host_gaps"]["ideal_s"] == 0
    for c in ("gemm", "loss"):  # the layers' GEMMs and the LM head's
        for v in (roof[f"{c}.{k}"] for k in LAYOUTS):  # each layout ran, its ideal at least its FLOPs at the peak
            assert v["s_per_step"] > 0 and v["flops"] > 0 and v["ideal_s"] >= v["flops"] / r["matmul_peak_flops"]
        # each linear's input gradient g @ W.T and weight gradient x.T @ g take the same FLOPs
        assert roof[f"{c}.input_grad"]["flops"] == roof[f"{c}.weight_grad"]["flops"], c


def _grad_program() -> str:
    """Two layers, the gradient of both weights: h = tanh(x @ w1) [8, 32], y = h @ w2 [8, 4]."""
    loss = lambda w1, w2, x: jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2)
    args = (jnp.ones((16, 32)), jnp.ones((32, 4)), jnp.ones((8, 16)))
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()


def test_gemm_layouts_tell_forward_input_and_weight_gradients_apart():
    text = _grad_program()
    ops = classify(text)
    dots = sorted((gemm_layout(ops[g.op].op_name, g, tokens=8), (g.m, g.n, g.k))
                  for g in analyze(text, seq=8, itemsize=4, query_block=8)[0])
    # forward x @ w1, h @ w2; input gradient dy @ w2.T (dx is not asked for); weight gradients x.T @ dh, h.T @ dy
    assert dots == [("forward", (8, 4, 32)), ("forward", (8, 32, 16)), ("input_grad", (8, 32, 4)),
                    ("weight_grad", (16, 32, 8)), ("weight_grad", (32, 4, 8))]


def test_flops_and_layouts_are_those_of_the_instructions_the_trace_times():
    text = _grad_program()
    cfg = config_for("llama-tiny", "cola", tp=1, batch_size=1, seq=8, dtype="float32")  # 8 tokens, as x's rows
    flops, layouts = gemm_work(text, cfg, classify(text))
    assert sum(flops.values()) == 2 * (8 * 16 * 32 + 8 * 32 * 4) + 2 * 8 * 4 * 32 + 2 * (16 * 8 * 32 + 32 * 8 * 4)
    assert set(flops) == set(layouts) <= set(op_bytes(text))  # executed ones (a dot's fusion, not the dot inside it)
    assert sorted(layouts.values()) == ["forward", "forward", "input_grad", "weight_grad", "weight_grad"]


def test_op_bytes_count_reads_and_writes_and_in_place_updates_only_the_update():
    add = jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(1024)).compile().as_text()
    assert sum(op_bytes(add).values()) == 2 * 4096  # read x, write the result
    update = jax.jit(lambda buf, u, i: lax.dynamic_update_slice(buf, u, (i,)), donate_argnums=0)
    text = update.lower(jnp.ones(4096), jnp.ones(256), 3).compile().as_text()
    assert sum(op_bytes(text).values()) == 2 * 1024 + 4  # u read and written, the index read; buf untouched


def test_the_ideal_is_each_op_at_the_roofline():
    peak, bandwidth = 1e11, 1e10
    ops = {"mm": Op("fusion", "gemm", "transpose(jvp())/dot_general"), "thin": Op("dot", "gemm", "jvp()/dot_general"),
           "add": Op("fusion", "elementwise", "jvp()/add"), "lost": Op("fusion", "copies", "")}
    layouts = {"mm": "weight_grad", "thin": "forward"}
    per_op = {"mm": 3e-3, "thin": 1e-3, "add": 2e-3, "lost": 1e-3, "unknown": 5e-4}
    flops, moved = {"mm": 2 * 10**8, "thin": 10**6}, {"mm": 10**6, "thin": 10**6, "add": 10**7}
    rows = roofline(per_op, ops, layouts, flops, moved, peak, bandwidth, host_gaps_s=4e-3)
    assert rows["gemm.weight_grad"]["ideal_s"] == pytest.approx(2e-3)  # compute-bound: FLOPs / peak
    assert rows["gemm.forward"]["ideal_s"] == pytest.approx(1e-4)  # memory-bound: bytes / bandwidth
    assert rows["elementwise"]["ideal_s"] == pytest.approx(1e-3)
    assert rows["elementwise"]["waste_s"] == pytest.approx(1e-3) and rows["elementwise"]["x_ideal"] == pytest.approx(2)
    assert rows["copies"]["ideal_s"] == 0 and rows["copies"]["x_ideal"] is None  # no bytes known: all waste
    assert rows["other"]["s_per_step"] == 5e-4  # an op the module does not have
    assert rows["host_gaps"] == {"s_per_step": 4e-3, "flops": 0, "bytes": 0, "ideal_s": 0.0, "waste_s": 4e-3,
                                 "x_ideal": None}


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


@pytest.mark.slow
def test_profile_hf_sets_hugging_faces_step_beside_ours_in_the_same_rows(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    from boost_jax.bench import hf
    from boost_jax.bench.profile import main

    main(["model.preset=llama-tiny", "model.arch=dense", "model.mlp_gate_silu=true", "parallel.dp=1", "log.health=false",
          "train.batch_size=2", "train.seq_len=32", "--steps", "1", "--trace-dir", str(tmp_path / "trace"), "--hf", "--json"])
    r = json.loads(capsys.readouterr().out)["hf"]
    for rows, step in ((r["rows"], r["step_s"]), (r["ours"], None)):
        assert list(rows) == list(hf.PROFILE_ROWS)
        assert all(rows[k] > 0 for k in ("gemm", "attention", "optimizer"))
        if step is not None:  # HF's rows split its step's wall time
            assert math.isclose(sum(rows.values()), step)
