"""Train state, optimizer, and the jitted train / eval steps.

The state is a plain pytree `{params, opt_state, step, rng}` of sharded arrays, so Orbax saves it
as is and restores it onto any mesh. The parameters themselves (their shapes, the seed's initial
values, their layout on a plan) are boost_jax/model/weights.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.config import Config, TrainConfig
from boost_jax.model import loss_fn
from boost_jax.model.weights import (
    abstract_model,
    abstract_params,
    adopt_layers,
    in_plan_order,
    param_shardings,
    place_params,
)
from boost_jax.parallel.context import balance
from boost_jax.parallel.pipeline import split_microbatches
from boost_jax.parallel.plan import Plan
from boost_jax.training.health import health_norms
from boost_jax.training.muon_layout import Placements, placements
from boost_jax.training.optimizers import latent_head_blocks, lr_schedule, make_optimizer

TrainState = dict[str, Any]
# Parts of the state that exist under some settings only: a checkpoint without one resumes with it
# fresh, and one with it resumes without (train.spike_skip's window of recent losses).
OPTIONAL_STATE = ("spike",)


PACKED_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")  # instruction data (data/packing.py)


def batch_keys(cfg: Config) -> tuple[str, ...]:
    """The arrays of a batch, each [B, S] laid out on the batch axes: the tokens, their next tokens,
    and with `data.document_mask` each token's document (data/loader.py); instruction data's packed
    rows also carry each token's position in its document and the targets' loss weights."""
    if cfg.data.format != "text":
        return PACKED_KEYS
    return ("inputs", "targets", *(("segment_ids",) if cfg.data.document_mask else ()))


@dataclass(frozen=True)
class Setup:
    """What the loop needs besides the state: graph, optimizer, shardings, jitted steps (`build`)."""

    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    state_shardings: Any
    batch_sharding: NamedSharding
    train_step: Callable
    eval_step: Callable
    layer_order: np.ndarray  # the model layer at each position of the stored layer stacks (plan.layer_order)
    abstract_state: TrainState  # the state's jax.ShapeDtypeStructs, with their shardings (what the steps compile for)

    def adopt(self, state: TrainState, meta: dict) -> TrainState:
        """A restored state in this run's layer order; a checkpoint records the order it was saved in
        (`checkpoint_meta`), so one saved under another pipeline layout restores here too."""
        return adopt_layers(state, meta, self.layer_order, self.state_shardings)

    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of this setup: the stored layer order."""
        return {"layer_order": self.layer_order.tolist()}


def setup(cfg: Config, plan: Plan, params: dict | None = None, moved: Placements | None = None
          ) -> tuple[Setup, TrainState]:
    """The train and eval steps of `cfg` under `plan` (`build`, with `moved`) and the seed's train
    state laid out for them (or one around `params`, host arrays in the model's layer order and
    dtypes, with a fresh optimizer: an import)."""
    run = build(cfg, plan, moved)
    return run, init_state(cfg, plan, run, params)


def init_state(cfg: Config, plan: Plan, run: Setup, params: dict | None = None) -> TrainState:
    """The seed's train state (or one around `params`) in `run`'s shardings."""
    if params is None:
        params = place_params(cfg, plan)
    else:  # placed as they are: no seed's parameters beside them
        params = jax.device_put(in_plan_order(params, cfg, plan), param_shardings(cfg, plan))
    shardings = run.state_shardings
    state = {
        "params": params,
        "opt_state": jax.jit(run.tx.init, out_shardings=shardings["opt_state"])(params),
        "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]),
        "rng": jax.device_put(jax.random.key_data(jax.random.key(cfg.train.seed)), shardings["rng"]),
    }
    if cfg.train.spike_skip:  # the losses of the last spike_window applied updates (a ring) and how many were seen
        state["spike"] = jax.device_put({"losses": jnp.zeros((cfg.train.spike_window,), jnp.float32),
                                         "seen": jnp.zeros((), jnp.int32)}, shardings["spike"])
    return state


