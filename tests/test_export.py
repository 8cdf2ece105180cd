"""boost_jax.export: every arch round-trips exactly; the HF layout is a LLaMA (checked by an independent
numpy forward pass, and by transformers itself when it is installed); the CLI refuses bad inputs."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
import yaml
from conftest import train_tiny
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models

from boost_jax import api
from boost_jax.export import main
from boost_jax.model import Model
from boost_jax.model.hf import ExportError, export_model, load_exported

# Non-default eps, theta, head_dim and a big init_std, so that a dropped field or a misplaced tensor
# moves the logits far beyond the tolerance.
COMMON = ("model.norm_eps=1e-5", "model.rope_theta=500", "model.init_std=0.2", "train.seq_len=16")
CASES = {
    "dense": ("model.arch=dense",),
    "dense_tied": ("model.arch=dense", "model.tie_embeddings=true", "model.head_dim=24"),
    "dense_no_silu": ("model.arch=dense", "model.mlp_gate_silu=false"),  # not a LLaMA: boost layout
    "svd": ("model.arch=svd",),
    "cola": ("model.arch=cola",),
    "lax": ("model.arch=lax", "model.tie_embeddings=true"),
    "cola_bf16": ("model.arch=cola", "model.param_dtype=bfloat16", "model.dtype=bfloat16"),  # stored as fp32
    "cola_heads": ("model.arch=cola", "model.attn_latent_heads=2"),  # k/v's B stored dense (block-diagonal)
}
HF_CASES = ("dense", "dense_tied")


def make_model(case, overrides=None):
    """A llama-tiny model of `case` (or of `overrides`, given) whose norm scales are random too (not all ones)."""
    cfg = api.config("llama-tiny", *COMMON, *(CASES[case] if overrides is None else overrides))
    model = api.build_model(cfg)
    keys = iter(jax.random.split(jax.random.key(1), 64))

    def perturb(path, x):
        return x + 0.5 * jax.random.normal(next(keys), x.shape, x.dtype) if path[-1].key == "scale" else x

    nnx.update(model, jax.tree_util.tree_map_with_path(perturb, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    return cfg, model


def tokens_for(cfg):
    return np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, cfg.train.seq_len))


@pytest.fixture(params=list(CASES))
def exported(request, tmp_path):
    cfg, model = make_model(request.param)
    export_model(cfg, model, tmp_path / "out")
    return request.param, cfg, model, tmp_path / "out"


def test_round_trip_is_exact(exported):
    case, cfg, model, out = exported
    loaded_cfg, params = load_exported(out)
    if case in HF_CASES:  # config.json has no preset, init_std or ranks (unused by a dense model)
        skip = {f: getattr(loaded_cfg, f) for f in ("preset", "init_std", "attn_rank", "mlp_rank")}
        assert loaded_cfg == dataclasses.replace(model.cfg, **skip)
    else:
        assert loaded_cfg == model.cfg
    original = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(params) == jax.tree.structure(original)
    jax.tree.map(np.testing.assert_array_equal, params, original)
    rebuilt = Model(loaded_cfg, rngs=nnx.Rngs(0))
    nnx.update(rebuilt, params)
    tokens = tokens_for(cfg)
    np.testing.assert_array_equal(api.forward(rebuilt, tokens), api.forward(model, tokens))


def test_layout_follows_the_model(exported):
    case, cfg, model, out = exported
    m = model.cfg
    names = set(load_file(str(out / "model.safetensors")))
    if case in HF_CASES:
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        c = json.loads((out / "config.json").read_text())
        assert c["architectures"] == ["LlamaForCausalLM"] and c["head_dim"] == m.head_dim
        assert c["max_position_embeddings"] >= cfg.train.seq_len
        assert ("lm_head.weight" in names) == (not m.tie_embeddings)
        assert len(names) == 2 + (not m.tie_embeddings) + 9 * m.n_layers
    else:
        assert sorted(os.listdir(out)) == ["boost_config.json", "model.safetensors"]
        meta = json.loads((out / "boost_config.json").read_text())
        assert meta["format"] == "boost_jax" and meta["format_version"] == 1
        assert meta["model"] == dataclasses.asdict(m)
        tensors = load_file(str(out / "model.safetensors"))
        kind = ("w",) if m.arch == "dense" else ("a", "b")
        assert {f"layers.1.mlp.down.{k}" for k in kind} <= names and "layers.1.attn_norm.scale" in names
        if m.arch != "dense":  # x @ A @ B orientation: A [d_in, r], B [r, d_out]
            assert tensors["layers.1.mlp.down.a"].shape == (m.d_ff, m.mlp_rank)
            assert tensors["layers.1.mlp.down.b"].shape == (m.mlp_rank, m.d_model)


@pytest.mark.parametrize("exported", ["cola_heads"], indirect=True)
def test_latent_heads_export_the_dense_block_diagonal_b_a_cola_loader_reads(exported):
    """k's and v's B as the [r, D] block-diagonal matrix: read as a plain CoLA model (g = 1, what a
    CoLA loader sees) it computes the latent-heads model's logits; an entry off the blocks is refused."""
    _, cfg, model, out = exported
    m = model.cfg
    r, cols, g = m.attn_rank, m.n_kv_heads * m.head_dim, m.attn_latent_heads
    tensors = load_file(str(out / "model.safetensors"))
    for name in ("layers.0.attn.k.b", "layers.1.attn.v.b"):
        b = tensors[name]
        assert b.shape == (r, cols)
        assert not b[:r // g, cols // g:].any() and not b[r // g:, :cols // g].any()
        assert b[:r // g, :cols // g].all() and b[r // g:, cols // g:].all()
    meta = json.loads((out / "boost_config.json").read_text())
    (out / "boost_config.json").write_text(json.dumps({**meta, "model": {**meta["model"], "attn_latent_heads": 1}}))
    plain_cfg, params = load_exported(out)
    plain = Model(plain_cfg, rngs=nnx.Rngs(0))
    nnx.update(plain, params)
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(api.forward(plain, tokens), api.forward(model, tokens), rtol=1e-5, atol=1e-5)
    (out / "boost_config.json").write_text(json.dumps(meta))
    tensors["layers.1.attn.v.b"][0, -1] = 0.5
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=re.escape("layers.1.attn.v.b is not block-diagonal in 2 latent heads "
                                                    "(an entry off the blocks is 0.5)")):
        load_exported(out)


@pytest.mark.parametrize("exported", ["dense", "lax"], indirect=True)
def test_load_refuses_a_damaged_export(exported):
    _, _, _, out = exported
    tensors = load_file(str(out / "model.safetensors"))
    name = sorted(tensors)[0]
    save_file({**tensors, "stray": tensors[name]}, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=re.escape("does not use: ['stray']")):
        load_exported(out)
    del tensors[name]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=re.escape(f"lacks the tensor {name}")):
        load_exported(out)


