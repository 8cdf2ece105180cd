"""The safetensors format a model is exported in and imported from, and its tensor names.

A dense model with the SwiGLU gate SiLU is written in a Hugging Face layout (`config.json` +
`model.safetensors`): a LLaMA's (`LlamaForCausalLM`; Llama 3's RoPE scaling and SmolLM2's tied
embeddings included), or with `model.qkv_bias` a Qwen2's (`Qwen2ForCausalLM`); every other model
(svd / cola / lax, and dense without the gate SiLU, which HF cannot express) in the boost layout
(`boost_config.json` + `model.safetensors`). Tensors are float32; docs/export.md lists the names.
With `--format hf` a low-rank model (svd / cola / lax) is written as a transformers custom-code
model instead: `config.json` with an `auto_map` to the configuration and modeling files of
`hf_remote/`, copied beside the weights (docs/export.md, "transformers custom code").
`load_exported` reads either layout (or an HF LLaMA / Qwen2 folder from elsewhere) back into
boost_jax's parameter dict; a config.json key it does not understand is refused by name
(docs/design/hf-models.md). The commands: `python -m boost_jax.export` and `convert import`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from boost_jax.config import Config, ModelConfig, from_dict
from boost_jax.config.archs import ARCHS
from boost_jax.model import Model, latent_heads
from boost_jax.runtime.errors import BoostJaxError
from boost_jax.runtime.paths import check_writable_dir, disk_full, is_disk_full

FORMAT, FORMAT_VERSION = "boost_jax", 1
WEIGHTS, TOKENIZER = "model.safetensors", "tokenizer.json"
HF_CONFIG, BOOST_CONFIG = "config.json", "boost_config.json"
# The custom-code files of a low-rank model's HF export, copied verbatim from here (package data).
REMOTE_DIR = Path(__file__).parent / "hf_remote"
REMOTE_FILES = ("configuration_boost.py", "modeling_boost.py")
EXPORTED = (WEIGHTS, HF_CONFIG, BOOST_CONFIG, TOKENIZER, *REMOTE_FILES)  # every file an export may write
FORMATS = ("auto", "hf")  # auto: HF LLaMA / Qwen2 where a model is one, else boost; hf: HF always

# boost_jax parameter path -> HF LLaMA tensor name ({i}: layer index). Matrices ending in ".w" are
# stored [in, out] here (x @ W) and [out, in] in HF (torch's Linear), so they are transposed.
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm.scale": "model.norm.weight",
    "lm_head.w": "lm_head.weight",
    "layers.attn_norm.scale": "model.layers.{i}.input_layernorm.weight",
    "layers.mlp_norm.scale": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.attn.{p}.w": f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"layers.mlp.{p}.w": f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"layers.attn.{p}.bias": f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"},
}
# The same for hf_remote's modeling file: each projection `{p}_proj` is a pair of modules `a`, `b`
# (torch's [out, in], transposed), q/k/v's bias on `b`.
REMOTE_NAMES = {
    **{k: v for k, v in HF_NAMES.items() if not k.startswith(("layers.attn.", "layers.mlp."))},
    **{f"layers.attn.{p}.{f}": f"model.layers.{{i}}.self_attn.{p}_proj.{f}.weight" for p in "qkvo" for f in "ab"},
    **{f"layers.mlp.{p}.{f}": f"model.layers.{{i}}.mlp.{p}_proj.{f}.weight" for p in ("gate", "up", "down")
       for f in "ab"},
    **{f"layers.attn.{p}.bias": f"model.layers.{{i}}.self_attn.{p}_proj.b.bias" for p in "qkv"},
}

# The HF families a dense SwiGLU model is exported as and imported from: model_type -> (its class,
# whether q, k and v have a bias). Qwen2 is a LLaMA with q/k/v biases.
HF_FAMILIES = {"llama": ("LlamaForCausalLM", False), "qwen2": ("Qwen2ForCausalLM", True)}


class ExportError(BoostJaxError, ValueError):
    """The run, the checkpoint or the output folder cannot be used; the message says why."""

    kind = "export error"


def hf_family(cfg: ModelConfig) -> str | None:
    """The HF model_type a model is exported as: HF's LLaMA and Qwen2 always apply SiLU to the gate,
    so only an HF-exportable arch (dense) with it is one; Qwen2 where q, k and v have a bias."""
    if not (ARCHS[cfg.arch].hf_llama_export and cfg.mlp_gate_silu):
        return None
    return "qwen2" if cfg.qkv_bias else "llama"


def remote_refusal(cfg: ModelConfig) -> str | None:
    """Why hf_remote's modeling file cannot compute this model (a sentence naming the key), or None."""
    if not ARCHS[cfg.arch].low_rank:
        return (f"model.mlp_gate_silu={cfg.mlp_gate_silu}: a dense model without the gate SiLU has no Hugging "
                "Face layout (export it without --format hf, in the boost layout)")
    if cfg.attn_rope_dims:
        return (f"model.attn_rope_dims={cfg.attn_rope_dims} (decoupled RoPE) is not in the transformers model "
                "--format hf writes; export it without --format hf, in the boost layout")
    return None


