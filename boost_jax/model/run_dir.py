"""A run dir opened for inference (generate, eval, lm_eval, export, convert and the API): its config
read and checked once, then JAX prepared, the plan, the checkpoint's parameters, the tokenizer.

    run = open_run("runs/default", ["parallel.tp=2"], prepare=True)   # config read and checked
    model, step = run.model()                        # the newest checkpoint, on the run's plan
    tokenizer, eos = run.tokenizer, run.eos

Each part is made on first use, so a command names what is wrong in its own order (a missing
tokenizer before the devices are asked for, a prompt before the slow restore).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer

from boost_jax.config import Config, ConfigError, from_dict, load_config, load_yaml
from boost_jax.data.chat import ChatTokens
from boost_jax.data.instruct import run_chat
from boost_jax.data.tokenizer import eos_id, load_tokenizer
from boost_jax.launch.prepare import prepare_jax
from boost_jax.model import Model
from boost_jax.model.checkpoint import COMPUTE_ONLY, changed_keys, model_identity
from boost_jax.model.decode import DECODING_LAYOUT
from boost_jax.model.weights import abstract_model, restore_params
from boost_jax.parallel import Plan, make_plan
from boost_jax.parallel.mesh import mesh_devices


def open_run(run_dir: str | Path, overrides: Sequence[str] = (), *, decoding: bool = False, prepare: bool = False,
             reuse_memory: bool = True) -> Run:
    """A run dir with its config (`read_config`); `prepare`: JAX prepared from it (launch/prepare.py,
    with `reuse_memory`) before anything starts JAX's backend."""
    cfg = read_config(run_dir, overrides, decoding=decoding)
    run = Run(Path(run_dir), cfg)
    if prepare:
        prepare_jax(run.cfg, reuse_memory=reuse_memory)
    return run


def read_config(run_dir: str | Path, overrides: Sequence[str] = (), *, decoding: bool = False) -> Config:
    """A run dir's config (its config.yaml, then `overrides`), after checking it is a run dir. An
    override that changes what the run's parameters mean (a `model.*` key outside
    checkpoint.COMPUTE_ONLY) is refused here, before any work (restoring checks each checkpoint's own
    record too). `decoding` (generate, lm_eval): a layout with pipeline stages or context parallelism
    is refused here, by what decoding lacks, before make_plan would first ask the stages for
    micro-batches decoding never uses."""
    if not isinstance(run_dir, (str, Path)):
        raise ConfigError(f"run_dir must be a path (str or Path), got {type(run_dir).__name__}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run dir not found: {run_dir}")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run dir: no config.yaml")
    try:
        saved = from_dict(load_yaml(path))
    except ConfigError as e:
        raise ConfigError(f"{path} is damaged or edited: {e}") from None
    cfg = load_config(path, overrides)
    if changed := changed_keys(model_identity(saved.to_dict()), model_identity(cfg.to_dict())):
        raise ConfigError(f"{run_dir} holds a model with a different {', '.join(changed)}: the overrides may "
                          f"change how it computes ({', '.join(COMPUTE_ONLY)}) and its layout (parallel.*), "
                          "not what its parameters mean")
    if decoding and (cfg.parallel.pp > 1 or cfg.parallel.cp > 1):
        raise ConfigError(f"parallel.pp={cfg.parallel.pp} parallel.cp={cfg.parallel.cp}: {DECODING_LAYOUT}")
    return cfg


class Run:
    """A run dir and its config; the plan, parameters and tokenizer read from it when asked."""

    def __init__(self, run_dir: Path, cfg: Config):
        self.run_dir, self.cfg = run_dir, cfg

    @functools.cached_property
    def plan(self) -> Plan:
        """The config's layout on its devices (after `prepare`: asking for devices starts the backend)."""
        return make_plan(self.cfg, mesh_devices(self.cfg.parallel))

    def params(self, step: int | None = None, plan: Plan | None = None) -> tuple[dict, int]:
        """(the parameters of checkpoint `step` (default: the newest) laid out for `plan` (default: the
        run's own), the step): only the parameters are read (`weights.restore_params`)."""
        return restore_params(self.run_dir, self.cfg, plan or self.plan, step)

    def model(self, step: int | None = None, plan: Plan | None = None) -> tuple[Model, int]:
        """`params` as a model."""
        params, step = self.params(step, plan)
        return nnx.merge(abstract_model(self.cfg)[0], params), step

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer.json every training run saves in its run dir."""
        return load_tokenizer(self.run_dir / "tokenizer.json")

    @functools.cached_property
    def chat(self) -> ChatTokens:
        """The run's chat template with its tokenizer (data/instruct.run_chat): what a chat renders
        and the end-of-turn tokens it stops at."""
        return run_chat(self.tokenizer, self.run_dir / "tokenizer.json", self.cfg.data)

    @property
    def eos(self) -> int:
        """The tokenizer's end-of-document token: where a continuation stops."""
        return eos_id(self.tokenizer)
