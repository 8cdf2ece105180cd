import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from boost_jax.config import ModelConfig
from boost_jax.launch.peaks import datasheet_peak_flops, device_peak_flops
from boost_jax.model import Model
from boost_jax.model.counts import count
from boost_jax.parallel import single_device_plan

ARCHS = ("dense", "svd", "cola", "lax")


def actual_params(cfg: ModelConfig) -> int:
    """Parameters of the real module, shapes only (no allocation, so llama-30b is fine)."""
    model = nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# llama-tiny (GQA, untied, each arch's default gate) in the inner loop; the slow tier adds the switches
# the count reads: qwen2.5-0.5b (q/k/v biases, tied embeddings, the gate on every arch) and
# llama-micro-s (plain multi-head attention). The other presets are these counts at other sizes (d / 4
# ranks, more layers); test_the_open_models_presets_hold_their_published_parameter_counts holds the
# open models' counts to their checkpoints'.
@pytest.mark.parametrize("preset", ["llama-tiny", *(pytest.param(p, marks=pytest.mark.slow)
                                                    for p in ("qwen2.5-0.5b", "llama-micro-s"))])
@pytest.mark.parametrize("arch", ARCHS)
def test_analytic_param_count_equals_module(preset, arch):
    cfg = ModelConfig(preset=preset, arch=arch).resolved()
    assert count(cfg, 128).params == actual_params(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_param_count_tied(tie):
    cfg = ModelConfig(preset="llama-tiny", arch="cola", tie_embeddings=tie).resolved()
    assert count(cfg, 128).params == actual_params(cfg)


def test_hand_counts():
    # LLaMA-7B as published: 6,738,415,616 parameters.
    assert count(ModelConfig(preset="llama-7b", arch="dense").resolved(), 4096).params == 6_738_415_616
    # llama-tiny cola, by hand: d=64, d_ff=160, heads 8 (kv 2) x 8, r=16, vocab 512, 2 layers.
    q = o = 16 * (64 + 64)
    k = v = 16 * (64 + 16)
    gate = up = down = 16 * (64 + 160)
    layer = q + k + v + o + gate + up + down + 2 * 64
    assert count(ModelConfig(preset="llama-tiny", arch="cola").resolved(), 64).params == 2 * layer + 2 * 512 * 64 + 64
    # Forward FLOPs per token, by hand, at seq 64: 2 per MAC of every matmul + causal attention.
    matmul = 2 * (layer - 2 * 64) + 64 * 512
    attention = 2 * 2 * 8 * 8 * 64  # layers * (QK^T + AV, causal half of 2*2*S*H*dh)
    c = count(ModelConfig(preset="llama-tiny", arch="cola").resolved(), 64)
    assert c.forward_flops_per_token == 2 * matmul + attention
    assert c.train_flops_per_token == 3 * c.forward_flops_per_token


@pytest.mark.parametrize("arch, preset, g", [("cola", "llama-tiny", 2), ("lax", "llama-7b", 8), ("svd", "llama-60m", 4)])
def test_latent_heads_count_their_blocks(arch, preset, g):
    """A block-diagonal B_k, B_v of g blocks holds (and multiplies) 1/g of a dense B's r x d_kv: the
    module's parameters and the count agree, and the FLOPs drop by exactly what the parameters do."""
    one = ModelConfig(preset=preset, arch=arch).resolved()
    cfg = ModelConfig(preset=preset, arch=arch, attn_latent_heads=g).resolved()
    assert count(cfg, 128).params == actual_params(cfg)
    saved = cfg.n_layers * 2 * cfg.attn_rank * cfg.n_kv_heads * cfg.head_dim * (g - 1) // g
    assert count(one, 128).params - count(cfg, 128).params == saved
    assert count(one, 128).forward_flops_per_token - count(cfg, 128).forward_flops_per_token == 2 * saved


@pytest.mark.parametrize("arch, preset, g, dims", [("cola", "llama-tiny", 1, 4), ("lax", "llama-tiny", 2, 4),
                                                   ("svd", "llama-60m", 4, 16)])
def test_decoupled_rope_counts_its_key_projection(arch, preset, g, dims):
    """model.attn_rope_dims d_r: B_k makes d_h - d_r per kv head, a dense [d, g d_r] the rotary keys;
    the module and the count agree, and the difference from the plain model is exactly that."""
    one = ModelConfig(preset=preset, arch=arch, attn_latent_heads=g).resolved()
    cfg = ModelConfig(preset=preset, arch=arch, attn_latent_heads=g, attn_rope_dims=dims).resolved()
    assert count(cfg, 128).params == actual_params(cfg)
    delta = cfg.n_layers * (cfg.d_model * g * dims - cfg.attn_rank * cfg.n_kv_heads * dims // g)
    assert count(cfg, 128).params - count(one, 128).params == delta
    assert count(cfg, 128).forward_flops_per_token - count(one, 128).forward_flops_per_token == 2 * delta


def test_cola_halves_compute_at_quarter_rank():
    dense = count(ModelConfig(preset="llama-7b", arch="dense").resolved(), 4096)
    cola = count(ModelConfig(preset="llama-7b", arch="cola").resolved(), 4096)
    assert 0.40 < cola.params / dense.params < 0.55  # CoLA: "about 2x fewer parameters"
    assert 0.40 < cola.train_flops_per_token / dense.train_flops_per_token < 0.6


@pytest.mark.parametrize("arch", ARCHS)
def test_flops_agree_with_compiled_cost_analysis(arch):
    # One layer: XLA's cost analysis counts a scanned body once. XLA computes the full S x S
    # attention (masked), so add the causal half back; it also counts elementwise ops (~1%).
    cfg = ModelConfig(preset="llama-tiny", arch=arch, n_layers=1, d_model=256, d_ff=512, vocab_size=512).resolved()
    b, s = 2, 128
    graphdef, params = nnx.split(Model(cfg, rngs=nnx.Rngs(0)))
    plan = single_device_plan(cfg)
    fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, plan=plan))
    xla = fwd.lower(params, jnp.zeros((b, s), jnp.int32)).compile().cost_analysis()["flops"]
    c = count(cfg, s)
    full_attention = cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * s
    analytic = (c.forward_flops_per_token + full_attention) * b * s
    assert 1.0 <= xla / analytic < 1.03


