"""A model's parameters, apart from any training: their abstract shapes, the seed's initial values,
their layout on a plan, the layer stack's storage order, and a checkpoint's parameters read alone.

    graphdef, abstract = abstract_model(cfg)        # shapes, dtypes, logical axes: no arrays
    params = place_params(cfg, plan)                # the seed's parameters laid out for plan
    params, step = restore_params(run_dir, cfg, plan)   # a checkpoint's, read straight onto plan

`restore_params` is what every inference command (generate, eval, export, convert, lm_eval) and
`api.restore` load a model with: Orbax reads only the checkpoint's `params` (no optimizer moments:
a third of the train state's bytes in fp32 AdamW) into the plan's shardings, each device its own
shards, so a model that needed a mesh to train is served on one without ever sitting whole on one
device or on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boost_jax.config import Config, ModelConfig
from boost_jax.model import Model
from boost_jax.model.checkpoint import CheckpointStore, model_identity
from boost_jax.model.train_state import TrainState
from boost_jax.parallel.plan import Plan
from boost_jax.runtime.errors import ConfigError


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameters' shapes, dtypes and logical axes, with no arrays."""
    graphdef, params = _abstract_model(cfg.model)
    return graphdef, jax.tree.map(lambda x: x, params)  # a container of its own: a caller may edit it


@functools.cache
def _abstract_model(model_cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    # Traced once per model (shapes do not depend on the seed): planning, placing and analysing a
    # model ask for it again and again.
    return nnx.split(nnx.eval_shape(lambda: Model(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)


def init_params(cfg: Config) -> dict:
    """Parameters from the seed alone (jitted, on one device): identical on every mesh."""
    return _jitted_init(cfg.model, cfg.train.seed)()


@functools.cache
def _jitted_init(model_cfg: ModelConfig, seed: int) -> Callable[[], dict]:
    # One jitted initializer per (model, seed), so a process that initialises the same model again
    # (a resume, an export, a test) reuses its trace and executable; it holds no arrays.
    return jax.jit(_initializer(model_cfg, seed))


def _initializer(model_cfg: ModelConfig, seed: int) -> Callable[[], dict]:
    return lambda: nnx.to_pure_dict(nnx.state(Model(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param))


def place_params(cfg: Config, plan: Plan) -> dict:
    """The seed's parameters laid out for `plan`: sharded, and the layers in its storage order.

    On an accelerator every device computes only its own shards, so no device ever holds the whole
    model (llama-30b in fp32: 120 GB). On the CPU (the simulated meshes of tests and analysis) the
    parameters are computed once on one device and then placed: one compiled initializer serves
    every mesh, where a sharded one compiles again for each. The values are the same either way
    (JAX's threefry random bits, partitionable by default, do not depend on how an array is sharded)."""
    if plan.mesh.devices.flat[0].platform == "cpu":
        return jax.device_put(in_plan_order(init_params(cfg), cfg, plan), param_shardings(cfg, plan))
    return sharded_init(cfg, plan)()


def sharded_init(cfg: Config, plan: Plan) -> Callable[[], dict]:
    """The seed's parameters computed where `plan` keeps them (each device its own shards, the
    layers in the plan's storage order), as a jitted function of nothing."""
    init = _initializer(cfg.model, cfg.train.seed)
    return jax.jit(lambda: in_plan_order(init(), cfg, plan), out_shardings=param_shardings(cfg, plan))


def in_plan_order(params: dict, cfg: Config, plan: Plan) -> dict:
    """Parameters in the model's layer order -> the plan's storage order (a pipeline's)."""
    return relayout_layers(params, np.arange(cfg.model.n_layers), plan.layer_order(cfg.model.n_layers))


def param_shardings(cfg: Config, plan: Plan) -> dict:
    """Each parameter's NamedSharding under `plan`, as a pure dict."""
    return plan.named(plan.param_specs(abstract_model(cfg)[1]))


def abstract_params(cfg: Config, plan: Plan) -> dict:
    """The parameters as jax.ShapeDtypeStructs laid out for `plan` (a pure dict): nothing allocated."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nnx.to_pure_dict(abstract_model(cfg)[1]), param_shardings(cfg, plan))


def relayout_layers(tree, src_order, dst_order):
    """Every leaf under a "layers" key (parameters, optimizer moments) moved along its stacked layer
    axis from one storage order (model layer at each position) to another."""
    if np.array_equal(src_order, dst_order):
        return tree
    index = np.argsort(src_order)[np.asarray(dst_order)]
    under_layers = lambda path: any(getattr(k, "key", None) == "layers" for k in path)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.take(x, index, axis=0) if under_layers(path) else x, tree)


def restore_params(run_dir: str | Path, cfg: Config, plan: Plan, step: int | None = None) -> tuple[dict, int]:
    """(the parameters of checkpoint `step` (default: the newest) of a run dir whose config is `cfg`,
    laid out for `plan`; the step). Only the parameters are read, each device reading its own
    shards; the checkpoint must be of this model (its identity less checkpoint.COMPUTE_ONLY)."""
    shardings = param_shardings(cfg, plan)
    like = TrainState(params=abstract_params(cfg, plan))
    if not (Path(run_dir) / "checkpoints").is_dir():
        raise ConfigError(f"{run_dir} has no checkpoint (train with checkpoint.every > 0)")
    ckpt = CheckpointStore(Path(run_dir) / "checkpoints", cfg.checkpoint.keep, read_only=True)
    try:
        asked, step = step is not None, checkpoint_step(run_dir, ckpt, step)
        read = lambda at: ckpt.restore(at, like, model_identity(cfg.to_dict()), subset=True)
        (state, meta), step = ckpt.read_live(step, read, asked=asked)  # a live run's retention may delete it
    finally:
        ckpt.close()
    return adopt_layers(state, meta, plan.layer_order(cfg.model.n_layers), TrainState(params=shardings)).params, step


def adopt_layers(tree, meta: dict, order: np.ndarray, shardings):
    """A restored tree (parameters, or the train state) in the storage order `order`: a checkpoint
    records the order it was saved in (`layer_order`), so one saved under another pipeline layout
    restores here too. Moved on the devices, into `shardings`."""
    saved = np.asarray(meta.get("layer_order", np.arange(len(order))))
    if np.array_equal(saved, order):
        return tree
    relayout = lambda t: relayout_layers(t, saved, order)
    return jax.jit(relayout, out_shardings=shardings, donate_argnums=0)(tree)


def checkpoint_step(run_dir: str | Path, ckpt: CheckpointStore, step: int | None) -> int:
    """The checkpoint a command on a run dir reads: `step`, or the newest; one message if there is none."""
    steps = sorted(ckpt.all_steps())
    if not steps:
        raise ConfigError(f"{run_dir} has no checkpoint (train with checkpoint.every > 0)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ConfigError(f"{run_dir} has no checkpoint of step {step}; it has steps {steps}")
    return step
