"""Programs compiled by XLA:GPU for GPUs this machine does not have (`python -m boost_jax.compile`,
launch/gpu_target.py): the run's programs compile for an H100 node, take the GPU paths (cuDNN
attention where `auto` says so, the Pallas kernels as Triton calls, not interpret-mode loops), their
decoder layers move the bytes the scheme's formulas say, and the bugs only this compile shows stay
fixed. Needs JAX's CUDA plugin (the gpu-compile extra); without it these tests skip and say why."""

import importlib.util
import json

import jax
import pytest

from boost_jax.bench import memory
from boost_jax.config import load_config
from boost_jax.config.hardware import load_hardware
from boost_jax.runtime.errors import ConfigError, PackageError

needs_plugin = pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                                  reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-compile]'")
pytestmark = needs_plugin

H100 = "h100-80gb"
TINY = ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=4", "train.seq_len=128", "log.health=false",
        "model.dtype=bfloat16", "train.eval_every=0"]


def compile_tiny(*overrides, only=("train_step",)):
    """The programs `only` of a tiny run compiled for one H100 node: (the plan, their reports)."""
    from boost_jax.analysis.compiled import compile_all
    from boost_jax.launch.gpu_target import gpu_devices

    cfg = load_config(None, [*TINY, *overrides])
    plan, reports, _ = compile_all(cfg, gpu_devices(load_hardware()[H100], 1), only=only)
    return plan, reports


def calls(program: dict) -> dict:
    return program["custom_calls"]


def test_the_kernels_are_interpreted_only_off_gpus():
    """The interpret switch reads the plan's devices, not jax.default_backend() (cpu here)."""
    from boost_jax.launch.gpu_target import gpu_devices
    from boost_jax.parallel import make_plan

    cfg = load_config(None, [*TINY, "parallel.tp=2", "parallel.dp=1"])
    assert jax.default_backend() == "cpu"
    gpu = make_plan(cfg, gpu_devices(load_hardware()[H100], 1)[:2])
    cpu = make_plan(cfg, jax.devices()[:2])
    assert (gpu.platform, gpu.interpret_kernels, cpu.platform, cpu.interpret_kernels) == ("gpu", False, "cpu", True)


@pytest.mark.slow  # one eval step compile: ~2.5 CPU s (the train step's: ~16)
def test_kv_heads_tp_does_not_divide_take_xla_attention_or_are_refused_for_cudnn():
    """llama-tiny's 2 kv heads at tp=4: cuDNN's partitioner cannot split q and replicate k, v (the
    compile failed with "Query, key and value should have same sharding", raised by the forward's
    partitioning: the eval step, the train step's forward, shows it); auto takes XLA's attention and
    compiles, an explicit cudnn is refused by name before any work."""
    plan, (step,) = compile_tiny("parallel.tp=4", "parallel.dp=2", "train.eval_every=5", only=("eval_step",))
    assert plan.attention == "xla" and not any("cudnn" in k for k in calls(step))
    with pytest.raises(ConfigError, match="parallel.tp=4 does not divide model.n_kv_heads=2"):
        compile_tiny("parallel.tp=4", "parallel.dp=2", "model.attention=cudnn")


@pytest.fixture
def eval_step_only(monkeypatch):
    """The command compiles the run's eval step alone (the train step's forward, ~1/5 of its compile)."""
    from boost_jax.analysis import compiled

    every = compiled.run_programs
    monkeypatch.setattr(compiled, "run_programs", lambda *a: {"eval_step": every(*a)["eval_step"]})


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_the_command_compiles_the_eval_step_on_the_gpu_paths_and_saves_it(tmp_path, capsys, eval_step_only):
    """The command of the test below, on the run's cheapest program to compile (the
    eval step): cuDNN's flash attention and the kernels as Triton calls, the layers' forward bytes as
    the formulas say, its memory, HLO and manifest saved."""
    from boost_jax.compile import main

    main([*TINY, "parallel.tp=2", "parallel.dp=4", "model.kernels=pallas", "train.eval_every=5",
          "--hardware", H100, "--json", "--save", str(tmp_path / "exe")])
    out = json.loads(capsys.readouterr().out)
    (step,) = out["programs"]
    assert out["hardware"] == H100 and out["devices"] == 8 and step["name"] == "eval_step"
    assert calls(step)["__cudnn$fmhaSoftmax"] == 1 and "__cudnn$fmhaSoftmaxBackward" not in calls(step)
    assert calls(step)["__gpu$xla.gpu.triton"] >= 1  # norm_down and grouped_matmul, forward
    tokens = 4 // 4 * 128  # the online norm's 2 statistics per token ride in the latents' all-reduces
    assert step["layer_collective_bytes"] == step["analytic_collective_bytes"] + 2 * tokens * 2 > 0
    assert set(step["memory"]) == {"argument", "output", "alias", "temp", "peak"} and 0 < step["memory"]["peak"]
    assert (tmp_path / "exe" / "eval_step.hlo.txt").read_text().startswith("HloModule")
    (saved,) = json.loads((tmp_path / "exe" / "manifest.json").read_text())["programs"]
    assert not saved["executable"] and "pickle" in saved["not_serialised"]  # cuDNN's attention cannot be