def abstract_state(cfg: Config, plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The train state's shapes, dtypes and shardings (jax.ShapeDtypeStructs: nothing allocated), as
    `init_state` lays it out: each optimizer moment sharded like its parameter, the rest replicated."""
    params = abstract_params(cfg, plan)
    replicated = NamedSharding(plan.mesh, P())
    on = lambda shape, dtype, sharding=replicated: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    state = {
        "params": params,
        "opt_state": abstract_optimizer_state(tx, params, plan),
        "step": on((), jnp.int32),
        "rng": on(*(lambda k: (k.shape, k.dtype))(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))))),
    }
    if cfg.train.spike_skip:
        state["spike"] = {"losses": on((cfg.train.spike_window,), jnp.float32), "seen": on((), jnp.int32)}
    return state


def abstract_optimizer_state(tx: optax.GradientTransformation, params: dict, plan: Plan) -> dict:
    """`tx`'s state on `params` (jax.ShapeDtypeStructs with their shardings) as jax.ShapeDtypeStructs,
    laid out as the train step lays it out: each moment sharded like its parameter, the rest replicated."""
    shapes = jax.eval_shape(tx.init, params)
    specs = plan.named(optimizer_state_specs(shapes, params, jax.tree.map(lambda p: p.sharding.spec, params)))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, specs)


def abstract_batch(cfg: Config, plan: Plan) -> dict:
    """A global batch's shapes and layout (jax.ShapeDtypeStructs), as the train and eval steps take it."""
    rows = lambda dtype: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), dtype,
                                              sharding=plan.sharding(("batch", None)))
    return {k: rows(jnp.float32 if k == "weights" else jnp.int32) for k in batch_keys(cfg)}


def build(cfg: Config, plan: Plan, moved: Placements | None = None) -> Setup:
    """The jitted train and eval steps of `cfg` under `plan`, from abstract shapes alone (no array is
    made): what `train` runs, what `bench step` times, and what `python -m boost_jax.compile` compiles
    for GPUs it does not have. `moved`: the Muon placements (training/muon_layout.py) where the
    caller has them already (`train` checks them before the run dir is locked); else computed here."""
    graphdef, abstract = abstract_model(cfg)
    pspecs = plan.param_specs(abstract)
    moved = placements(cfg, plan) if moved is None else moved
    tx = make_optimizer(cfg.train, nnx.to_pure_dict(abstract), moved, split=plan.mesh.size > 1,
                        blocks=latent_head_blocks(cfg.model))
    replicated = NamedSharding(plan.mesh, P())
    state = abstract_state(cfg, plan, tx)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    t = cfg.train
    batch_sharding = plan.sharding(("batch", None))
    loss_of = sharded_loss(graphdef, plan, t)
    grad_of = accumulated_grad(loss_of, plan, t.microbatches, plan.named(pspecs))
    order = plan.layer_order(cfg.model.n_layers)

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        loss, grads = grad_of(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        # Reserved for stochastic layers: advanced every step so a resumed run stays exact once used.
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(t)(state["step"])}
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        apply = None  # whether this update is applied (None: always); the step and data advance regardless
        if t.on_nonfinite == "skip":
            apply = finite
            metrics["skipped"] = (~finite).astype(jnp.float32)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        if t.spike_skip:
            spike, new["spike"] = spike_window(state["spike"], loss, finite, t.spike_skip)
            metrics["spike_skipped"] = spike.astype(jnp.float32)
            apply = ~spike if apply is None else apply & ~spike
        if apply is not None:
            for key in ("params", "opt_state"):
                new[key] = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new[key], state[key])
        if cfg.log.health:  # on the steps that log only: a cond, not a mask
            due = (new["step"] % cfg.log.every == 0) | (new["step"] == t.steps)
            norms = lambda: health_norms(grads, new["params"], updates, order, latent_head_blocks(cfg.model))
            metrics["health"] = jax.lax.cond(due, norms, lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(norms)))
        return new, metrics

    batch_shardings = dict.fromkeys(batch_keys(cfg), batch_sharding)
    jitted_train = jax.jit(
        train_step, in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated), donate_argnums=0,
    )
    return Setup(graphdef, tx, state_shardings, batch_sharding, jitted_train, evaluation(cfg, plan).eval_step,
                 order, state)


