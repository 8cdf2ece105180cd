"""The loss of a plan's model on a batch and the jitted eval step: what evaluating a checkpoint needs
and nothing of training's optimizers (`python -m boost_jax.eval` imports this, not step.py, which
builds the train step on top of it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.config import Config, TrainConfig
from boost_jax.model import loss_fn
from boost_jax.model.weights import abstract_model, param_shardings
from boost_jax.parallel.context import balance
from boost_jax.parallel.plan import Plan

PACKED_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")  # instruction data (data/packing.py)


def batch_keys(cfg: Config) -> tuple[str, ...]:
    """The arrays of a batch, each [B, S] laid out on the batch axes: the tokens, their next tokens,
    and with `data.document_mask` each token's document (data/loader.py); instruction data's packed
    rows also carry each token's position in its document and the targets' loss weights (float32)."""
    if cfg.data.format != "text":
        return PACKED_KEYS
    return ("inputs", "targets", *(("segment_ids",) if cfg.data.document_mask else ()))


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