@pytest.mark.slow  # the four programs (~25 s); the eval step's alone above
@pytest.mark.long  # 40 s; in the default run: the eval step's alone (above), every scheme's train step (below)
def test_the_command_compiles_every_program_on_the_gpu_paths_and_saves_the_executables(tmp_path, capsys):
    """`python -m boost_jax.compile` at btp tp=2 with the Pallas kernels: the four programs, each with
    its compiled memory and optimised HLO; the train step takes cuDNN's flash attention forward and
    backward and the kernels as Triton calls (Pallas' interpret mode would be while loops instead), and
    per decoder layer moves the bytes of config/schemes.py's formulas; the memory model beside the
    compiled peak. One compile of each program serves every check (XLA:GPU's are the suite's slowest)."""
    from boost_jax.compile import main

    main([*TINY, "parallel.tp=2", "parallel.dp=4", "model.kernels=pallas", "train.eval_every=5",
          "--hardware", H100, "--json", "--save", str(tmp_path / "exe")])
    out = json.loads(capsys.readouterr().out)
    step, *_ = programs = out["programs"]
    assert out["hardware"] == H100 and out["devices"] == 8
    assert [p["name"] for p in programs] == ["train_step", "eval_step", "prefill", "decode"]
    assert calls(step)["__cudnn$fmhaSoftmax"] == 1 and calls(step)["__cudnn$fmhaSoftmaxBackward"] == 1
    assert calls(step)["__gpu$xla.gpu.triton"] >= 2  # norm_down and grouped_matmul, forward and backward
    # The online norm's statistics ride in the latents' all-reduces: 2 more columns per token than 7r.
    tokens = 4 // 4 * 128
    assert step["layer_collective_bytes"] == step["analytic_collective_bytes"] + 2 * tokens * 2
    assert 0 < step["memory"]["temp"] < step["memory"]["peak"] and step["model_memory"] > 0
    manifest = {p["name"]: p for p in json.loads((tmp_path / "exe" / "manifest.json").read_text())["programs"]}
    for p in programs:
        assert set(p["memory"]) == {"argument", "output", "alias", "temp", "peak"} and p["compile_s"] > 0
        assert (tmp_path / "exe" / f"{p['name']}.hlo.txt").read_text().startswith("HloModule")
    # cuDNN's attention (train and eval steps) cannot be serialised; the decoding programs can
    assert [n for n, p in manifest.items() if p["executable"]] == ["prefill", "decode"]
    assert (tmp_path / "exe" / "decode.bin").stat().st_size > 0 and "pickle" in manifest["train_step"]["not_serialised"]


@pytest.mark.slow  # two XLA:GPU compiles of the decoding programs
def test_a_decode_steps_work_reads_every_cached_token_and_the_absorbed_cache_moves_less():
    """`compile --only prefill,decode`: the decode program's step (analysis/work.step_work) reads at
    least the cache a device keeps, and the absorbed latent cache's step moves fewer bytes than the full
    cache's on the same model (decoupled RoPE, latent heads split over tp=2)."""
    from boost_jax.analysis.compiled import compile_all
    from boost_jax.launch.gpu_target import gpu_devices
    from boost_jax.model.decode import cache_bytes_per_token

    # 8 rows per device: XLA:GPU runs a single row's matrix-vector products as reductions, not GEMMs
    cfg = load_config(None, [*TINY, "train.batch_size=32", "train.seq_len=512", "model.n_kv_heads=8",
                             "model.attn_rope_dims=4", "model.attn_latent_heads=2", "parallel.tp=2", "parallel.dp=4"])
    moved = {}
    for cache in ("full", "latent"):
        plan, (prefill, decode), _ = compile_all(cfg, gpu_devices(load_hardware()[H100], 1), cache, ("prefill", "decode"))
        work = decode["step_work"]
        moved[cache] = work["gemm_read_bytes"] + work["memory_bound_bytes"]
        rows = cfg.train.batch_size // plan.size("batch")
        assert "step_work" not in prefill and work["flops"] > 0
        assert moved[cache] >= rows * cfg.train.seq_len * cache_bytes_per_token(cache, cfg.model, plan), cache
    assert moved["latent"] < moved["full"]


