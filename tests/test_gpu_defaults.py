"""The defaults run on every GPU: the README's quickstart config (`python -m boost_jax.train` with no
arguments, which `python -m boost_jax.compile --hardware NAME` compiles) at its float32 and at
bfloat16, compiled by XLA:GPU for one node of each GPU of the hardware file, without a GPU
(launch/gpu_target.py): every program of the run on one GPU, and on each GPU the programs whose
compile differs by GPU (the slow grid's CASES). At float32 cuDNN's attention cannot run (it takes fp16/bf16),
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


# The slow grid: every program at both dtypes on the GPU; on every GPU the eval step at both
# dtypes (each attention's forward, built for that GPU's target); and the train step at bfloat16 (cuDNN's
# attention forward and backward) once per compute capability, which is what cuDNN's kernels and XLA's
# code generation are built for (h200-141gb is h100-80gb's 9.0 at another memory size and clock). The
# prefill and decode hold no cuDNN call. One case per train step compile (~25 s of CPU each).
FULL = "h100-80gb"
CASES = [(FULL, dtype, programs) for dtype in DTYPES for programs in (("train_step",), ("eval_step", "prefill", "decode"))]
_capabilities = {load_hardware()[FULL].compile_target.compute_capability}
for _gpu in (g for g in GPUS if g != FULL):
    if (_cc := load_hardware()[_gpu].compile_target.compute_capability) not in _capabilities:
        _capabilities.add(_cc)
        CASES.append((_gpu, "bfloat16", ("train_step",)))
    CASES += [(_gpu, dtype, ("eval_step",)) for dtype in DTYPES]


@pytest.mark.slow  # 3-25 s of CPU each (every program on every GPU was 6 x ~35 s)
@pytest.mark.parametrize("gpu, dtype, programs", [  # the other capability's train step (30 s): -m long
    pytest.param(*c, marks=pytest.mark.long if c[0] != FULL and "train_step" in c[2] else ()) for c in CASES],
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_every_program_of_the_defaults_compiles_for_every_gpu(gpu, dtype, programs):
    plan, compiled = compiled_defaults(gpu, dtype, only=programs)
    assert list(compiled) == list(programs)
    check(plan, compiled, dtype)


def test_the_grid_covers_every_program_dtype_and_gpu():
    """The slow grid above: every program at each dtype on one GPU, every GPU of the hardware file
    compiled at each dtype (a GPU added there joins the grid), and a train step for each compute
    capability."""
    hw = load_hardware()
    assert {"a100-80gb", "h100-80gb", "h200-141gb"} <= set(GPUS)
    assert {(d, p) for g, d, ps in CASES if g == FULL for p in ps} == {(d, p) for d in DTYPES for p in PROGRAMS}
    assert {(g, d) for g, d, _ in CASES} == {(g, d) for g in GPUS for d in DTYPES}
    trained = {hw[g].compile_target.compute_capability for g, _, ps in CASES if "train_step" in ps}
    assert trained == {hw[g].compile_target.compute_capability for g in GPUS} == {(8, 0), (9, 0)}
