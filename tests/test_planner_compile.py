"""The planner's compiles skip the CPU backend's code generation work
(memory_model.ANALYSIS_COMPILER_OPTIONS: LLVM at -O0, the elemental emitters): what the memory model
reads from a compile and the GEMMs and collectives the performance model reads are the same as a
default compile's, the memory-bound traffic within a few percent, and the layout it chooses is
priced and sized as its own default compile prices and sizes it."""

import pytest

from boost_jax.planner.layouts import Layout, layout_config

TINY = ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=8", "train.seq_len=64", "model.dtype=bfloat16"]
MINI = ["model.preset=llama-mini", "model.arch=cola", "train.batch_size=16", "train.seq_len=256"]
DEFAULT = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}  # the CPU backend's own
TRAFFIC_TOLERANCE = 0.06  # the elemental emitters' fusions: measured 2.8-5.5% fewer bytes on llama-mini
STEP_TOLERANCE = 0.02  # what that traffic is worth in a step's seconds


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


def _traffic(work: dict) -> int:
    return sum(t["bytes"] * t["trip_count"] for t in work["traffic"])


@pytest.mark.slow  # two compiles of one llama-tiny layer at the defaults: ~20 s on 2 busy CPU cores
def test_layer_bytes_ignore_code_generation(monkeypatch):
    from boost_jax.analysis.memory_model import layer_bytes, one_layer_config

    cfg = one_layer_config(layout_config(TINY, Layout("btp", 2, 1, 1, 2, 1, 1, 1, "lowrank")))
    fast = layer_bytes(cfg)
    _at(monkeypatch, DEFAULT)
    assert layer_bytes(cfg) == fast


@pytest.mark.slow  # 4 layouts x 6 compiles of llama-mini, ~22 s each on 2 CPU cores: two in the default run
@pytest.mark.parametrize("layout", [
    Layout("btp", 1, 2, 2, 1, 4, 1, 2, "full"),  # a pipeline with repeats
    pytest.param(Layout("vanilla", 4, 1, 1, 2, 1, 1, 1, "none"), marks=pytest.mark.long),
    Layout("btp", 2, 1, 1, 1, 2, 2, 1, "lowrank"),  # context parallelism
    pytest.param(Layout("btp", 1, 1, 1, 2, 1, 1, 2, "none"), marks=pytest.mark.long),  # gradient accumulation
])
def test_layer_bytes_and_work_ignore_code_generation_on_a_grid(monkeypatch, layout):
    cfg = layout_config(MINI, layout)
    fast_layer, fast = _layer_and_work(cfg)
    _at(monkeypatch, DEFAULT)
    layer, work = _layer_and_work(cfg)
    assert layer == fast_layer
    assert {k: v for k, v in work.items() if k != "traffic"} == {k: v for k, v in fast.items() if k != "traffic"}
    assert _traffic(fast) == pytest.approx(_traffic(work), rel=TRAFFIC_TOLERANCE)


@pytest.mark.slow  # one small plan, then the winner's own default compiles: ~40 s on 2 CPU cores
def test_the_chosen_layout_is_priced_and_sized_as_its_default_compile(monkeypatch):
    """What the planner predicts for its choice is what a default compile of that layout's whole
    train step and of its layer gives (memory exact, seconds within STEP_TOLERANCE), computed
    afresh without any cache."""
    from boost_jax.analysis.memory_model import breakdown, layer_bytes
    from boost_jax.config.hardware import one_machine
    from boost_jax.planner.layouts import Space
    from boost_jax.planner.price import DiskCache, step_seconds
    from boost_jax.planner.search import rank_layouts

    hw = one_machine(None, "a100-80gb")
    space = Space(schemes=("btp",), tp=(1, 2), pp=(1,), remat=("none",))
    best = rank_layouts(TINY, gpus=4, hw=hw, space=space, headroom=0.1, cache=DiskCache(None))[0]
    _at(monkeypatch, DEFAULT)
    memory = breakdown(best.cfg, layer_bytes, compiler="gpu")
    assert memory == best.memory
    step = step_seconds(best.cfg, hw, memory["param_elems"], DiskCache(None))
    assert best.step["seconds"] == pytest.approx(step["seconds"], rel=STEP_TOLERANCE)
    for part in ("optimizer", "dp_all_reduce", "fsdp"):  # the analytic parts do not compile
        assert best.step["parts"][part] == step["parts"][part]