@pytest.mark.slow  # XLA:GPU's serve_decode of llama-tiny on 2 GPUs, after the two programs serve.cache_gib=0 reads
def test_the_servers_paged_decode_compiles_for_gpus_its_pool_split_over_tp_and_filling_the_hbm(capsys):
    """`--only serve_decode` (issue 73): the engine's paged decode compiled for 2 H100s at tp=2 with 2
    latent heads, the decode loop on the device. Its donated pool holds pages of the bytes the server
    sizes them by (serving/programs.py pool_size), half a page with one latent; with serve.cache_gib=0 on
    a GPU the pool may take what the H100's HBM less 10% leaves, and takes every slot at the context
    (all that requests can own), so the program's peak is within it."""
    from boost_jax.compile import main
    from boost_jax.parallel import make_plan
    from boost_jax.serving.programs import pool_size

    layout = [*TINY, "parallel.tp=2", "parallel.dp=1"]
    main([*layout, "model.attn_latent_heads=2", "--gpus", "2", "--cache", "latent", "--only", "serve_decode",
          "--hardware", H100, "--json"])
    (program,) = json.loads(capsys.readouterr().out)["programs"]
    assert program["name"] == "serve_decode" and program["while_loops"] >= 1
    page = {}
    for g in (1, 2):
        cfg = load_config(None, [*layout, f"model.attn_latent_heads={g}"])
        page[g] = pool_size(cfg.serve, "latent", cfg.model, make_plan(cfg, jax.devices()[:2]), 128).page_bytes
    hbm = load_hardware()[H100].hbm_bytes
    every_slot = cfg.serve.slots * -(-128 // cfg.serve.page_tokens) + 1
    assert page[2] == page[1] // 2 > 0 and program["memory"]["alias"] == every_slot * page[2]
    assert program["memory"]["peak"] <= 0.9 * hbm


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "b200"], "unknown machine"),
    (["--hardware", H100, "--nodes", "0"], "--nodes must be at least 1"),
    (["--hardware", H100, "parallel.tp=16"], "does not divide the 8 devices"),
    (["--hardware", H100, "--only", "prefill,decoder"], "--only: unknown program 'decoder'"),
    (["--hardware", H100, "parallel.tp=2", "parallel.dp=4", "--only", "serve_decode"], "serve_decode: not a program of this run"),
])
def test_bad_input_is_one_message_and_writes_nothing(argv, message, tmp_path, capsys):
    from boost_jax.compile import main

    with pytest.raises(SystemExit) as e:
        main([*TINY, *argv, "--save", str(tmp_path / "exe")])
    assert message in str(e.value) and not (tmp_path / "exe").exists()


def test_a_missing_plugin_or_target_is_named(monkeypatch, tmp_path):
    from boost_jax.config.hardware import HARDWARE_FILE
    from boost_jax.launch import gpu_target

    hw = load_hardware()[H100]
    monkeypatch.setattr(gpu_target.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PackageError, match=r"pip install -e '.\[gpu-compile\]'"):
        gpu_target.gpu_devices(hw, 1)
    monkeypatch.undo()
    no_target = tmp_path / "hw.yaml"
    no_target.write_text(HARDWARE_FILE.read_text().split("\n  compile_target:")[0])  # a100-80gb without its target
    with pytest.raises(ConfigError, match="has no compile_target"):
        gpu_target.target_config(load_hardware(no_target)["a100-80gb"])


# Every scheme on XLA's kernels (the default), and every low-rank arch's btp blocks on the Pallas
# kernels, which serve btp alone: cola's are the command test's above (the same config), svd's and
# lax's here.
@pytest.mark.slow
@pytest.mark.parametrize("arch, scheme, kernels", [("dense", "megatron", "xla"), ("cola", "vanilla", "xla"),
                                                   ("cola", "btp", "xla"), ("svd", "btp", "pallas"),
                                                   ("lax", "btp", "pallas")])
