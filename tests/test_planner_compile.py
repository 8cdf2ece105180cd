"""The planner's compiles skip LLVM's optimization of the CPU machine code
(memory_model.ANALYSIS_COMPILER_OPTIONS): what the memory and performance models read from a compile
is the same as a fully optimized one's, and the layout it chooses is priced and sized as its own
full compile prices and sizes it."""

import pytest

from boost_jax.planner.layouts import Layout, layout_config

TINY = ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=8", "train.seq_len=64", "model.dtype=bfloat16"]
MINI = ["model.preset=llama-mini", "model.arch=cola", "train.batch_size=16", "train.seq_len=256"]
OPTIMIZED = {"xla_backend_optimization_level": 3}  # LLVM at -O3, the CPU backend's default


def _at(monkeypatch, options: dict) -> None:
    """Compile the planner's analyses with `options` instead."""
    from boost_jax.analysis import memory_model
    from boost_jax.planner import price

    monkeypatch.setattr(memory_model, "ANALYSIS_COMPILER_OPTIONS", options)
    monkeypatch.setattr(price, "ANALYSIS_COMPILER_OPTIONS", options)


def _layer_and_work(cfg):
    from boost_jax.analysis.memory_model import layer_bytes, one_layer_config
    from boost_jax.planner.price import device_program, measure_work

    return layer_bytes(one_layer_config(cfg)), measure_work(device_program(cfg))


def _same_at_both_levels(monkeypatch, measure, cfg) -> None:
    fast = measure(cfg)
    _at(monkeypatch, OPTIMIZED)
    assert measure(cfg) == fast


@pytest.mark.slow  # two compiles of one llama-tiny layer at -O3: ~20 s on 2 busy CPU cores
def test_layer_bytes_ignore_llvm_optimization(monkeypatch):
    from boost_jax.analysis.memory_model import layer_bytes, one_layer_config

    cfg = layout_config(TINY, Layout("btp", 2, 1, 1, 2, 1, 1, 1, "lowrank"))
    _same_at_both_levels(monkeypatch, lambda c: layer_bytes(one_layer_config(c)), cfg)


@pytest.mark.slow  # 4 layouts x 6 compiles of llama-mini: ~1 min on 2 CPU cores
@pytest.mark.parametrize("layout", [
    Layout("btp", 1, 2, 2, 1, 4, 1, 2, "full"),  # a pipeline with repeats
    Layout("vanilla", 4, 1, 1, 2, 1, 1, 1, "none"),
    Layout("btp", 2, 1, 1, 1, 2, 2, 1, "lowrank"),  # context parallelism
    Layout("btp", 1, 1, 1, 2, 1, 1, 2, "none"),  # gradient accumulation
])
def test_layer_bytes_and_work_ignore_llvm_optimization_on_a_grid(monkeypatch, layout):
    _same_at_both_levels(monkeypatch, _layer_and_work, layout_config(MINI, layout))


@pytest.mark.slow  # one small plan, then the winner's own full compiles: ~40 s on 2 CPU cores
def test_the_chosen_layout_is_priced_and_sized_as_its_full_compile(monkeypatch):
    """What the planner predicts for its choice (tolerance: exact) is what a fully optimized compile
    of that layout's whole train step and of its layer gives, computed afresh without any cache."""
    from boost_jax.analysis.memory_model import breakdown, layer_bytes
    from boost_jax.analysis.perf_model import one_machine
    from boost_jax.planner.layouts import Space
    from boost_jax.planner.price import DiskCache, step_seconds
    from boost_jax.planner.search import plan

    hw = one_machine(None, "a100-80gb")
    space = Space(schemes=("btp",), tp=(1, 2), pp=(1,), remat=("none",))
    best = plan(TINY, gpus=4, hw=hw, space=space, headroom=0.1, cache=DiskCache(None))[0]
    _at(monkeypatch, OPTIMIZED)
    memory = breakdown(best.cfg, layer_bytes)
    assert memory == best.memory
    assert step_seconds(best.cfg, hw, memory["param_elems"], DiskCache(None)) == best.step
