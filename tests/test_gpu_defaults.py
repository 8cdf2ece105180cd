"""The defaults run on every GPU: the README's quickstart config (`python -m boost_jax.train` with no
arguments, which `python -m boost_jax.compile --hardware NAME` compiles) at its float32 and at
bfloat16, every program of the run compiled by XLA:GPU for one node of each GPU of the hardware file,
without a GPU (launch/gpu_target.py). At float32 cuDNN's attention cannot run (it takes fp16/bf16),
so `model.attention=auto` must take XLA's there, or the first train step stops in JAX's check; the
compiled HLO shows which attention each program holds. Needs JAX's CUDA plugin (the gpu-compile
extra); without it these tests skip and say why."""

import importlib.util

import pytest

from boost_jax.config import load_config
from boost_jax.config.hardware import load_hardware

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                                reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-compile]'")

# Every program a run executes (analysis/compiled.py `run_programs`), in order, with the cuDNN attention
# calls it holds where the plan takes cuDNN's attention (none under XLA's). A new program joins by one line.
PROGRAMS = {
    "train_step": {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1},
    "eval_step": {"__cudnn$fmhaSoftmax": 1},
    "prefill": {},  # decoding attends over its cache with XLA's attention (ops/attention.py cached_attention)
    "decode": {},
}
GPUS = [name for name, hw in load_hardware().items() if hw.compile_target is not None]
# model.dtype -> the attention `auto` takes on a GPU for the defaults
DTYPES = {"float32": "xla", "bfloat16": "cudnn"}


def compiled_defaults(gpu: str, dtype: str, only: tuple[str, ...] = ()):
    """The default config at `dtype`, its programs (or those `only`) compiled for one node of `gpu`:
    (the plan, {program: (its report, its optimised HLO)})."""
    from boost_jax.analysis.compiled import compile_all
    from boost_jax.launch.gpu_target import gpu_devices

    hw = load_hardware()[gpu]
    plan, reports, executables = compile_all(load_config(None, [f"model.dtype={dtype}"]), gpu_devices(hw, 1),
                                             only=only)
    for report in reports:
        assert report["memory"]["peak"] < hw.hbm_bytes, report["name"]
    return plan, {r["name"]: (r, executables[r["name"]].as_text()) for r in reports}


def cudnn_calls(report: dict, hlo: str) -> dict:
    calls = {k: n for k, n in report["custom_calls"].items() if k.startswith("__cudnn$fmha")}
    assert bool(calls) == ("__cudnn$fmha" in hlo)  # the report's count reads the HLO itself
    return calls


def check(plan, programs: dict, dtype: str) -> None:
    assert plan.attention == DTYPES[dtype]
    assert ("not model.dtype=float32" in plan.attention_why) == (dtype == "float32")  # said once, in the plan's line
    for name, (report, hlo) in programs.items():
        assert cudnn_calls(report, hlo) == (PROGRAMS[name] if plan.attention == "cudnn" else {}), name


def test_the_float32_default_compiles_for_an_h100_on_xlas_attention():
    """The finding of issue 70 in the inner tier: `python -m boost_jax.compile --hardware h100-80gb`
    stopped in `NotImplementedError: Q must be fp16/bf16/...` from the attention. The eval step
    traces the same attention forward as the train step, at a fifth of its compile."""
    from boost_jax.model.counts import count
    from boost_jax.training.run import banner

    plan, programs = compiled_defaults("h100-80gb", "float32", only=("eval_step",))
    assert list(programs) == ["eval_step"]
    check(plan, programs, "float32")
    cfg = load_config(None, [])
    line = banner(cfg, plan, count(cfg.model, cfg.train.seq_len), 0, 1.0, "")  # the run's line that names the plan
    assert "attention xla (auto: cuDNN's fused attention takes float16 or bfloat16 only, not model.dtype=float32)" \
        in line


@pytest.mark.slow  # every program of the defaults: 6 x about 1 min of CPU, 4-6 min each on 2 busy cores
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gpu", GPUS)
def test_every_program_of_the_defaults_compiles_for_every_gpu(gpu, dtype):
    assert {"a100-80gb", "h100-80gb", "h200-141gb"} <= set(GPUS)
    plan, programs = compiled_defaults(gpu, dtype)
    assert list(programs) == list(PROGRAMS)
    check(plan, programs, dtype)
