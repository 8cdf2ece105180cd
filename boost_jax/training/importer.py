"""A run started from a model made elsewhere. `python -m boost_jax.convert import` (its docstring
describes it): the source read (an HF LLaMA / Qwen2 folder, an export, a run dir), optionally
factored into the svd arch or refactored into latent heads, and written as checkpoint 0 of a new
run. `train.init_from`: a new run's model taken from such a source (`with_source_model`, on the raw
config) and its parameters restored straight into the run's layout at its start
(`init_from_params`), with the run's own fresh optimizer, schedule and data."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from boost_jax.config import Config, DataConfig, ModelConfig, from_dict, load_yaml, raw_args
from boost_jax.data.build import build_data, check_run_tokenizer
from boost_jax.data.tokenizer import load_tokenizer
from boost_jax.model import Model, compress, latent_heads
from boost_jax.model.checkpoint import COMPUTE_ONLY, CheckpointStore, identity
from boost_jax.model.hf import load_exported, read_model_config
from boost_jax.model.run_dir import open_run
from boost_jax.model.weights import abstract_model, relayout_layers, restore_params
from boost_jax.parallel import Plan, single_device_plan
from boost_jax.runtime.errors import ConfigError
from boost_jax.training.step import setup


def read_source(src: Path, step: int | None):
    """(model config, parameters as a pure dict of numpy arrays, tokenizer.json path) of SRC."""
    if not src.is_dir():
        raise ConfigError(f"{src} is not a folder: give a Hugging Face LLaMA or Qwen2 folder, an export or a run dir")
    if (src / "config.yaml").is_file():  # a run dir
        run = open_run(src)
        model, _ = run.model(step, single_device_plan(run.cfg.model, run.cfg.parallel.scheme))
        params = jax_to_numpy(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        model_cfg = run.cfg.model
    else:
        if step is not None:
            raise ConfigError("--step applies to a run dir as SRC")
        model_cfg, params = load_exported(src)
    tokenizer = src / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError(f"{src} has no tokenizer.json: a run needs the tokenizer its model was trained with")
    if load_tokenizer(tokenizer).get_vocab_size() > model_cfg.vocab_size:  # a damaged file is named
        raise ConfigError(f"{tokenizer} has more tokens than the model's vocab_size {model_cfg.vocab_size}: "
                          "it is not this model's tokenizer")
    return model_cfg, params, tokenizer


def jax_to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def new_run_config(model_cfg, overrides, run_dir: Path, src: Path):
    """The new run's config: a run dir source's own data and train sections (defaults otherwise), the
    run's tokenizer for any corpus it prepares (data.tokenizer_path), the model's every field, then
    the overrides, then its run dir."""
    raw = raw_args(list(overrides))
    if (dims := raw.get("model", {}).get("attn_rope_dims")) not in (None, 0, "0"):
        # Decoupled RoPE moves the rotation from after B_k to a projection of its own: no refactoring of
        # a plain model's q/k reproduces its scores (docs/design/absorbed-attention.md).
        raise ConfigError(f"model.attn_rope_dims={dims}: a plain model cannot become one with decoupled RoPE exactly "
                          "(RoPE rotates its whole keys after B_k; decoupled RoPE rotates only a separate projection "
                          "of attn_rope_dims per head): train it with model.attn_rope_dims from the start")
    if model_keys := sorted(set(raw.get("model", {})) - {"attn_latent_heads"}):
        raise ConfigError(f"model.{model_keys[0]}: the model is the source's; an import takes no model keys but "
                          "model.attn_latent_heads (k and v refactored into that many latent heads)")
    base = {"data": {"tokenizer_path": str((run_dir / "tokenizer.json").absolute())}}
    if (src / "config.yaml").is_file():  # another run: train and read data as it did
        source = load_yaml(src / "config.yaml")
        base = {k: source[k] for k in ("train", "data", "checkpoint", "log") if k in source}
        base.setdefault("data", {})["tokenizer_path"] = str((run_dir / "tokenizer.json").absolute())
    merged = {**base, "model": dataclasses.asdict(model_cfg), "run_dir": str(run_dir)}
    for section, values in raw.items():
        merged[section] = {**merged.get(section, {}), **values} if isinstance(values, dict) else values
    merged["run_dir"] = str(run_dir)
    return from_dict(merged)


def calibration_tokens(directory: Path, tokenizer: Path, vocab_size: int, seq_len: int, samples: int, split: str):
    """(inputs, targets) [samples, seq_len] of the first windows of a prepared dataset's split; its
    tokenizer must be `tokenizer`'s."""
    data = build_data(DataConfig(source="prepared", path=str(directory)), vocab_size=vocab_size, seq_len=seq_len,
                      seed=0)
    check_run_tokenizer(data.tokenizer, tokenizer)
    source = data.train if split == "train" else data.val
    if source is None:
        raise ConfigError(f"--calibration {directory} has no {split} split")
    batches = source.eval_batches(-(-samples // 8), 8)
    return tuple(np.concatenate([b[k] for b in batches])[:samples] for k in ("inputs", "targets"))


def loss_of(model_cfg, params, inputs, targets) -> float:
    """Mean next-token loss of a model's parameters on tokens, one device."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Model(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
    plan = single_device_plan(model_cfg)

    @jax.jit
    def loss(params, x, y):
        logits = nnx.merge(graphdef, params)(x, plan=plan)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return float(sum(loss(params, inputs[i:i + 8], targets[i:i + 8]) * len(inputs[i:i + 8])
                     for i in range(0, len(inputs), 8)) / len(inputs))


def write_run(cfg, params: dict, tokenizer: Path, source: str) -> None:
    """RUN_DIR as a run: config.yaml, tokenizer.json, checkpoint 0 (these parameters, a fresh optimizer),
    written in a temporary folder beside it and renamed into place when whole."""
    run_dir = Path(cfg.run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=run_dir.parent, prefix=f".{run_dir.name}.import."))
    try:
        like = abstract_model(cfg)[1]
        params = jax.tree.map(lambda p, a: np.asarray(p, a.dtype), params, nnx.to_pure_dict(like))
        run, state = setup(cfg, single_device_plan(cfg.model, cfg.parallel.scheme), params)
        ckpt = CheckpointStore(tmp / "checkpoints", cfg.checkpoint.keep)
        try:
            ckpt.save(0, state, {"step": 0, "data_position": 0, **run.checkpoint_meta(), "loss": None,
                                 "identity": identity(cfg.to_dict()), "imported_from": source})
            ckpt.wait()
        finally:
            ckpt.close()
        cfg.dump(tmp / "config.yaml")
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked before any work)
        tmp.rename(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert(a: argparse.Namespace) -> dict:
    """The import the command line describes; returns its report."""
    model_cfg, params, tokenizer = read_source(a.src, a.step)
    out = {"source": str(a.src), "run_dir": str(a.run_dir), "arch": model_cfg.arch}
    if a.to:
        # a rank larger than a matrix, a non-dense source and the overrides, checked before the slow part
        cfg = new_run_config(compress.svd_config(model_cfg, a.rank), a.config, a.run_dir, a.src)
        covs, evals = None, {}
        if a.calibration is not None:
            shape = (model_cfg.vocab_size, cfg.train.seq_len, a.samples)
            calib, _ = calibration_tokens(a.calibration, tokenizer, *shape, "train")
            val_x, val_y = calibration_tokens(a.calibration, tokenizer, *shape, "val")
            evals["before"] = loss_of(model_cfg, params, val_x, val_y)
            if a.method == "whiten":
                model = Model(model_cfg, rngs=nnx.Rngs(0))
                nnx.update(model, params)
                covs = compress.covariances(model, calib)
        model_cfg, params, report = compress.compress(model_cfg, params, a.rank, covs)
        if fallbacks := sorted({f"layer {i} {name}: {e['whitening']}" for i, row in enumerate(report)
                                for name, e in row.items() if e.get("whitening", compress.PLAIN) != compress.PLAIN}):
            print(f"note: whitening by Cholesky ({compress.PLAIN}) failed on near-singular calibration "
                  f"covariances (--samples {a.samples}; more samples whiten better), so it fell back: "
                  + "; ".join(fallbacks), file=sys.stderr, flush=True)
        if a.calibration is not None:
            evals["after"] = loss_of(model_cfg, params, val_x, val_y)
        out["compression"] = {"method": a.method, "rank": a.rank, "layers": report,
                              **{f"val_loss_{k}": v for k, v in evals.items()}}
    cfg = new_run_config(model_cfg, a.config, a.run_dir, a.src)
    if (groups := cfg.model.attn_latent_heads) != model_cfg.attn_latent_heads:
        if model_cfg.attn_rope_dims:  # one rotary key per latent head: regrouping would have to invent keys
            raise ConfigError(f"model.attn_latent_heads={groups}: the source has decoupled RoPE "
                              f"(model.attn_rope_dims={model_cfg.attn_rope_dims}), one rotary key per latent head "
                              f"({model_cfg.attn_latent_heads}); its latent heads cannot be regrouped exactly")
        model_cfg, params, report = latent_heads.convert(model_cfg, params, groups)
        out["latent_heads"] = {"groups": groups, "method": latent_heads.method(model_cfg.arch), "layers": report}
    write_run(cfg, params, tokenizer, str(a.src))
    out["arch"] = cfg.model.arch
    return out


# ----------------------------------------------------------------------------- train.init_from


def split_init_from(value: str) -> tuple[Path, int | None]:
    """train.init_from's (path, step): PATH, or PATH@STEP (a run dir's checkpoint)."""
    path, at, step = value.rpartition("@")
    if at and step.isdigit() and not Path(value).exists():
        return Path(path).expanduser(), int(step)
    return Path(value).expanduser(), None


def source_model(value: str) -> tuple[ModelConfig, Path | None]:
    """(the model config, the tokenizer.json beside it if any) of train.init_from's source, read
    without its weights; a missing or unreadable source named."""
    path, step = split_init_from(value)
    if not path.is_dir():
        raise ConfigError(f"train.init_from: {path} " + ("is not a folder" if path.exists() else "does not exist")
                          + ": give a run dir (PATH or PATH@STEP), a Hugging Face folder or an export")
    if (path / "config.yaml").is_file():  # a run dir
        try:
            model = from_dict(load_yaml(path / "config.yaml")).model
        except ConfigError as e:
            raise ConfigError(f"train.init_from: {path / 'config.yaml'}: {e}") from None
    elif step is not None:
        raise ConfigError(f"train.init_from: @{step} names a checkpoint of a run dir; {path} is not one (no config.yaml)")
    else:
        model = read_model_config(path)
    tokenizer = path / "tokenizer.json"
    return model, tokenizer if tokenizer.is_file() else None


def with_source_model(raw: dict) -> dict:
    """A raw config (`raw_args`) whose `train.init_from` is set, with the model of its source: every
    model key the source's, a `model.*` key given that contradicts it refused by name (those of
    checkpoint.COMPUTE_ONLY excepted: they change how the model computes, not what its parameters
    mean), and data.tokenizer_path the source's tokenizer.json unless given. A run dir that already
    holds the run (its config.yaml) is resumed: its own model is the source then (init_from is ignored)."""
    value = (raw.get("train") or {}).get("init_from")
    if not value:
        return raw
    if not isinstance(value, str):
        raise ConfigError(f"train.init_from: expected a path, got {value!r}")
    run_dir = Path(raw.get("run_dir") or from_dict({}).run_dir)
    if (run_dir / "config.yaml").is_file():  # a resume: the run's own model and tokenizer
        saved = load_yaml(run_dir / "config.yaml") or {}
        model, tokenizer, where = from_dict({"model": saved.get("model", {})}).model, None, f"{run_dir}'s own"
        tokenizer_path = (saved.get("data") or {}).get("tokenizer_path")
        tokenizer = Path(tokenizer_path) if tokenizer_path else None
    else:
        model, tokenizer = source_model(value)
        where = f"train.init_from {value}'s"
    given = dict(raw.get("model") or {})
    merged = dataclasses.asdict(model)
    for key, value_given in given.items():
        if key not in merged or f"model.{key}" in COMPUTE_ONLY or key == "preset":
            merged[key] = value_given  # an unknown key is named by from_dict; a preset names sizes the source fixes
            continue
        ours = from_dict({"model": {**merged, key: value_given}}).model
        if getattr(ours, key) != getattr(model, key):
            how = (" (a run starts from its source's arch; factor a dense model with python -m boost_jax.convert "
                   "import SRC RUN_DIR --to svd --rank R)") if key == "arch" else " (the model is the source's)"
            raise ConfigError(f"model.{key}={value_given!r} contradicts {where} model, whose {key} is "
                              f"{getattr(model, key)!r}{how}")
    out = {**raw, "model": merged}
    if not (raw.get("data") or {}).get("tokenizer_path"):
        if tokenizer is None:
            raise ConfigError(f"train.init_from: {value} has no tokenizer.json: give the model's tokenizer as "
                              "data.tokenizer_path=FILE")
        out["data"] = {**(raw.get("data") or {}), "tokenizer_path": str(tokenizer.absolute())}
    return out


def init_from_params(cfg: Config, plan: Plan) -> tuple[dict, str]:
    """(train.init_from's parameters in the model's layer order, laid out for `plan`: a run dir's
    read straight onto the plan's devices (`weights.restore_params`, any mesh), an export's or HF
    folder's from the host; the log line saying so). The source must hold exactly this model."""
    path, step = split_init_from(cfg.train.init_from)
    model, _ = source_model(cfg.train.init_from)
    if changed := [f.name for f in dataclasses.fields(ModelConfig) if f.name != "preset"
                   and f"model.{f.name}" not in COMPUTE_ONLY and getattr(model, f.name) != getattr(cfg.model, f.name)]:
        raise ConfigError(f"train.init_from: {path} holds another model: model.{changed[0]} is "
                          f"{getattr(model, changed[0])!r} there, {getattr(cfg.model, changed[0])!r} here")
    if (path / "config.yaml").is_file():
        source = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=model.preset))
        params, step = restore_params(path, source, plan, step)
        order = plan.layer_order(cfg.model.n_layers)
        params = relayout_layers(params, order, np.arange(cfg.model.n_layers))  # init_state lays them out again
        return params, f"initialised from {path} step {step} (parameters only: a fresh optimizer from step 0)"
    _, params = load_exported(path)
    return params, f"initialised from {path} (parameters only: a fresh optimizer from step 0)"