def is_hf_llama(cfg: ModelConfig) -> bool:
    """Whether `LlamaForCausalLM` runs this model as it is (what `bench --hf` compares with)."""
    return hf_family(cfg) == "llama"


# ----------------------------------------------------------------------------- export


def export_layout(m: ModelConfig, fmt: str = "auto") -> str:
    """"hf" (LLaMA / Qwen2), "remote" (hf_remote's custom code) or "boost": the layout `fmt` (FORMATS)
    gives this model; a model --format hf cannot express is refused by name."""
    if hf_family(m) is not None:
        return "hf"
    if fmt == "auto":
        return "boost"
    if why := remote_refusal(m):
        raise ExportError(f"--format hf cannot export this model: {why}")
    return "remote"


def export_model(cfg: Config, model, out_dir: str | Path, tokenizer_path: str | Path | None = None,
                 force: bool = False, fmt: str = "auto") -> None:
    """Write `model` (built from `cfg`) to out_dir in the layout `export_layout` gives it."""
    out_dir, m = Path(out_dir), model.cfg
    layout = export_layout(m, fmt)  # before anything is written
    check_out_dir(out_dir, force)
    for name in EXPORTED:  # no stale file of another layout
        (out_dir / name).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if layout == "remote":
        tensors = _to_tensors(params, REMOTE_NAMES.__getitem__, _remote_orientation(m.attn_latent_heads))
        meta = _remote_config(m, cfg.train.seq_len)
    else:
        hf = layout == "hf"
        tensors = _to_tensors(_dense_latent_heads(params, m), lambda path: _tensor_name(path, hf),
                              _hf_orientation if hf else lambda path, x: x)
        meta = _hf_config(m, cfg.train.seq_len) if hf else {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": dataclasses.asdict(m), "train_seq_len": cfg.train.seq_len,
        }
    try:
        # transformers refuses safetensors files without a "format" entry in their metadata.
        save_file(tensors, str(out_dir / WEIGHTS), metadata=None if layout == "boost" else {"format": "pt"})
        (out_dir / (BOOST_CONFIG if layout == "boost" else HF_CONFIG)).write_text(json.dumps(meta, indent=2) + "\n")
        for name in REMOTE_FILES if layout == "remote" else ():
            shutil.copyfile(REMOTE_DIR / name, out_dir / name)
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, out_dir / TOKENIZER)
    except Exception as e:  # safetensors raises its own error type around the OSError
        if not is_disk_full(e):
            raise
        for name in EXPORTED:  # no half-written export is left
            (out_dir / name).unlink(missing_ok=True)
        raise disk_full(out_dir, "the export", sum(t.nbytes for t in tensors.values()),
                        "no part of it is left there") from None


