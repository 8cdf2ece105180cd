"""The open models people fine-tune, in and out exactly (docs/design/hf-models.md): random-weight
tiny Llama 3.x (RoPE of type llama3, tied embeddings), Qwen2/2.5 (q/k/v bias) and SmolLM2-shaped
(tied LLaMA) checkpoints made by transformers' own classes import with HF's logits (fp32, <= 1e-4
of max |logit|), whichever transformers wrote the config (4's `rope_scaling`, 5's
`rope_parameters`); the export loads back into the same class with the same logits; what cannot be
computed is refused by name."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from boost_jax import api
from boost_jax.config import from_dict
from boost_jax.model import Model
from boost_jax.model.hf import ExportError, export_model, load_exported

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.random.default_rng(0).integers(0, 256, (2, 40))
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# original_max_position_embeddings 16 puts the 40 positions' frequencies in all three llama3 bands
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
CASES = {
    "llama3.2": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama3.1": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "qwen2.5": ("Qwen2ForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                         tie_word_embeddings=True)),
    "qwen2-untied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "smollm2": ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e5},
                                         tie_word_embeddings=True, rms_norm_eps=1e-5)),
}


def hf_checkpoint(path, case: str, seed: int = 0):
    """A random-weight checkpoint of `case` saved by transformers (biases made non-zero, so they count)."""
    cls, extra = CASES[case]
    model_cls = getattr(transformers, cls)
    config = model_cls.config_class(**SHAPE, **extra)
    torch.manual_seed(seed)
    hf = model_cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf


def hf_logits(hf) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(TOKENS)).logits.numpy()


def our_logits(model_cfg, params) -> np.ndarray:
    model = Model(model_cfg, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    return np.asarray(api.forward(model, TOKENS))


def close(ours, want):
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("case", ["llama3.2", "qwen2.5"])
def test_imported_logits_equal_hugging_faces(tmp_path, case):
    hf = hf_checkpoint(tmp_path / "hf", case)
    cfg, params = load_exported(tmp_path / "hf")
    assert cfg.qkv_bias == (case == "qwen2.5") and cfg.tie_embeddings
    assert cfg.rope_scaling.type == ("llama3" if case == "llama3.2" else "default")
    close(our_logits(cfg, params), hf_logits(hf))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama3.1", "qwen2-untied", "smollm2"])
def test_every_family_imports_with_hugging_faces_logits(tmp_path, case):
    hf = hf_checkpoint(tmp_path / "hf", case)
    cfg, params = load_exported(tmp_path / "hf")
    close(our_logits(cfg, params), hf_logits(hf))


def test_a_transformers_4_config_imports_the_same(tmp_path):
    """transformers 4 wrote the same Llama 3 as `rope_scaling` (type llama3) beside `rope_theta`."""
    hf = hf_checkpoint(tmp_path / "hf", "llama3.2")
    path = tmp_path / "hf" / "config.json"
    c = json.loads(path.read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    c["torch_dtype"] = c.pop("dtype")
    c["transformers_version"] = "4.45.0"
    path.write_text(json.dumps(c))
    cfg, params = load_exported(tmp_path / "hf")
    assert (cfg.rope_theta, cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == \
        (500000.0, 8.0, 16)
    close(our_logits(cfg, params), hf_logits(hf))


@pytest.mark.parametrize("case", ["llama3.2", "qwen2.5"])
def test_the_export_loads_back_into_the_same_class(tmp_path, case):
    cls = CASES[case][0]
    hf_checkpoint(tmp_path / "hf", case)
    model_cfg, params = load_exported(tmp_path / "hf")
    model = Model(model_cfg, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    cfg = from_dict({"model": dataclasses.asdict(model_cfg)})
    export_model(cfg, model, tmp_path / "out")
    back = getattr(transformers, cls).from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == cls
    close(hf_logits(back), np.asarray(api.forward(model, TOKENS)))


@pytest.fixture(scope="module")
def qwen_config(tmp_path_factory):
    """The config.json transformers writes for a Qwen2.5-shaped model."""
    path = tmp_path_factory.mktemp("qwen")
    hf_checkpoint(path, "qwen2.5")
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("edit, needle", [
    ({"model_type": "mistral"}, "model_type 'mistral' cannot be imported"),
    ({"use_sliding_window": True}, "use_sliding_window=True cannot be imported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types holds 'sliding_attention'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor is not understood"),
    ({"rope_theta": 10.0}, "rope_parameters.rope_theta 1000000.0 and rope_theta 10.0 disagree"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 cannot be imported"),
    ({"some_new_switch": 1}, "the key 'some_new_switch' is not understood"),
])
def test_what_cannot_be_computed_is_refused_by_name(tmp_path, qwen_config, edit, needle):
    """The config is read before any weight: a folder holding only the edited config.json is refused."""
    (tmp_path / "config.json").write_text(json.dumps({**qwen_config, **edit}))
    with pytest.raises(ExportError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_exported(tmp_path)