def test_every_scheme_and_kernel_compiles_for_gpus(arch, scheme, kernels):
    _, (step,) = compile_tiny(f"model.arch={arch}", f"parallel.scheme={scheme}", "parallel.tp=2", "parallel.dp=4",
                              f"model.kernels={kernels}")
    assert calls(step).get("__cudnn$fmhaSoftmaxBackward") == 1
    assert (calls(step).get("__gpu$xla.gpu.triton", 0) > 0) == (kernels == "pallas")
    got, formula = step["layer_collective_bytes"], step["analytic_collective_bytes"]
    if scheme == "megatron":  # XLA:GPU sums q's and k|v's input gradients (one input) before one all-reduce
        assert got == formula - 128 * 64 * 2  # one [T, d] partial sum fewer than the formula's 5 (T = 128, d = 64)
    else:
        assert got == pytest.approx(formula, rel=0.02)


@pytest.mark.slow
def test_the_work_analysis_reads_the_gpu_program_as_the_cpu_one():
    """analysis/work.py on XLA:GPU's program: the same GEMM FLOPs as the CPU's, and cuDNN's attention
    (one custom call per pass, no dots) priced as the CPU program's attention matmuls."""
    from boost_jax.analysis.program import build
    from boost_jax.analysis.work import analyze
    from boost_jax.launch.gpu_target import gpu_devices
    from boost_jax.parallel.context import query_group

    cfg = load_config(None, [*TINY, "parallel.tp=2", "parallel.dp=1"])
    flops = {}
    for name, devices in (("cpu", jax.devices()[:2]), ("gpu", gpu_devices(load_hardware()[H100], 1, 2))):
        prog = build(cfg, devices)
        text = jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).compile().as_text()
        gemms, _ = analyze(text, seq=128, itemsize=2, query_block=cfg.model.attention_query_block,
                           group=query_group(prog.plan, cfg.model))
        flops[name] = [sum(g.flops * g.trip_count * (g.causal_share if g.attention else 1) for g in gemms
                           if g.attention == attention) for attention in (False, True)]
    assert "__cudnn$fmhaSoftmaxBackward" in text and flops["cpu"][1] > 0
    assert flops["gpu"] == pytest.approx(flops["cpu"], rel=1e-6)


def test_commands_take_the_cpu_where_the_plugin_has_no_driver(monkeypatch):
    """With the gpu-compile extra installed and no NVIDIA driver, JAX would print the plugin's failed
    cuInit as a traceback before falling back to the CPU: every command's prepare_jax asks for the
    CPU first; a platform the user set is left alone."""
    from types import SimpleNamespace

    from boost_jax.launch import prepare

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    asked = []
    config = SimpleNamespace(jax_platforms=None, update=lambda key, value: asked.append((key, value)))
    monkeypatch.setattr(prepare, "jax", SimpleNamespace(config=config))
    monkeypatch.setattr(prepare.ctypes, "CDLL", no_driver)
    prepare.cpu_without_a_driver()
    assert asked == [("jax_platforms", "cpu")]
    config.jax_platforms = "cuda"
    prepare.cpu_without_a_driver()
    assert asked == [("jax_platforms", "cpu")]


def test_a_rows_gpus_are_whole_nodes_or_part_of_one():
    from boost_jax.bench.paper import gpu_topology

    a100 = load_hardware()["a100-80gb"]
    assert [gpu_topology(n, a100) for n in (1, 2, 4, 8, 16)] == [(1, 1), (1, 2), (1, 0), (2, 0), (4, 0)]
    with pytest.raises(ConfigError, match="no whole number of a100-80gb nodes"):
        gpu_topology(6, a100)


@pytest.mark.slow
def test_the_gpu_reading_prices_xla_gpus_program_and_the_planner_checks_a_layout(monkeypatch):
    """bench paper --gpu-compile's reading of one program: a roofline under the performance model's
    price, the memory model beside the peak; bench planner --gpu-compile's check of a layout."""
    from boost_jax.analysis import memory_model
    from boost_jax.bench.paper import gpu_reading
    from boost_jax.bench.planner import gpu_check

    # Both measure the same decoder layer on the same 2 GPUs: compiled once, for the reading.
    measured, measure = {}, memory_model.measure_layer

    def measure_once(layer_cfg, devices):
        if repr(layer_cfg) not in measured:
            measured[repr(layer_cfg)] = measure(layer_cfg, devices)
        return measured[repr(layer_cfg)]

    monkeypatch.setattr(memory_model, "measure_layer", measure_once)
    cfg = load_config(None, [*TINY, "parallel.tp=2", "parallel.dp=1"])
    r = gpu_reading(cfg, load_hardware()[H100])
    assert r["attention"] == "cudnn" and r["custom_calls"]["__cudnn$fmhaSoftmaxBackward"] == 1
    assert 0 < r["roofline"]["seconds"] < r["predicted"]["seconds"] and r["gemm_flops"] > 0
    assert r["memory_model_step_bytes"] == pytest.approx(r["peak_bytes"], rel=0.5)
    check = gpu_check(cfg, load_hardware()[H100], 2)
    assert check["fits"] and check["attention"] and check["peak_bytes"] > r["peak_bytes"]  # the optimizer's state too
    assert len(measured) == 1 and check["memory_model_bytes"] > r["memory_model_step_bytes"]