def _to_tensors(params: dict, name_of, orient) -> dict[str, np.ndarray]:
    """One float32 tensor per parameter, named `name_of(path)`, laid out by `orient(path, x)`, split
    per layer for the stacked ones."""
    tensors = {}
    for path, x in _flat(params).items():
        x = orient(path, np.asarray(jax.device_get(x), np.float32))
        name = name_of(path)
        if path.startswith("layers."):
            tensors.update({name.format(i=i): np.ascontiguousarray(xi) for i, xi in enumerate(x)})
        else:
            tensors[name] = np.ascontiguousarray(x)
    return tensors


def _hf_orientation(path: str, x: np.ndarray) -> np.ndarray:
    """HF LLaMA's matrices are torch's [out, in]."""
    return np.swapaxes(x, -1, -2) if path.endswith(".w") else x


def _remote_orientation(groups: int):
    """hf_remote's A, B and lm_head as torch's [out, in]; with latent heads k's and v's B (stacked [L, r, n])
    as its g blocks [L, g, n, r / g] (its GroupedUp)."""
    grouped = {f"layers.attn.{p}.b" for p in latent_heads.PROJECTIONS} if groups > 1 else set()

    def orient(path: str, x: np.ndarray) -> np.ndarray:
        if path in grouped:
            x = x.reshape(x.shape[0], groups, x.shape[1] // groups, x.shape[2])
        return np.swapaxes(x, -1, -2) if path.endswith((".a", ".b", ".w")) else x  # .w: lm_head

    return orient


def _dense_latent_heads(params: dict, m: ModelConfig) -> dict:
    """With latent heads, k's and v's B as the dense block-diagonal [r, D] they stand for: the shape of
    a plain CoLA model's, which a loader of CoLA checkpoints reads as it is."""
    if m.attn_latent_heads == 1:
        return params
    attn = dict(params["layers"]["attn"])
    for name in latent_heads.PROJECTIONS:
        b = np.asarray(jax.device_get(attn[name]["b"]), np.float32)
        attn[name] = {**attn[name], "b": latent_heads.dense_b(b, m.attn_latent_heads)}
    return {**params, "layers": {**params["layers"], "attn": attn}}


def _hf_config(m: ModelConfig, seq_len: int) -> dict:
    family = hf_family(m)
    rope = {"rope_type": m.rope_scaling.type, "rope_theta": m.rope_theta, **_llama3_numbers(m)}
    return {
        "architectures": [HF_FAMILIES[family][0]],
        "model_type": family,
        **_hf_sizes(m, seq_len),
        # transformers 5's `rope_parameters` (theta inside), and 4's `rope_scaling` + `rope_theta`
        "rope_parameters": rope,
        "rope_scaling": None if m.rope_scaling.type == "default" else rope,
        "rope_theta": m.rope_theta,
        "hidden_act": "silu",
        **({"use_sliding_window": False} if family == "qwen2" else {"attention_bias": False, "mlp_bias": False}),
    }


def _remote_config(m: ModelConfig, seq_len: int) -> dict:
    """config.json of hf_remote's model (configuration_boost.BoostConfig's fields)."""
    return {
        "architectures": ["BoostForCausalLM"],
        "model_type": "boost_lowrank",
        "auto_map": {"AutoConfig": "configuration_boost.BoostConfig",
                     "AutoModelForCausalLM": "modeling_boost.BoostForCausalLM"},
        "arch": m.arch,
        **_hf_sizes(m, seq_len),
        "attn_rank": m.attn_rank,
        "mlp_rank": m.mlp_rank,
        "attn_latent_heads": m.attn_latent_heads,
        "mlp_gate_silu": m.mlp_gate_silu,
        "qkv_bias": m.qkv_bias,
        "boost_rope": {"type": m.rope_scaling.type, "theta": m.rope_theta, **_llama3_numbers(m)},
    }


def _llama3_numbers(m: ModelConfig) -> dict:
    return {k: getattr(m.rope_scaling, k) for k in LLAMA3_ROPE} if m.rope_scaling.type == "llama3" else {}


def _hf_sizes(m: ModelConfig, seq_len: int) -> dict:
    """The config.json keys both HF layouts share: sizes, norm, embeddings, context, dtype, tokens."""
    return {
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        # the trained length (RoPE itself has no limit), at least the context llama3 scaling stretched
        "max_position_embeddings": max(seq_len, m.rope_scaling.original_max_position_embeddings
                                       if m.rope_scaling.type == "llama3" else 0),
        "torch_dtype": "float32",
        "bos_token_id": 1,  # <bos>, <eos> of the tokenizers boost_jax trains
        "eos_token_id": 2,
    }


def check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"output path {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"output folder {out_dir} is not empty; pass --force to overwrite the export in it")
    check_writable_dir(out_dir, "out_dir")


# ----------------------------------------------------------------------------- import


def load_exported(src: str | Path) -> tuple[ModelConfig, dict]:
    """(resolved model config, parameter pure dict in the config's param_dtype) from either layout:
    a boost export, or a Hugging Face LLaMA folder (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`; float32, float16 or bfloat16). Read tensor by tensor: the model
    is in host memory once, plus the tensor being read."""
    src = Path(src)
    cfg, hf = _read_config(src)
    files = _weight_files(src)
    where = {}  # tensor name -> its file
    for path in files:
        with _open_weights(path) as f:
            where.update(dict.fromkeys(f.keys(), path))
    handles = {}
    used = set()

    def tensor(name: str) -> np.ndarray:
        if name not in where:
            raise ExportError(f"{src} lacks the tensor {name}")
        used.add(name)
        if where[name] not in handles:
            handles[where[name]] = _open_weights(where[name])
        try:
            x = handles[where[name]].get_tensor(name)
        except Exception as e:  # safetensors raises its own errors for a damaged body
            raise ExportError(f"{where[name]}: cannot read the tensor {name} ({e})") from None
        if x.dtype.kind in "biuc":  # integer (e.g. quantized), bool or complex: casting would not mean weights
            raise ExportError(f"{where[name]}: the tensor {name} is {x.dtype}, not a float type (float32, float16 "
                              "or bfloat16); quantized or integer weights cannot be imported")
        return x

    groups = cfg.attn_latent_heads
    block_diagonal = {f"layers.attn.{p}.b" for p in latent_heads.PROJECTIONS} if groups > 1 else set()

    def read(key_path, like):  # the inverse of _to_tensors, checked against the config's shapes
        path = _path_str(key_path)
        name = _tensor_name(path, hf)
        out = np.empty(like.shape, like.dtype)
        for i, dst in enumerate(out if path.startswith("layers.") else [out]):
            x = tensor(name.format(i=i))
            x = np.swapaxes(x, -1, -2) if hf and path.endswith(".w") else x
            if path in block_diagonal:  # stored dense: its g diagonal blocks
                if x.shape != (dst.shape[0], dst.shape[1] * groups):
                    raise ExportError(f"{src}: {name.format(i=i)} has shape {x.shape}, the config needs "
                                      f"{(dst.shape[0], dst.shape[1] * groups)} (a block-diagonal B)")
                x, off = latent_heads.stacked_b(x, groups)
                if off:
                    raise ExportError(f"{src}: {name.format(i=i)} is not block-diagonal in {groups} latent "
                                      f"heads (an entry off the blocks is {off:.3g}); convert a plain model with "
                                      "python -m boost_jax.convert import SRC RUN_DIR model.attn_latent_heads=G")
            if x.shape != dst.shape:
                raise ExportError(f"{src}: {name.format(i=i)} has shape {x.shape}, the config needs {dst.shape}")
            dst[...] = x  # cast to param_dtype
        return out

    params = jax.tree_util.tree_map_with_path(read, _abstract_params(cfg))
    extra = sorted(set(where) - used)
    if hf and cfg.tie_embeddings and "lm_head.weight" in extra:  # some tied checkpoints store the copy
        if np.array_equal(tensor("lm_head.weight"), params["embed"]):
            extra.remove("lm_head.weight")
    if extra:
        raise ExportError(f"{src} has tensors the config does not use: {extra[:8]}")
    return cfg, params


def _open_weights(path: Path):
    """A safetensors file opened for reading; a damaged or foreign one named."""
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # SafetensorError (a bad header), OSError
        raise ExportError(f"{path} is not a readable safetensors file ({e})") from None


def _weight_files(src: Path) -> list[Path]:
    """The safetensors files of a folder: model.safetensors, or every shard its index names."""
    index = src / (WEIGHTS + ".index.json")
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ExportError(f"{index} is not a safetensors index (no weight_map: {e})") from None
        if missing := [s for s in shards if not (src / s).is_file()]:
            raise ExportError(f"{index} names shards that are not in {src}: {missing}")
        return [src / s for s in shards]
    if not (src / WEIGHTS).is_file():
        raise ExportError(f"{src} has no {WEIGHTS} (nor {index.name})")
    return [src / WEIGHTS]


def read_model_config(src: str | Path) -> ModelConfig:
    """The model config of an export or an HF folder, read (and checked) without its weights."""
    return _read_config(Path(src))[0]


def _read_config(out_dir: Path) -> tuple[ModelConfig, bool]:
    """(model config, whether the folder is in the HF layout)."""
    if (out_dir / BOOST_CONFIG).is_file():
        meta = _read_json(out_dir / BOOST_CONFIG)
        if (meta.get("format"), meta.get("format_version")) != (FORMAT, FORMAT_VERSION):
            raise ExportError(f"{out_dir / BOOST_CONFIG}: unsupported format {meta.get('format')!r} "
                              f"version {meta.get('format_version')!r}")
        return from_dict({"model": meta["model"]}).model, False
    if (out_dir / HF_CONFIG).is_file():
        return _from_hf_config(_read_json(out_dir / HF_CONFIG)), True
    raise ExportError(f"{out_dir} holds no export: no {BOOST_CONFIG} or {HF_CONFIG}")


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or one ExportError naming the file."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


# config.json's keys, each understood or refused by name (whichever transformers wrote it: 4 writes
# RoPE's settings as `rope_scaling` beside `rope_theta`, 5 as `rope_parameters` with theta inside).
# Numbers that become the model's:
HF_NUMBERS = {"hidden_size": "d_model", "intermediate_size": "d_ff", "num_hidden_layers": "n_layers",
              "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "head_dim": "head_dim",
              "vocab_size": "vocab_size", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta"}
HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
               "rms_norm_eps")
# Keys read elsewhere below, and keys that change nothing boost_jax computes (names, token ids,
# dtypes of the file, init, the cache switch, the context a checkpoint was made for)
HF_READ = {"model_type", "tie_word_embeddings", "rope_scaling", "rope_parameters", "layer_types"}
HF_HARMLESS = {"architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
               "pad_token_id", "initializer_range", "use_cache", "max_position_embeddings", "_name_or_path",
               "is_llama_config", "tokenizer_class"}
# Keys harmless at one value only (any other is a model boost_jax does not compute): sliding windows
# off (Qwen2's window size and layers are read only with them on), no o/MLP bias, no dropout
# (boost_jax trains without), no interleaved or multimodal RoPE, no tensor-parallel emulation.
HF_ONLY = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "attention_dropout": (0, 0.0),
           "pretraining_tp": (1,), "use_sliding_window": (False,), "rope_interleaved": (False,),
           "use_mrope": (False,)}
