"""The memory model (analysis/memory_model.py) against XLA's compiled memory analysis of the fp32
gradient program `bench memory` compiles (where the CPU backend is faithful: no bf16 upcasts)."""

import json

import pytest

from boost_jax.analysis.memory_model import layer_bytes, one_layer_config
from boost_jax.analysis.program import config_for
from boost_jax.bench import memory
from boost_jax.config import load_config


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_layer_residuals_split_by_what_they_depend_on():
    """Under full remat a layer keeps its input (the residual stream: [2, 64, 64/tp] fp32) and its
    weights, nothing computed from them; in bf16 without remat it keeps the weights' bf16 casts
    (weight-only residuals, which a one-repeat pipeline computes once) and never the fp32 weights."""
    layer = lambda dtype, remat: layer_bytes(one_layer_config(config_for(
        "llama-tiny", "cola", "btp", tp=2, batch_size=2, seq=64, dtype=dtype, overrides=[f"train.remat={remat}"])))
    full = layer("float32", "full")
    assert (full.activations, full.invariant) == (2 * 64 * 32 * 4, 0) and full.weights > 0
    none = layer("bfloat16", "none")
    assert none.weights == 0 and none.invariant > 0 and none.activations > 10 * none.invariant


@pytest.mark.slow
def test_bench_memory_prints_the_model_beside_the_compile(capsys):
    memory.main(["model.preset=llama-tiny", "model.arch=cola", "parallel.scheme=btp", "parallel.tp=2", "parallel.dp=1",
                 "train.batch_size=2", "train.seq_len=64", "--remat", "lowrank", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["remat"] for r in rows] == ["none", "lowrank"]
    for r in rows:
        assert abs(r["memory_model_bytes"] / r["fwd_bwd_peak_bytes"] - 1) < memory.TOLERANCE, r


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_memory_validates_the_model_against_the_compile(monkeypatch, capsys):
    """`bench memory --validate` on its first case (the layer scan); a case off by the tolerance
    fails the command."""
    monkeypatch.setattr(memory, "VALIDATION", memory.VALIDATION[:1])
    memory.main(["--validate", "--json"])
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert abs(row["error"]) < memory.TOLERANCE and row["fwd_bwd_peak_bytes"] > 0, row
    monkeypatch.setattr(memory, "validate", lambda case: row)  # the same row, held to half its error
    monkeypatch.setattr(memory, "TOLERANCE", abs(row["error"]) / 2)
    with pytest.raises(SystemExit) as exit:
        memory.main(["--validate"])
    assert exit.value.code == 1 and "0 of 1 within" in capsys.readouterr().out


# The rest of the grid (`python -m boost_jax.bench memory --validate`, ~4 min) is a benchmark; these
# cases cover every term of the model (bench/memory.py VALIDATION says which).
@pytest.mark.parametrize("case", [  # the inner loop keeps the smallest pipeline
    pytest.param(c, id=c.label, marks=() if (c.pp, c.microbatches) == (2, 2) else pytest.mark.slow)
    for c in memory.VALIDATION[1:] if c.tested])
def test_memory_model_within_tolerance(case):
    row = memory.validate(case)
    assert abs(row["error"]) < memory.TOLERANCE, row


def test_bench_memory_inference_compiles_generation_beside_its_weights_and_cache(capsys):
    """`bench memory --inference`: the decode program holds the weights and the cache (updated in
    place: the cache is its donated, aliased argument), each counted per device as the layout splits
    it; the prefill holds at least the weights and the cache it fills; the server's pool of that cache
    is laid out as the contiguous one."""
    from boost_jax.analysis.memory_model import param_elems
    from boost_jax.parallel import abstract_plan

    args = ["model.preset=llama-tiny", "model.arch=cola", "parallel.tp=2", "parallel.dp=1", "train.batch_size=4",
            "train.seq_len=64"]
    memory.main(["--inference", *args, "--json"])
    r = json.loads(capsys.readouterr().out)
    cfg = load_config(None, args)
    m = cfg.model
    assert r["weights_bytes"] == param_elems(cfg, abstract_plan(cfg)) * 4  # fp32, the tp shards
    # k and v of every layer: 4 rows x 64 positions x the device's kv heads (2 / tp=2) x head_dim, fp32
    assert r["cache_bytes"] == m.n_layers * 2 * 4 * 64 * (m.n_kv_heads // 2) * m.head_dim * 4
    decode, prefill = r["programs"]["decode"], r["programs"]["prefill"]
    assert decode["alias_bytes"] == r["cache_bytes"]
    state = decode["argument_bytes"] - r["weights_bytes"] - r["cache_bytes"]
    assert 0 < state <= 4 * (4 * 4 + 16 * 4) + 16  # the rows' counters, their output slots, the key
    assert prefill["peak_bytes"] >= r["weights_bytes"] + r["cache_bytes"]
    # The server's pool of the same cache: 8 slots x 4 pages of 16 positions + the null page, a page
    # per device 16 positions of the contiguous cache's
    page = r["cache_bytes"] // (4 * 64) * 16
    assert r["serve_pool"] == {"slots": 8, "page_tokens": 16, "cache_gib": 0.0, "pages": 33, "page_bytes": page,
                               "bytes": 33 * page}


def test_the_memory_model_lays_the_step_out_as_the_named_compiler():
    """XLA:GPU gathers one layer's FSDP shards inside the layer scan (XLA:CPU the whole stack), writes
    the loss's cotangent over its logits, and allocates the layers' gradients after the loss:
    `breakdown(..., compiler)` says so term by term; an unknown compiler is refused."""
    from boost_jax.analysis.memory_model import breakdown

    cfg = load_config(None, ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=4", "train.seq_len=128",
                             "model.dtype=bfloat16", "parallel.fsdp=4", "parallel.dp=1"])
    cpu, gpu = breakdown(cfg), breakdown(cfg, compiler="gpu")
    assert cpu["fsdp_gathered"] == 3 * cpu["params"] and gpu["fsdp_gathered"] == cpu["fsdp_gathered"] // 2
    assert gpu["loss"] * 2 == cpu["loss"] > 0
    assert gpu["step"] == max(sum(gpu[k] for k in ("params", "grads", "fsdp_gathered", "tokens", "activations",
                                                    "transient")), gpu["params"] + gpu["tokens"] + gpu["activations"] + gpu["loss"])
    assert gpu["total"] >= gpu["step"] + gpu["optimizer"] and cpu["total"] == cpu["step"] + cpu["optimizer"]
    with pytest.raises(ValueError, match="unknown compiler 'tpu'"):
        breakdown(cfg, compiler="tpu")

