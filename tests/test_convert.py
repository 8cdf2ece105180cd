"""`python -m boost_jax.convert import`: an export comes back bit for bit, a Hugging Face LLaMA
(sharded, fp16) computes what it computed, a dense model factors into the svd arch exactly at full
rank and best at any rank (plain or whitened), a low-rank model refactors into latent heads with the
error it reports, the result is a run dir training continues, and bad input is refused by name with
nothing written."""

import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import train_tiny
from flax import nnx
from safetensors.numpy import load_file, save_file

from boost_jax import api
from boost_jax.config import ConfigError, load_config
from boost_jax.convert import main
from boost_jax.model import compress, latent_heads
from boost_jax.model.hf import export_model
from boost_jax.runtime.errors import BoostJaxError
from boost_jax.training.importer import jax_to_numpy
from boost_jax.training.run import train

TOKENS = np.random.default_rng(0).integers(0, 512, (2, 24))


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, tiny_overrides):
    """A dense llama-tiny run dir, 4 steps, checkpoint at 4."""
    return train_tiny(tmp_path_factory.mktemp("dense") / "run", tiny_overrides, "model.arch=dense")


def params_of(model):
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def logits(model):
    return np.asarray(api.forward(model, TOKENS))


def test_an_export_imports_back_bit_for_bit(tmp_path, dense_run):
    cfg = api.config("llama-tiny", "model.arch=cola", "model.init_std=0.2")
    model = api.build_model(cfg)
    export_model(cfg, model, tmp_path / "export", dense_run / "tokenizer.json")
    main(["import", str(tmp_path / "export"), str(tmp_path / "run")])
    _, back, step = api.restore(tmp_path / "run")
    assert step == 0
    jax.tree.map(np.testing.assert_array_equal, params_of(back), params_of(model))


def test_a_sharded_half_precision_llama_imports_and_computes_the_same(tmp_path, dense_run):
    """The HF layout written by export, cast to fp16 and split into two shards with an index."""
    cfg, model, _ = api.restore(dense_run)
    export_model(cfg, model, tmp_path / "hf", dense_run / "tokenizer.json")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n].astype(np.float16) for n in part}, str(tmp_path / "hf" / file), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    main(["import", str(tmp_path / "hf"), str(tmp_path / "run"), "train.seq_len=64"])
    _, imported, _ = api.restore(tmp_path / "run")
    half = jax.tree.map(lambda x: x.astype(np.float16).astype(np.float32), params_of(model))
    jax.tree.map(np.testing.assert_array_equal, params_of(imported), half)  # fp16 -> fp32 is exact
    assert np.abs(logits(imported) - logits(model)).max() < 0.05 * np.abs(logits(model)).max()


def test_hugging_face_logits_equal_the_imported_models(tmp_path, dense_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # several shards and an index
    (tmp_path / "hf" / "tokenizer.json").write_bytes((dense_run / "tokenizer.json").read_bytes())
    main(["import", str(tmp_path / "hf"), str(tmp_path / "run")])
    _, model, _ = api.restore(tmp_path / "run")
    with torch.no_grad():
        want = hf(torch.tensor(TOKENS)).logits.numpy()
    assert np.abs(logits(model) - want).max() <= 1e-4 * np.abs(want).max()


def test_factoring_is_exact_at_full_rank_and_whitening_fits_the_outputs():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(48, 40))
    a, b = compress.factor(w, 40)
    np.testing.assert_allclose(a @ b, w, atol=1e-10)
    x = rng.normal(size=(500, 48)) @ rng.normal(size=(48, 48)) * np.linspace(0.01, 3, 48)  # correlated, uneven inputs
    cov = x.T @ x / len(x)
    plain, white = compress.factor(w, 8), compress.factor(w, 8, cov)
    e_plain, e_white = compress.errors(w, *plain, cov), compress.errors(w, *white, cov)
    assert e_plain["weight"] < e_white["weight"]  # plain SVD: the best weight
    assert e_white["output"] < e_plain["output"]  # whitened: the best output on these inputs
    out = lambda ab: np.linalg.norm(x @ (w - ab[0] @ ab[1])) / np.linalg.norm(x @ w)
    assert e_white["output"] == pytest.approx(out(white)) and e_plain["output"] == pytest.approx(out(plain))
    assert compress.errors(w, *compress.factor(w, 16), None)["weight"] < e_plain["weight"]


