"""The Python API for notebooks and scripts.

    from boost_jax import api
    cfg = api.config("llama-tiny", "model.arch=cola")        # a preset name or a YAML path, plus overrides
    model = api.build_model(cfg)                              # a Flax NNX module, initialised from train.seed
    logits = api.forward(model, tokens)                       # int[B, S] -> fp32 [B, S, vocab], on one device
    cfg, model, step = api.restore("runs/default")            # newest checkpoint of a run dir
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from boost_jax.config import Config, ConfigError, from_dict, load_config, load_yaml
from boost_jax.model import Model
from boost_jax.parallel import Plan, single_device_plan
from boost_jax.presets import PRESETS


def config(base: str | Path | None = None, *overrides: str) -> Config:
    """A config from a preset name (`"llama-7b"`) or a YAML file, then `key=value` overrides."""
    if base is not None and str(base) in PRESETS:
        return load_config(None, (f"model.preset={base}", *overrides))
    if base is not None and not Path(base).is_file():
        raise ConfigError(f"{str(base)!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file")
    return load_config(base, overrides)


def build_model(cfg: Config) -> Model:
    """The model of `cfg`, its parameters initialised from `train.seed`."""
    return Model(cfg.model, rngs=nnx.Rngs(cfg.train.seed))


def forward(model: Model, tokens: jax.Array, plan: Plan | None = None) -> jax.Array:
    """Logits of `model` run under `plan`; None runs it on one device (`single_device_plan`)."""
    plan = plan or single_device_plan(model.cfg)
    graphdef, params = nnx.split(model)
    return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens, plan=plan))(params, tokens)


def restore(run_dir: str | Path, step: int | None = None) -> tuple[Config, Model, int]:
    """(config, model with the checkpoint's parameters, step) from a run dir, on one device."""
    from boost_jax.checkpoint import Checkpointer, identity
    from boost_jax.step import setup

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run dir: no config.yaml")
    cfg = _run_config(run_dir / "config.yaml")
    if not (run_dir / "checkpoints").is_dir():
        raise ConfigError(f"{run_dir} has no checkpoint (train with checkpoint.every > 0)")
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, read_only=True)
    try:
        steps = sorted(ckpt.all_steps())
        if not steps:
            raise ConfigError(f"{run_dir} has no checkpoint (train with checkpoint.every > 0)")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ConfigError(f"{run_dir} has no checkpoint of step {step}; it has steps {steps}")
        run, like = setup(cfg, single_device_plan(cfg.model, cfg.parallel.scheme))
        # Only the model decides what the parameters mean (data and batch keys matter to resuming).
        state, meta = ckpt.restore(step, like, identity(cfg.to_dict(), keys=("model",)))
        state = run.adopt(state, meta)
    finally:
        ckpt.close()
    return cfg, nnx.merge(run.graphdef, state["params"]), step


def _run_config(path: Path) -> Config:
    """A run dir's config.yaml, with any problem named by its file."""
    raw = load_yaml(path)
    try:
        return from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path} is damaged or edited: {e}") from None