# ----------------------------------------------------------------------------- HF layout


def numpy_llama(out, tokens):
    """Hugging Face's LLaMA forward pass in float64 numpy, from config.json and HF tensor names only."""
    c = json.loads((out / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(out / "model.safetensors")).items()}
    n_heads, n_kv, dh, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    b, s = tokens.shape
    norm = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
    linear = lambda x, name: x @ w[name].T  # torch Linear: weight is [out, in]
    inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, dh, 2) / dh)
    angle = np.concatenate([np.arange(s)[:, None] * inv_freq] * 2, axis=-1)  # [S, D]
    rotate_half = lambda x: np.concatenate([-x[..., dh // 2:], x[..., : dh // 2]], axis=-1)
    rope = lambda x: x * np.cos(angle) + rotate_half(x) * np.sin(angle)
    heads = lambda x, n: x.reshape(b, s, n, dh).transpose(0, 2, 1, 3)  # [B, n, S, D]
    causal = np.triu(np.full((s, s), -np.inf), 1)

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope(heads(linear(h, p + "self_attn.q_proj.weight"), n_heads))
        k = rope(heads(linear(h, p + "self_attn.k_proj.weight"), n_kv)).repeat(n_heads // n_kv, axis=1)
        v = heads(linear(h, p + "self_attn.v_proj.weight"), n_kv).repeat(n_heads // n_kv, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh) + causal
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + linear((att @ v).transpose(0, 2, 1, 3).reshape(b, s, -1), p + "self_attn.o_proj.weight")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj.weight")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj.weight"), p + "mlp.down_proj.weight")
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return norm(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_layout_matches_a_numpy_llama(case, tmp_path):
    cfg, model = make_model(case)
    export_model(cfg, model, tmp_path)
    tokens = tokens_for(cfg)
    ours = np.asarray(api.forward(model, tokens))
    assert np.abs(ours).max() > 1  # logits big enough for 1e-4 to be a real check
    np.testing.assert_allclose(numpy_llama(tmp_path, tokens), ours, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_layout_loads_in_transformers(case, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, model = make_model(case)
    export_model(cfg, model, tmp_path)
    tokens = tokens_for(cfg)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, api.forward(model, tokens), rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- CLI on a trained run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_overrides):
    """A dense run dir trained on one device, with one checkpoint, at step 2 (export needs no eval)."""
    return train_tiny(tmp_path_factory.mktemp("export") / "run", tiny_overrides, "model.arch=dense", "train.steps=2",
                      "checkpoint.every=2", "data.val_fraction=0")


@pytest.mark.slow  # run_dir: a training run
def test_cli_exports_the_checkpoint(run_dir, tmp_path, capsys):
    main([str(run_dir), str(tmp_path / "out"), "--step", "2"])
    assert "step 2" in capsys.readouterr().out
    _, model, _ = api.restore(run_dir)
    _, params = load_exported(tmp_path / "out")
    jax.tree.map(np.testing.assert_array_equal, params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    # The run saved the tokenizer it trained; the export carries it.
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()


@pytest.mark.slow  # run_dir: a training run
def test_cli_copies_a_findable_tokenizer(run_dir, tmp_path):
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text(Tokenizer(models.BPE()).to_str())
    in_run = shutil.copytree(run_dir, tmp_path / "a")  # a tokenizer saved in the run dir
    shutil.copy(tokenizer, in_run / "tokenizer.json")
    given = shutil.copytree(run_dir, tmp_path / "b")  # an older run dir, trained with data.tokenizer_path
    (given / "tokenizer.json").unlink()
    saved = yaml.safe_load((given / "config.yaml").read_text())
    saved["data"]["tokenizer_path"] = str(tokenizer)
    (given / "config.yaml").write_text(yaml.safe_dump(saved))
    for src in (in_run, given):
        main([str(src), str(src / "out")])
        assert (src / "out" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()


@pytest.mark.slow  # run_dir: a training run
def test_cli_refuses_a_non_empty_out_dir_unless_forced(run_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        main([str(run_dir), str(tmp_path)])
    main([str(run_dir), str(tmp_path), "--force"])
    main([str(run_dir), str(tmp_path), "--force"])  # over its own export too
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "notes.txt", "tokenizer.json"]


@pytest.mark.slow  # run_dir: a training run
def test_cli_errors(run_dir, tmp_path):
    with pytest.raises(SystemExit, match="run dir not found"):
        main([str(tmp_path / "missing"), str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"no checkpoint of step 7; it has steps \[2\]"):
        main([str(run_dir), str(tmp_path / "out"), "--step", "7"])
    bare = tmp_path / "bare"  # config.yaml but no checkpoint
    bare.mkdir()
    shutil.copy(run_dir / "config.yaml", bare)
    with pytest.raises(SystemExit, match="has no checkpoint"):
        main([str(bare), str(tmp_path / "out")])
    assert sorted(os.listdir(bare)) == ["config.yaml"]  # nothing created in the run dir
    assert not (tmp_path / "out").exists()