HF_IF_NO_WINDOW = {"sliding_window", "max_window_layers"}
# RoPE's settings: llama3's numbers, and the keys a rope dict may hold
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_KEYS = {"rope_type", "type", "rope_theta"}


def _from_hf_config(c: dict) -> ModelConfig:
    family = c.get("model_type", "llama")
    if family not in HF_FAMILIES:
        raise ExportError(f"config.json: model_type {family!r} cannot be imported (LLaMA, Qwen2: "
                          f"{sorted(HF_FAMILIES)})")
    for key, value in c.items():
        if key in HF_ONLY and value not in HF_ONLY[key]:
            raise ExportError(f"config.json: {key}={value!r} cannot be imported (only {HF_ONLY[key][0]!r})")
        if key not in {*HF_NUMBERS, *HF_READ, *HF_HARMLESS, *HF_ONLY, *HF_IF_NO_WINDOW}:
            raise ExportError(f"config.json: the key {key!r} is not understood by the importer, so the model "
                              "cannot be imported as it is meant (docs/design/hf-models.md lists the keys)")
    if bad := [t for t in c.get("layer_types") or [] if t != "full_attention"]:
        raise ExportError(f"config.json: layer_types holds {bad[0]!r}: only full attention (no sliding window) "
                          "can be imported")
    if missing := [k for k in HF_REQUIRED if k not in c]:
        raise ExportError(f"config.json lacks {missing}: not a {family} config")
    for key in HF_NUMBERS:
        value = c.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ExportError(f"config.json: {key} must be a number, got {value!r}")
    theta, scaling = _hf_rope(c)
    model = {field: c[key] for key, field in HF_NUMBERS.items() if c.get(key) is not None}
    return from_dict({"model": {
        **model, "arch": "dense", "mlp_gate_silu": True, "rope_theta": theta, "rope_scaling": scaling,
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)), "qkv_bias": HF_FAMILIES[family][1],
    }}).model


