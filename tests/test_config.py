import dataclasses
from pathlib import Path

import pytest

from boost_jax.config import Config, ConfigError, ModelConfig, from_dict, load_config
from boost_jax.config.presets import PRESETS
from boost_jax.configs import BASE


def test_base_yaml_documents_exactly_the_defaults():
    assert load_config(BASE) == from_dict({})


def test_every_config_file_loads():
    # hardware.yaml describes GPUs for the performance model, not a run (tests/test_perf_model.py loads it).
    runs = [p for p in BASE.parent.glob("*.yaml") if p.name != "hardware.yaml"]
    recipes = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert BASE in runs and recipes
    for path in runs + recipes:
        load_config(path)


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["model.arch=svd", "train.lr=3e-4", "train.steps=7", "log.progress=false",
                             "data.paths=[a.txt, b.jsonl]", "model.attn_rank=32"])
    assert cfg.model.arch == "svd" and cfg.train.lr == 3e-4 and cfg.train.steps == 7
    assert cfg.log.progress is False and cfg.data.paths == ("a.txt", "b.jsonl")
    assert cfg.model.attn_rank == 32 and cfg.model.mlp_rank == cfg.model.d_model // 4


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("model: {arch: dense}\ntrain: {steps: 3}\n")
    cfg = load_config(f, ["train.steps=5"])
    assert cfg.model.arch == "dense" and cfg.train.steps == 5


@pytest.mark.parametrize("override, needle", [
    ("model.achr=svd", "'model.achr' (did you mean 'model.arch'?)"),
    ("modle.arch=svd", "'modle'"),
    ("train.lr=fast", "train.lr: expected a number"),
    ("train.lr=inf", "train.lr: expected a finite number, got inf"),
    ("train.grad_clip=.nan", "train.grad_clip: expected a finite number, got nan"),
    ("train.steps=1.5", "train.steps: expected an integer"),
    ("model.arch=mamba", "model.arch: 'mamba' is not one of"),
    ("model.preset=llama-9b", "model.preset: unknown preset 'llama-9b'"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("model.d_model=100", "model.head_dim"),
    ("train.steps=0", "train.steps: must be > 0"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("data.source=files", "data.paths"),
    ("log.progress=maybe", "log.progress: expected true/false"),
    ("train.remat=sometimes", "train.remat"),
    ("model.vocab_size=5000000000", "model.vocab_size: must be at most 2,147,483,647"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite: 'ignore' is not one of"),
    ("train", "not of the form"),
])
def test_bad_input_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    (["model.attn_latent_heads=0"], "model.attn_latent_heads: must be a positive integer (1 = one latent), got 0"),
    (["model.arch=dense", "model.attn_latent_heads=2"],
     "model.attn_latent_heads: 2 splits the k/v latents of a low-rank arch (svd, cola, lax); arch dense has none"),
    (["model.attn_latent_heads=3"], "model.attn_latent_heads: 3 must divide model.attn_rank=64"),
    (["model.attn_latent_heads=8", "model.n_kv_heads=2"], "model.attn_latent_heads: 8 must divide model.n_kv_heads=2"),
    (["model.attn_rope_dims=-2"], "model.attn_rope_dims: must be >= 0 (0 = RoPE on the whole head after B_k), got -2"),
    (["model.attn_rope_dims=3"], "model.attn_rope_dims: RoPE rotates pairs of dimensions: 3 is odd"),
    (["model.attn_rope_dims=4096"], "model.attn_rope_dims: 4096 must be smaller than model.head_dim="),
    (["model.arch=dense", "model.attn_rope_dims=4"],
     "model.attn_rope_dims: 4 decouples the rotary keys from B_k of a low-rank arch (svd, cola, lax); arch dense"),
    (["model.attn_latent_heads=2", "parallel.scheme=vanilla"],
     "model.attn_latent_heads: 2 needs a scheme that lays the latent heads out over tp (btp); parallel.scheme=vanilla"),
    (["model.attn_latent_heads=2", "parallel.tp=4"], "model.attn_latent_heads: 2 must divide by parallel.tp=4"),
])
def test_latent_heads_that_cannot_be_laid_out_are_refused_by_name(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.preset=llama-mini", *overrides])
    assert needle in str(e.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("no/such.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.preset=llama-7b", "model.arch=lax"])
    cfg.dump(tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg
    assert None not in dataclasses.astuple(cfg.model)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_resolve(preset):
    m = ModelConfig(preset=preset).resolved()
    assert m.attn_rank == m.d_model // 4 and m.head_dim * m.n_heads == m.d_model


def test_gate_silu_defaults_by_arch():
    silu = {a: ModelConfig(arch=a).resolved().mlp_gate_silu for a in ("dense", "svd", "cola", "lax")}
    assert silu == {"dense": True, "svd": True, "cola": False, "lax": False}
    assert ModelConfig(preset="llama-60m", arch="cola").resolved().mlp_gate_silu  # CoLA keeps it at 60M
    assert not ModelConfig(preset="llama-60m", arch="cola", mlp_gate_silu=False).resolved().mlp_gate_silu
    assert Config().model.mlp_gate_silu is None  # unresolved until loaded


def test_the_errors_a_caller_catches_come_from_the_api():
    from boost_jax import api
    from boost_jax.runtime import errors

    for name in ("BoostJaxError", "ConfigError", "CheckpointError", "DataError", "DiskFullError", "DivergenceError",
                 "PackageError"):
        assert getattr(api, name) is getattr(errors, name)