def test_a_dense_model_at_full_rank_is_its_svd_model():
    """The svd arch's layer is (x A) B: at full rank (64: every projection of an MHA llama-tiny) each
    projection, the gate SiLU included, is the dense one, so the logits are too."""
    from boost_jax.model import Model

    cfg = api.config("llama-tiny", "model.arch=dense", "model.n_kv_heads=8", "model.init_std=0.2")
    model = api.build_model(cfg)
    svd_cfg, params, report = compress.compress(cfg.model, params_of(model), 64)
    assert max(e["weight"] for layer in report for e in layer.values()) < 1e-5
    assert (svd_cfg.arch, svd_cfg.attn_rank, svd_cfg.mlp_rank, svd_cfg.mlp_gate_silu) == ("svd", 64, 64, True)
    svd = Model(svd_cfg, rngs=nnx.Rngs(0))
    nnx.update(svd, jax.tree.map(lambda x: x.astype(np.float32), params))
    np.testing.assert_allclose(logits(svd), logits(model), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_compression_reports_and_the_run_trains_on(dense_run, tmp_path, tiny_overrides, capsys):
    from boost_jax.data.build import build_data

    data = build_data(load_config(dense_run / "config.yaml").data, vocab_size=512, seq_len=64, seed=0).directory
    main(["import", str(dense_run), str(tmp_path / "svd"), "--to", "svd", "--rank", "8", "--method", "whiten",
          "--calibration", str(data), "--samples", "16", "--json"])
    r = json.loads(capsys.readouterr().out)
    c = r["compression"]
    assert r["arch"] == "svd" and len(c["layers"]) == 2 and set(c["layers"][0]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert all(0 < e["output"] < e["weight"] < 1 for layer in c["layers"] for e in layer.values())
    assert np.isfinite(c["val_loss_after"]) and np.isfinite(c["val_loss_before"])
    cfg = load_config(tmp_path / "svd" / "config.yaml", ["train.steps=2", "log.progress=false"])
    assert cfg.model.arch == "svd" and cfg.model.attn_rank == 8
    summary = train(cfg, jax.devices()[:1])  # continues from the imported step 0 with a fresh optimizer
    assert summary["start_step"] == 0 and len(summary["losses"]) == 2


@pytest.mark.parametrize("make, args, needle", [
    (lambda d: d.mkdir(), [], "holds no export: no boost_config.json or config.json"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "gpt2"}')), [], "model_type 'gpt2' cannot be imported"),
    (None, ["--to", "svd", "--rank", "100"], "--rank 100 is larger than the matrices"),
    # a Hugging Face folder (the dense run exported) with one file damaged
    ("config.json", [], r"config.json is not a JSON file"),
    ("model.safetensors", [], r"model.safetensors is not a readable safetensors file"),
    ("tokenizer.json", [], r"tokenizer.json is not a tokenizers JSON file"),
])
def test_bad_input_is_refused_by_name_and_nothing_is_written(dense_run, tmp_path, make, args, needle):
    src = dense_run
    if isinstance(make, str):
        src = tmp_path / "src"
        cfg, model, _ = api.restore(dense_run)
        export_model(cfg, model, src, dense_run / "tokenizer.json")
        (src / make).write_bytes(bytes(range(256)))
    elif make is not None:
        src = tmp_path / "src"
        make(src)
    with pytest.raises(BoostJaxError, match=needle):
        main_raising(["import", str(src), str(tmp_path / "out"), *args])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.import.*"))


def main_raising(argv):
    from boost_jax.convert import parse
    from boost_jax.training.importer import convert

    return convert(parse(argv))


def test_unexpressible_llama_fields_are_named(tmp_path, dense_run):
    cfg, model, _ = api.restore(dense_run)
    export_model(cfg, model, tmp_path / "hf", dense_run / "tokenizer.json")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(BoostJaxError, match="rope_scaling.rope_type 'linear' cannot be imported"):
        main_raising(["import", str(tmp_path / "hf"), str(tmp_path / "out")])
    config_ok = {**config}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config_ok))
    index = {"weight_map": {"model.embed_tokens.weight": "model-00009.safetensors"}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BoostJaxError, match=r"names shards that are not in .*: \['model-00009.safetensors'\]"):
        main_raising(["import", str(tmp_path / "hf"), str(tmp_path / "out")])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not an empty folder"):
        main_raising(["import", str(dense_run), str(tmp_path / "out")])
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.slow  # a process
def test_cli_errors_are_one_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "boost_jax.convert", "import", str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "is not a folder" in proc.stderr


def test_whitening_a_near_singular_covariance_falls_back_and_says_how():
    """4 calibration rows for 48 inputs, summed in float32 as the model's grams are: Cholesky fails
    at SVD-LLM's ridge; a larger ridge or the eigendecomposition whitens, and still fits the outputs."""
    rng = np.random.default_rng(2)
    w, x = rng.normal(size=(48, 40)), rng.normal(size=(4, 48)) * 1e3
    exact = x.T @ x / len(x)
    cov = exact - 1e-5 * np.mean(np.diag(exact)) * np.eye(48)  # float32 sums can leave it slightly indefinite
    with pytest.raises(np.linalg.LinAlgError):
        np.linalg.cholesky(cov + compress.DAMPING[0] * np.mean(np.diag(cov)) * np.eye(48))
    lower, how = compress.whitening(cov)
    assert how in (f"cholesky, damping {compress.DAMPING[1]:g}", f"cholesky, damping {compress.DAMPING[2]:g}")
    a, b = compress.whitened_factor(w, 4, lower)
    assert compress.errors(w, a, b, exact)["output"] < compress.errors(w, *compress.factor(w, 4), exact)["output"]
    lower, how = compress.whitening(-np.eye(48))  # no ridge helps: the eigendecomposition's floored root
    assert how == "eigendecomposition" and np.all(np.isfinite(lower))


