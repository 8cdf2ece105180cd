"""Train state, optimizer, and the jitted train / eval steps.

The state is a `TrainState` (model/train_state.py) of sharded arrays, so Orbax saves it as is and
restores it onto any mesh. The parameters themselves (their shapes, the seed's initial
values, their layout on a plan) are boost_jax/model/weights.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.config import Config
from boost_jax.model.train_state import TrainState
from boost_jax.model.weights import (
    abstract_model,
    abstract_params,
    adopt_layers,
    in_plan_order,
    param_shardings,
    place_params,
)
from boost_jax.parallel.pipeline import split_microbatches
from boost_jax.parallel.plan import Plan
from boost_jax.training.health import health_norms
from boost_jax.training.loss import batch_keys, evaluation, sharded_loss
from boost_jax.training.muon_layout import Placements, placements
from boost_jax.training.optimizers import latent_head_blocks, lr_schedule, make_optimizer


@dataclass(frozen=True)
class Setup:
    """What the loop needs besides the state: graph, optimizer, shardings, jitted steps (`build`)."""

    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    state_shardings: TrainState  # the state's shardings
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
    spike = None
    if cfg.train.spike_skip:  # the losses of the last spike_window applied updates (a ring) and how many were seen
        spike = jax.device_put({"losses": jnp.zeros((cfg.train.spike_window,), jnp.float32),
                                "seen": jnp.zeros((), jnp.int32)}, shardings.spike)
    return TrainState(
        params=params,
        opt_state=jax.jit(run.tx.init, out_shardings=shardings.opt_state)(params),
        step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
        rng=jax.device_put(jax.random.key_data(jax.random.key(cfg.train.seed)), shardings.rng),
        spike=spike,
    )


def abstract_state(cfg: Config, plan: Plan, tx: optax.GradientTransformation) -> TrainState:
    """The train state's shapes, dtypes and shardings (jax.ShapeDtypeStructs: nothing allocated), as
    `init_state` lays it out: each optimizer moment sharded like its parameter, the rest replicated."""
    params = abstract_params(cfg, plan)
    replicated = NamedSharding(plan.mesh, P())
    on = lambda shape, dtype, sharding=replicated: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    return TrainState(
        params=params,
        opt_state=abstract_optimizer_state(tx, params, plan),
        step=on((), jnp.int32),
        rng=on(key.shape, key.dtype),
        spike={"losses": on((cfg.train.spike_window,), jnp.float32), "seen": on((), jnp.int32)}
        if cfg.train.spike_skip else None,
    )


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
        loss, grads = grad_of(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        # Reserved for stochastic layers: advanced every step so a resumed run stays exact once used.
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(t)(state.step)}
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        apply = None  # whether this update is applied (None: always); the step and data advance regardless
        if t.on_nonfinite == "skip":
            apply = finite
            metrics["skipped"] = (~finite).astype(jnp.float32)
        window = None
        if t.spike_skip:
            spike, window = spike_window(state.spike, loss, finite, t.spike_skip)
            metrics["spike_skipped"] = spike.astype(jnp.float32)
            apply = ~spike if apply is None else apply & ~spike
        if apply is not None:  # the parameters and the optimizer's state keep their old values
            params, opt_state = jax.tree.map(lambda n, o: jnp.where(apply, n, o), (params, opt_state),
                                             (state.params, state.opt_state))
        new = TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=rng, spike=window)
        if cfg.log.health:  # on the steps that log only: a cond, not a mask
            due = (new.step % cfg.log.every == 0) | (new.step == t.steps)
            norms = lambda: health_norms(grads, new.params, updates, order, latent_head_blocks(cfg.model))
            metrics["health"] = jax.lax.cond(due, norms, lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(norms)))
        return new, metrics

    batch_shardings = dict.fromkeys(batch_keys(cfg), batch_sharding)
    jitted_train = jax.jit(
        train_step, in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated), donate_argnums=0,
    )
    return Setup(graphdef, tx, state_shardings, batch_sharding, jitted_train, evaluation(cfg, plan).eval_step,
                 order, state)


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