@pytest.mark.slow
def test_a_program_over_the_gpus_memory_is_named_and_exits_1(tmp_path, eval_step_only):
    from boost_jax.compile import main
    from boost_jax.config.hardware import HARDWARE_FILE

    small = tmp_path / "hw.yaml"  # an H100 of 10 kB (the eval step's peak: ~1 MB)
    small.write_text(HARDWARE_FILE.read_text().replace("  hbm_bytes: 80.0e+9\n  gpus_per_node: 8",
                                                       "  hbm_bytes: 1.0e+4\n  gpus_per_node: 8", 1))
    with pytest.raises(SystemExit) as e:
        main([*TINY, "parallel.dp=-1", "train.batch_size=8", "train.eval_every=5", "--hardware", H100,
              "--hardware-file", str(small), "--save", str(tmp_path / "exe")])
    assert str(e.value).startswith("does not fit: eval_step (") and "of a h100-80gb" in str(e.value)
    assert not (tmp_path / "exe").exists()  # nothing saved


@pytest.mark.slow  # XLA:GPU's train step and one decoder layer of llama-60m
@pytest.mark.parametrize("case", [  # the default run: the pipeline's case, its FSDP shards gathered inside the loop
    pytest.param(c, marks=() if c.label.startswith("pp") else pytest.mark.long) for c in memory.GPU_VALIDATION if c.tested],
    ids=lambda c: c.label)
def test_the_memory_model_is_within_10_percent_of_xla_gpus_peak(case, monkeypatch, capsys):
    """`bench memory --validate --gpu-compile a100-80gb` on its grid's FSDP case (XLA:GPU gathers one
    layer's shards inside the scan) and circular pipeline (each iteration keeps its chunk's FSDP
    shards): the model for XLA:GPU within 10% of its compiled train step. The rest of the grid (full
    remat, the pipelines where the loop's predicates and the logits' cotangent weigh most) is the
    command's: `python -m boost_jax.bench memory --validate --gpu-compile a100-80gb` (minutes)."""
    monkeypatch.setattr(memory, "GPU_VALIDATION", (case,))
    memory.main(["--validate", "--gpu-compile", "a100-80gb", "--json"])  # exits 1 where off by the tolerance
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert memory.TOLERANCE == 0.10 and row["hardware"] == "a100-80gb"
    assert row["memory_model_bytes"] == pytest.approx(row["peak_bytes"], rel=0.10)


def test_a_gpu_compile_after_a_cpu_one_leaves_the_persistent_cache_alone(tmp_path):
    """JAX decides at a process's first compile whether the persistent cache is used: a deviceless GPU
    compile after a CPU one (bench paper --gpu-compile compiles both) must still neither read nor
    write it (such an entry cannot be loaded back), and the CPU's compiles keep using it after."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from boost_jax.config import DataConfig
    from boost_jax.launch import compile_cache
    from boost_jax.launch.gpu_target import gpu_devices, no_persistent_cache

    folder = compile_cache.enable(DataConfig(compile_cache_dir=str(tmp_path / "xla")))
    entries = lambda: sorted(p.name for p in folder.glob("*-cache"))
    try:
        jax.jit(lambda x: x * 3 - 1)(jnp.arange(7.0))  # a CPU compile: the cache is in use from here on
        kept = entries()
        assert kept
        gpu = gpu_devices(load_hardware()[H100], 1, 1)[0]
        arg = jax.ShapeDtypeStruct((7,), jnp.float32, sharding=NamedSharding(jax.sharding.Mesh([gpu], ("x",)), P()))
        with no_persistent_cache():
            jax.jit(lambda x: x * 5 + 2).lower(arg).compile()
        assert entries() == kept  # nothing written for the GPU program
        jax.jit(lambda x: x * 7 + 3)(jnp.arange(7.0))
        assert len(entries()) == len(kept) + 1  # the CPU's next program is kept again
    finally:
        compile_cache.enable(DataConfig(compile_cache=False))