def test_integer_weights_are_refused_by_dtype_and_tensor_name(tmp_path, dense_run):
    cfg, model, _ = api.restore(dense_run)
    export_model(cfg, model, tmp_path / "src", dense_run / "tokenizer.json")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BoostJaxError, match=r"model.safetensors: the tensor model.norm.weight is int32, not a float"):
        main_raising(["import", str(tmp_path / "src"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def latent_factors(params, name):
    return (np.asarray(params["layers"]["attn"][name][k], np.float64) for k in ("a", "b"))


def export_of(tmp_path, tokenizer, *overrides):
    cfg = api.config("llama-tiny", "model.init_std=0.2", "model.n_kv_heads=4", *overrides)
    model = api.build_model(cfg)
    export_model(cfg, model, tmp_path / "src", tokenizer)
    return model


@pytest.mark.parametrize("arch", ["svd", "cola", "lax"])
def test_latent_heads_from_a_plain_model_report_the_error_they_make(tmp_path, dense_run, arch, capsys):
    """g = 4 from plain k/v factors: the reported error per layer is the one measured on the weights the
    run holds (svd: of A B; cola/lax: of B, whose latents stay A's columns, permuted; LaX alike in every
    layer), and the assignment keeps more of B than the source's own order of the latents would."""
    plain = params_of(export_of(tmp_path, dense_run / "tokenizer.json", f"model.arch={arch}"))
    main(["import", str(tmp_path / "src"), str(tmp_path / "run"), "model.attn_latent_heads=4", "--json"])
    report = json.loads(capsys.readouterr().out)["latent_heads"]
    cfg, model, _ = api.restore(tmp_path / "run")
    assert cfg.model.attn_latent_heads == report["groups"] == 4 and report["method"] == latent_heads.method(arch)
    for name in ("k", "v"):
        (a, b), (a2, b2) = latent_factors(plain, name), latent_factors(params_of(model), name)
        b2 = latent_heads.dense_b(b2, 4)
        if arch == "svd":
            measured = np.linalg.norm(a @ b - a2 @ b2, axis=(1, 2)) / np.linalg.norm(a @ b, axis=(1, 2))
        else:
            perms = [[int(np.flatnonzero((ai == c[:, None]).all(0))[0]) for c in ai2.T] for ai, ai2 in zip(a, a2)]
            assert all(sorted(p) == list(range(a.shape[-1])) for p in perms)  # the same latents, reordered
            if arch == "lax":
                assert perms[0] == perms[1]
            measured = np.array([np.linalg.norm(bi[p] - bi2) / np.linalg.norm(bi) for bi, p, bi2 in zip(b, perms, b2)])
            in_order = np.linalg.norm(b - latent_heads.dense_b(latent_heads.stacked_b(b, 4)[0], 4), axis=(1, 2))
            assert np.all(measured < in_order / np.linalg.norm(b, axis=(1, 2)))
        reported = np.array([layer[name]["weight"] for layer in report["layers"]])
        assert np.all(reported > 0.05)
        np.testing.assert_allclose(reported, measured, rtol=1e-5)


def test_latent_heads_at_g_1_are_exact(tmp_path, dense_run, capsys):
    """A plain model at g = 1 is unchanged bit for bit; a latent-heads model imported at g = 1 is the
    plain model with B dense, and computes its logits."""
    cfg = api.config("llama-tiny", "model.arch=cola", "model.init_std=0.2")
    plain = params_of(api.build_model(cfg))
    _, same, report = latent_heads.convert(cfg.model, jax_to_numpy(plain), 1)
    jax.tree.map(np.testing.assert_array_equal, same, plain)
    assert all(e["weight"] == 0 for layer in report for e in layer.values())
    heads = export_of(tmp_path, dense_run / "tokenizer.json", "model.arch=cola", "model.attn_latent_heads=2")
    main(["import", str(tmp_path / "src"), str(tmp_path / "run"), "model.attn_latent_heads=1"])
    assert "k and v in 1 latent heads" in capsys.readouterr().out
    _, back, _ = api.restore(tmp_path / "run")
    assert back.cfg.attn_latent_heads == 1
    np.testing.assert_allclose(logits(back), logits(heads), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, overrides, needle", [
    ("cola", ["model.attn_latent_heads=3"], "model.attn_latent_heads: 3 must divide model.attn_rank=16"),
    ("dense", ["model.attn_latent_heads=2"], "arch dense has none"),
    ("cola", ["model.d_model=32"], "model.d_model: the model is the source's"),
])
def test_latent_heads_bad_input_is_refused_and_nothing_is_written(tmp_path, dense_run, arch, overrides, needle):
    export_of(tmp_path, dense_run / "tokenizer.json", f"model.arch={arch}")
    with pytest.raises(BoostJaxError, match=re.escape(needle)):
        main_raising(["import", str(tmp_path / "src"), str(tmp_path / "out"), *overrides])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.import.*"))
