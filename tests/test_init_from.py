"""`train.init_from`: a new run from another run's parameters (or an HF folder's), restored straight
into the run's layout with a fresh optimizer at step 0; one step on tp=2 equals one device; the model
is the source's (a contradicting override refused by name, the arch changed by `convert` only); a run
started so resumes itself like any run."""

import shutil

import jax
import numpy as np
import pytest
from conftest import train_tiny
from flax import nnx

from boost_jax import api
from boost_jax.config import ConfigError, from_dict, raw_args
from boost_jax.training.importer import with_source_model
from boost_jax.training.run import train


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_overrides):
    """A dense llama-tiny run dir trained 4 steps (checkpoint at 4)."""
    return train_tiny(tmp_path_factory.mktemp("source") / "run", tiny_overrides, "model.arch=dense")


def config(tiny_overrides, run_dir, *extra):
    """The config the train command makes: the overrides, then the source's model."""
    return from_dict(with_source_model(raw_args([*tiny_overrides, "model.preset=llama-tiny", f"run_dir={run_dir}",
                                                 "train.eval_every=0", "checkpoint.every=1", *extra])))


def params(run_dir, step=None):
    return jax.device_get(nnx.to_pure_dict(nnx.state(api.restore(run_dir, step)[1], nnx.Param)))


def qwen2_folder(path, source):
    """A random-weight Qwen2 (q/k/v biases made non-zero) saved by transformers, with the source run's
    tokenizer (512 tokens)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    shutil.copyfile(source / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.mark.parametrize("kind", ["run", pytest.param("hf-qwen2", marks=pytest.mark.slow)])
def test_init_from_then_one_step_on_tp2_equals_one_device(tmp_path, tiny_overrides, source, kind):
    src = source if kind == "run" else qwen2_folder(tmp_path / "hf", source)
    runs = {}
    for name, devices, layout in (("one", 1, ["parallel.dp=1"]), ("tp2", 2, ["parallel.dp=1", "parallel.tp=2"])):
        cfg = config(tiny_overrides, tmp_path / name, f"train.init_from={src}", "train.steps=1", *layout)
        assert cfg.model.arch == "dense" and cfg.data.tokenizer_path == str((src / "tokenizer.json").absolute())
        assert cfg.model.qkv_bias == (kind == "hf-qwen2")
        summary = train(cfg, jax.devices()[:devices])
        assert summary["start_step"] == 0
        runs[name] = summary
    np.testing.assert_allclose(runs["tp2"]["losses"], runs["one"]["losses"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 params(tmp_path / "tp2"), params(tmp_path / "one"))


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_the_parameters_are_the_sources_and_a_resume_ignores_it(tmp_path, tiny_overrides, source, capsys):
    """At a learning rate of 1e-9 one step moves no parameter by more than ~1e-9: step 1 holds the
    source's step 4. Re-run with more steps, the run resumes its own checkpoint (said in the log)."""
    cfg = config(tiny_overrides, tmp_path / "run", f"train.init_from={source}@4", "train.steps=1", "train.lr=1e-9")
    train(cfg, jax.devices()[:1])
    assert f"initialised from {source} step 4" in capsys.readouterr().err
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params(tmp_path / "run"), params(source))
    again = config(tiny_overrides, tmp_path / "run", f"train.init_from={source}", "train.steps=2", "train.lr=1e-9")
    assert train(again, jax.devices()[:1])["start_step"] == 1
    assert "train.init_from ignored: the run resumes its own checkpoint step 1" in capsys.readouterr().err


@pytest.mark.parametrize("override, needle", [
    ("model.d_model=128", "model.d_model=128 contradicts train.init_from"),
    ("model.arch=svd", "convert import SRC RUN_DIR --to svd"),
])
def test_an_override_that_contradicts_the_source_is_refused_by_name(tmp_path, tiny_overrides, source, override,
                                                                     needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        config(tiny_overrides, tmp_path / "run", f"train.init_from={source}", override)
    assert not (tmp_path / "run").exists()


def test_a_missing_source_and_a_missing_step_are_named(tmp_path, tiny_overrides, source):
    with pytest.raises(ConfigError, match="does not exist"):
        config(tiny_overrides, tmp_path / "run", f"train.init_from={tmp_path / 'nowhere'}")
    cfg = config(tiny_overrides, tmp_path / "run", f"train.init_from={source}@3", "train.steps=1")
    with pytest.raises(ConfigError, match="has no checkpoint of step 3"):
        train(cfg, jax.devices()[:1])
    assert not (tmp_path / "run").exists()  # the source is read before the run dir is touched



def test_api_config_reads_init_from_as_the_train_command_does(tmp_path, tiny_overrides, source):
    """A notebook's api.config(..., "train.init_from=...") is the command's config: the source's model
    (not the preset's) and its tokenizer, so a chat fine-tune needs no data.tokenizer_path."""
    overrides = [*tiny_overrides, f"run_dir={tmp_path / 'ft'}", f"train.init_from={source}"]
    cfg = api.config("llama-mini", *overrides)
    assert cfg == from_dict(with_source_model(raw_args(["model.preset=llama-mini", *overrides])))
    assert (cfg.model.arch, cfg.model.d_model) == ("dense", 64)
    assert cfg.data.tokenizer_path == str((source / "tokenizer.json").absolute())



def test_a_model_of_another_shape_is_not_called_by_its_preset():
    """An HF folder's model keeps the default model.preset (llama-mini) with every size its own: the log
    calls a model by its preset only where it has the preset's shape."""
    from boost_jax.config.presets import shape_name
    assert shape_name(api.config(None, "model.d_model=64", "model.d_ff=160").model) == "custom"
    assert shape_name(api.config("llama-tiny", "model.arch=dense", "model.tie_embeddings=true").model) == "llama-tiny"