def _hf_rope(c: dict) -> tuple[float, dict]:
    """(rope theta, model.rope_scaling) of a config.json: transformers 5's `rope_parameters` or 4's
    `rope_scaling` (both: they must agree) beside `rope_theta`; default or llama3, every other type
    and key refused by name."""
    written = {k: c[k] for k in ("rope_parameters", "rope_scaling") if c.get(k) is not None}
    read = {key: _hf_rope_dict(key, rope) for key, rope in written.items()}
    if len(set(map(str, read.values()))) > 1:
        raise ExportError("config.json: rope_parameters and rope_scaling disagree: "
                          f"{written['rope_parameters']} against {written['rope_scaling']}")
    thetas = {("rope_theta", c.get("rope_theta"))} | {(f"{k}.rope_theta", r.get("rope_theta")) for k, r in written.items()}
    thetas = {(k, t) for k, t in thetas if t is not None}
    if len({t for _, t in thetas}) > 1:
        raise ExportError("config.json: " + " and ".join(f"{k} {t}" for k, t in sorted(thetas)) + " disagree")
    for key, theta in thetas:
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise ExportError(f"config.json: {key} must be a number, got {theta!r}")
    return float(thetas.pop()[1]) if thetas else 10000.0, next(iter(read.values()), {"type": "default"})