def test_cpu_peak_is_measured_once_and_cached(tmp_path):
    peak, source = device_peak_flops("float32", tmp_path)
    assert source == "measured:cpu" and peak > 1e8
    assert (tmp_path / "cpu_peak.json").exists()
    assert device_peak_flops("float32", tmp_path) == (peak, source)


@pytest.mark.parametrize("measured_again", [2.0, 1e30])
def test_an_mfu_over_100_percent_is_never_printed(tmp_path, monkeypatch, measured_again):
    """The quickstart printed MFU 103-114%: the CPU's peak, measured once on a busy host and cached,
    was low. The meter measures it again (once) and caches the higher; a throughput that still passes
    it has no MFU, and the log line says why instead of a number."""
    from boost_jax.config import load_config
    from boost_jax.launch import peaks
    from boost_jax.training.meter import Meter
    from boost_jax.training.metrics import step_line

    cfg = load_config(None, ["model.preset=llama-tiny", f"data.cache_dir={tmp_path}"])
    (tmp_path / "cpu_peak.json").write_text(json.dumps({peaks.cpu_peak_key(cfg.model.dtype): 1.0}))
    low, _ = device_peak_flops(cfg.model.dtype, tmp_path)
    measured = []
    monkeypatch.setattr(peaks, "measure_matmul_peak", lambda dtype: measured.append(dtype) or measured_again)
    meter = Meter(cfg, 1, 0, 1e6, low)
    rows = [meter.read(1), meter.read(2)]
    assert measured == [cfg.model.dtype]  # once
    assert device_peak_flops(cfg.model.dtype, tmp_path)[0] == measured_again  # the higher peak, cached
    guard = SimpleNamespace(skipped=0, spikes=0)
    line = step_line({"step": 2, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, **rows[-1]}, 4, guard)
    if measured_again == 2.0:  # still passed: no MFU
        assert all("mfu" not in r for r in rows) and line.endswith("| MFU n/a (over 100%: the peak is too low)")
    else:
        assert 0 < rows[-1]["mfu"] < 1 and line.endswith("| MFU 0.0%")


def test_datasheet_peak_is_the_tables_for_a_known_accelerator_only():
    dev = lambda platform, kind: SimpleNamespace(platform=platform, device_kind=kind)
    assert datasheet_peak_flops(dev("gpu", "NVIDIA H200"), "bfloat16") == 989e12  # MFU's denominator in bench step
    assert datasheet_peak_flops(dev("gpu", "NVIDIA GH200 480GB"), "float32") == 989e12 / 2  # TF32
    assert datasheet_peak_flops(dev("gpu", "NVIDIA RTX 9999"), "bfloat16") is None
    assert datasheet_peak_flops(dev("cpu", "cpu"), "bfloat16") is None


def test_counting_refuses_a_config_never_resolved():
    from boost_jax.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="model.counts.count needs a resolved ModelConfig .*d_model"):
        count(ModelConfig(preset="llama-tiny"), 64)  # loading resolves it once; readers never do


# The open models' presets (docs/design/hf-models.md) hold the parameters their model cards publish
# (the safetensors' counts: tied embeddings once, Qwen's q/k/v biases included).
PUBLISHED = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248,
             "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
             "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120}


def test_the_open_models_presets_hold_their_published_parameter_counts():
    for preset, published in PUBLISHED.items():
        cfg = ModelConfig(preset=preset, arch="dense").resolved()
        assert count(cfg, 128).params == published, preset
    qwen = ModelConfig(preset="qwen2.5-0.5b", arch="dense").resolved()
    assert count(qwen, 128).params == actual_params(qwen)  # the biases counted as the module holds them
