"""`export --format hf` of the low-rank archs: a transformers custom-code model that
`AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` loads and runs with our logits
(<= 1e-5 of max |logit|, fp32) and our greedy tokens; a model it cannot compute refused by name."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys

import numpy as np
import pytest
from test_export import make_model, tokens_for

from boost_jax import api
from boost_jax.model.hf import REMOTE_DIR, REMOTE_FILES, ExportError, export_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3 = "model.rope_scaling={type: llama3, factor: 4.0, low_freq_factor: 1.0, high_freq_factor: 4.0, " \
         "original_max_position_embeddings: 64}"  # scales the wavelengths theta=500 gives head_dim 32
CASES = {  # case -> overrides on test_export's llama-tiny (non-default eps, theta, init)
    # the inner tier's one: every option the modeling file has, on the arch that carries latents
    "lax_all": ("model.arch=lax", "model.qkv_bias=true", "model.attn_latent_heads=2", "model.tie_embeddings=true",
                LLAMA3),
    "svd": ("model.arch=svd",),
    # plain cola: the trained run's export in the last test
    "cola_heads_gate_silu": ("model.arch=cola", "model.attn_latent_heads=2", "model.mlp_gate_silu=true"),
}


def load(out):
    from transformers import AutoModelForCausalLM  # optional: skipped above without transformers

    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()


def check_against_ours(model, out, tokens):
    """The loaded model's logits on `tokens` and greedy continuation of its first row are ours."""
    hf = load(out)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(api.forward(model, tokens))
    assert np.abs(theirs - ours).max() <= 1e-5 * np.abs(ours).max()
    prompt = [int(t) for t in tokens[0, :5]]
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    eos = hf.generation_config.eos_token_id
    generated = generated[:generated.index(eos)] if eos in generated else generated  # ours stops before it
    assert generated == api.generate(model, [prompt], max_new_tokens=8, eos_id=eos)[0]
    assert len(generated) > 2  # a continuation, not an early stop, was compared


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "lax_all" else pytest.mark.slow) for c in CASES])
def test_transformers_loads_our_model_with_our_logits_and_tokens(case, tmp_path):
    cfg, model = make_model(case, CASES[case])
    export_model(cfg, model, tmp_path / "out", fmt="hf")
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == sorted(["config.json", "model.safetensors", *REMOTE_FILES])
    for name in REMOTE_FILES:  # verbatim copies of the package's files
        assert (tmp_path / "out" / name).read_bytes() == (REMOTE_DIR / name).read_bytes()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_boost.BoostForCausalLM"
    check_against_ours(model, tmp_path / "out", tokens_for(cfg))


def test_the_modeling_file_imports_only_torch_and_transformers():
    for name in REMOTE_FILES:
        source = (REMOTE_DIR / name).read_text()
        imports = {line.split()[1].split(".")[0] for line in source.splitlines()
                   if line.startswith(("import ", "from ")) and not line.startswith("from .")}
        assert imports <= {"math", "torch", "transformers"}, (name, imports)


@pytest.mark.parametrize("override, needle", [
    ("model.attn_rope_dims=4", "model.attn_rope_dims=4 (decoupled RoPE)"),
    ("model.mlp_gate_silu=false", "model.mlp_gate_silu=False"),
])
def test_a_model_the_custom_code_cannot_compute_is_refused_by_name_before_writing(override, needle, tmp_path):
    arch = "model.arch=dense" if "gate_silu" in override else "model.arch=cola"
    cfg, model = make_model("refused", (arch, override))
    with pytest.raises(ExportError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        export_model(cfg, model, tmp_path / "out", fmt="hf")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_exports_a_trained_run_that_transformers_serves(tiny_run_dir, tmp_path):
    """`python -m boost_jax.export RUN_DIR OUT --format hf` of the trained cola run, with its tokenizer."""
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "boost_jax.export", str(tiny_run_dir), str(out), "--format", "hf"],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transformers custom code" in proc.stdout and (out / "tokenizer.json").is_file()
    cfg, model, _ = api.restore(tiny_run_dir)
    check_against_ours(model, out, tokens_for(cfg))
