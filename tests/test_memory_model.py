"""The memory model (analysis/memory_model.py) against XLA's compiled memory analysis of the fp32
gradient program `bench memory` compiles (where the CPU backend is faithful: no bf16 upcasts)."""

import json

import pytest

from boost_jax.analysis.memory_model import breakdown, layer_bytes, one_layer_config
from boost_jax.analysis.program import config_for
from boost_jax.bench import memory
from boost_jax.bench.memory import compiled_peak

TOLERANCE = 0.10


def check(model, arch, scheme, *, tp=1, pp=1, pp_repeats=1, fsdp=1, microbatches=1, remat="none", batch=4, seq=64,
          overrides=()):
    cfg = config_for(model, arch, scheme, tp=tp, pp=pp, pp_repeats=pp_repeats, microbatches=microbatches, batch=batch,
                     seq=seq, dtype="fp32", overrides=[f"parallel.fsdp={fsdp}", f"train.remat={remat}", *overrides])
    predicted, compiled = breakdown(cfg)["step"], compiled_peak(cfg)["fwd_bwd_peak_bytes"]
    assert abs(predicted - compiled) / compiled < TOLERANCE, (predicted, compiled)


FAST = [
    dict(arch="cola", scheme="btp", tp=2, remat="lowrank"),
    dict(arch="cola", scheme="btp", tp=2, pp=2, microbatches=2, remat="full"),
]
SLOW = [
    dict(arch="cola", scheme="vanilla", tp=2, remat="full"),
    dict(arch="dense", scheme="megatron", tp=2, remat="none"),
    dict(arch="cola", scheme="btp", tp=1, remat="none"),
    dict(arch="cola", scheme="btp", tp=4, remat="none"),
    dict(arch="cola", scheme="btp", tp=2, fsdp=2, remat="lowrank"),
    dict(arch="cola", scheme="vanilla", tp=2, fsdp=2, remat="none"),
    dict(arch="cola", scheme="vanilla", tp=4, remat="lowrank"),
    dict(arch="dense", scheme="megatron", tp=4, remat="full"),
    dict(arch="cola", scheme="btp", tp=2, pp=2, microbatches=2, remat="none"),
    dict(arch="cola", scheme="btp", tp=1, microbatches=2, remat="lowrank"),
    dict(arch="lax", scheme="btp", tp=2, remat="lowrank"),
    dict(arch="cola", scheme="btp", tp=1, remat="none", overrides=("model.vocab_size=4096",)),
]


def test_layer_residuals_split_by_what_they_depend_on():
    """Under full remat a layer keeps its input (the residual stream: [2, 64, 64/tp] fp32) and its
    weights, nothing computed from them; in bf16 without remat it keeps the weights' bf16 casts
    (weight-only residuals, which a one-repeat pipeline computes once) and never the fp32 weights."""
    layer = lambda dtype, remat: layer_bytes(one_layer_config(config_for(
        "llama-tiny", "cola", "btp", tp=2, batch=2, seq=64, dtype=dtype, overrides=[f"train.remat={remat}"])))
    full = layer("fp32", "full")
    assert (full.activations, full.invariant) == (2 * 64 * 32 * 4, 0) and full.weights > 0
    none = layer("bf16", "none")
    assert none.weights == 0 and none.invariant > 0 and none.activations > 10 * none.invariant


@pytest.mark.slow
def test_bench_memory_prints_the_model_beside_the_compile(capsys):
    memory.main(["--model", "llama-tiny", "--arch", "cola", "--scheme", "btp", "--tp", "2", "--batch", "2", "--seq", "64",
                 "--dtype", "fp32", "--remat", "lowrank", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["remat"] for r in rows] == ["none", "lowrank"]
    for r in rows:
        assert abs(r["memory_model_bytes"] / r["fwd_bwd_peak_bytes"] - 1) < TOLERANCE, r


@pytest.mark.parametrize("case", FAST, ids=str)
def test_memory_model_within_10_percent(case):
    check("llama-tiny", **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=str)
def test_memory_model_within_10_percent_grid(case):
    check("llama-tiny", **case)


# Pipelines beyond the fitted grid. The one fitted constant (pipeline_buffers: 5 x M full-width hidden
# states) was chosen on 36 pp=2 programs: btp and vanilla, 2 and 4 layers, R = 1, 2, M = 2..8, every
# remat mode (all within 8.3%; the earlier (iterations + 1) x 2 x M carries term missed 17 of them by
# up to +76%). These lie outside that grid (pp = 4, 8 layers, tp = 1, one row per micro-batch); the last
# is the case the earlier term missed by +20% (it was marked xfail).
@pytest.mark.slow
@pytest.mark.parametrize("case", [
    dict(arch="cola", scheme="btp", tp=2, pp=4, microbatches=4, batch=8, remat="lowrank", overrides=("model.n_layers=8",)),
    dict(arch="cola", scheme="vanilla", tp=2, pp=4, pp_repeats=2, microbatches=4, batch=8, remat="full",
         overrides=("model.n_layers=8",)),
    dict(arch="cola", scheme="btp", tp=1, pp=4, microbatches=4, batch=8, remat="lowrank", overrides=("model.n_layers=4",)),
    dict(arch="cola", scheme="btp", tp=2, pp=2, microbatches=8, batch=16, remat="lowrank", overrides=("model.n_layers=8",)),
    dict(arch="cola", scheme="vanilla", tp=2, pp=2, microbatches=4, remat="lowrank"),
], ids=str)
def test_memory_model_pipelines_beyond_the_fitted_grid(case):
    check("llama-tiny", **case)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full", "lowrank"])
def test_memory_model_llama_60m(remat):
    check("llama-60m", "cola", "btp", tp=2, batch=2, seq=128, remat=remat, overrides=("model.n_layers=2",))