def _hf_rope_dict(key: str, rope) -> dict:
    """model.rope_scaling of one RoPE dict of config.json (`key` names it)."""
    if not isinstance(rope, dict):
        raise ExportError(f"config.json: {key} must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ExportError(f"config.json: {key}.rope_type {kind!r} cannot be imported (default, llama3)")
    known = ROPE_KEYS | (set(LLAMA3_ROPE) if kind == "llama3" else set())
    if unknown := sorted(set(rope) - known):
        raise ExportError(f"config.json: {key}.{unknown[0]} is not understood for rope_type {kind!r}")
    if kind == "default":
        return {"type": kind}
    if missing := [k for k in LLAMA3_ROPE if k not in rope]:
        raise ExportError(f"config.json: {key} of rope_type llama3 lacks {missing}")
    for k in LLAMA3_ROPE:
        if isinstance(rope[k], bool) or not isinstance(rope[k], (int, float)):
            raise ExportError(f"config.json: {key}.{k} must be a number, got {rope[k]!r}")
    return {"type": kind, **{k: float(rope[k]) for k in LLAMA3_ROPE[:3]},
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"])}


def _abstract_params(cfg: ModelConfig) -> dict:
    model = nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# ----------------------------------------------------------------------------- names


def _tensor_name(path: str, hf: bool) -> str:
    """Tensor name of a parameter path; per-layer names hold "{i}" (the stacked layer axis is split)."""
    if hf:
        return HF_NAMES[path]
    return "layers.{i}." + path.removeprefix("layers.") if path.startswith("layers.") else path


def _path_str(key_path) -> str:
    return ".".join(str(k.key) for k in key_path)


def _flat(tree: dict) -> dict[str, jax.Array]:
    return {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