@dataclass(frozen=True)
class Evaluation:
    """A plan's jitted eval step, loss(params, batch), and the layout of the batches it takes: what
    evaluating needs, without a train state (`python -m boost_jax.eval`)."""

    eval_step: Callable
    batch_sharding: NamedSharding


def evaluation(cfg: Config, plan: Plan) -> Evaluation:
    """The eval step of `cfg`'s model under `plan`: the cross-entropy alone (no z-loss term)."""
    batch_sharding = plan.sharding(("batch", None))
    eval_of = sharded_loss(abstract_model(cfg)[0], plan, dataclasses.replace(cfg.train, z_loss=0.0))
    jitted = jax.jit(eval_of, in_shardings=(param_shardings(cfg, plan), dict.fromkeys(batch_keys(cfg), batch_sharding)),
                     out_shardings=NamedSharding(plan.mesh, P()))
    return Evaluation(jitted, batch_sharding)


def optimizer_state_specs(opt_shapes, params: dict, param_specs):
    """Each optimizer-state leaf's PartitionSpec: a moment takes its parameter's (`param_specs`, a tree
    like `params`: the parameter at the end of the leaf's dict-key path, of its shape); counters and
    the rest are replicated. (optax's `tree_map_params` cannot see through the masks of
    `optax.partition`, which muon and spectron use.)"""
    keys = lambda path: tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    param_at = {keys(path): (p.shape, s) for (path, p), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs)}

    def spec(path, leaf):
        k = keys(path)
        shape, s = next((param_at[k[i:]] for i in range(len(k)) if k[i:] in param_at), (None, None))
        return s if shape == leaf.shape else P()

    return jax.tree_util.tree_map_with_path(spec, opt_shapes)


def spike_window(window: dict, loss: jax.Array, finite: jax.Array, threshold: float) -> tuple[jax.Array, dict]:
    """(whether `loss` is a spike: above the mean of the window's losses by `threshold` of their
    standard deviations, once the window is full; the window with `loss` added unless it is a spike
    or not finite)."""
    losses, seen = window["losses"], window["seen"]
    spike = (seen >= losses.shape[0]) & (loss > losses.mean() + threshold * losses.std())
    added = finite & ~spike
    losses = jnp.where(added, losses.at[seen % losses.shape[0]].set(loss), losses)
    return spike, {"losses": losses, "seen": seen + added.astype(jnp.int32)}


def accumulated_grad(loss_of: Callable, plan: Plan, microbatches: int, param_shardings) -> Callable:
    """(loss, grads) of the global batch, computed over `microbatches` micro-batches in a scan with
    gradients summed in fp32: the same mean over all tokens as one pass, in 1/M of the activations.
    Under a pipeline the micro-batches already flow through its stages inside the loss."""
    if microbatches == 1 or plan.pipeline:
        return jax.value_and_grad(loss_of)

    def split(x):
        return plan.constrain(split_microbatches(x, microbatches), (None, "batch", None))

    def grad_of(params, batch):
        def add(acc, micro):
            loss, grads = jax.value_and_grad(loss_of)(params, micro)
            return (acc[0] + loss, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc[1], grads)), None

        zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s),
                             params, param_shardings)
        (loss, grads), _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), zeros), jax.tree.map(split, batch))
        return loss / microbatches, jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grads, params)

    return grad_of


def sharded_loss(graphdef: nnx.GraphDef, plan: Plan, train: TrainConfig) -> Callable:
    """loss(params, batch) of the model run under `plan`, with the train config's remat and loss
    chunking; under context parallelism the batch is put in the load-balanced order first."""
    cp = plan.size("seq")

    def loss_of(params, batch):
        if cp > 1:
            batch = balance(batch, cp)
        return loss_fn(nnx.merge(graphdef, params), batch, plan, train.remat, train.loss_chunk, train.z_loss)

    return loss_of


def device_batch(host_batch: dict, sharding: NamedSharding) -> dict:
    """This process's rows -> one global array per key, laid out over the mesh's batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in host_batch.items()}
