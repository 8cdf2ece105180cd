"""Pipeline parallelism as one SPMD program over the `pp` mesh axis (docs/design.md section 9).

The decoder's stacked layers are cut into S stages x R repeats of Lc layers: chunk c = r * S + s
(layers c * Lc ... c * Lc + Lc - 1) runs on stage s in repeat r, so a micro-batch passes stages
0 .. S-1 R times (R > 1 is the circular, interleaved schedule). Every iteration of one `lax.scan`
runs all stages at once (a `vmap` over the stage dimension, sharded on pp), then shifts each
stage's carry to the next stage with one `ppermute` (the only pipeline communication: under btp
the residual stays split on d, so a device sends [b, s, d/tp]). With M micro-batches the scan
runs M * R + S - 1 iterations, of which stage s idles S - 1: the bubble is (S - 1) / (R M + S - 1).

Micro-batch q = r * M + m enters stage 0 at iteration q and is on stage s at iteration q + s.
Stage 0 reads micro-batch m from its own buffer: the embedded input for r = 0, the output of repeat
r - 1 (which came round the ring from stage S-1 and waited there; M >= S) after that. Stage S-1
writes the last repeat's outputs to its buffer. Bubble slots compute on zeros, so whatever a stage
holds between micro-batches never reaches a result or a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from boost_jax.config.schemes import PP


@dataclass(frozen=True)
class Schedule:
    """The circular pipeline schedule: S stages, R chunks per stage, M micro-batches."""

    stages: int  # S = parallel.pp
    repeats: int  # R = parallel.pp_repeats
    microbatches: int  # M = train.microbatches

    @property
    def iterations(self) -> int:
        """Iterations of the pipeline's loop: M R + S - 1."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of a stage's iterations spent idle: (S - 1) / (M R + S - 1)."""
        return (self.stages - 1) / self.iterations

    def layer_order(self, n_layers: int) -> np.ndarray:
        """The model layer stored at each position of the stacked layers: stage-major, so that one
        stage's chunks of every repeat are one contiguous pp shard (model order when R = 1)."""
        s_, r_ = self.stages, self.repeats
        per = n_layers // (s_ * r_)
        return np.array([(r * s_ + s) * per + j for s in range(s_) for r in range(r_) for j in range(per)])


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]. Micro-batch m takes rows m, m + M, m + 2M, ...: every device keeps
    1/M of its own rows in each, so the split moves no data across the batch axes."""
    return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: [M, B/M, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run_pipeline(mesh, schedule: Schedule, layer_fn: Callable, layers, carry, context=None, *,
                 bubble_value: float = 0.0):
    """Apply the stacked layers to every micro-batch's carry.

    layer_fn(layer_params, carry, context) -> carry for one micro-batch and one layer; `layers` is a
    pytree of [L, ...] stacked in `schedule.layer_order` (sharded on pp along L); `carry` a pytree
    of [M, ...] (the residual, and LaX latents, which ride along with it); `context` a pytree of
    [M, ...] each layer reads but does not change (the tokens' positions): every stage indexes the
    micro-batch it works on, so it never travels between stages. Returns the carries after all L
    layers. `bubble_value` fills the stage carries before the first micro-batch arrives (tests set
    NaN to show no bubble reaches a result).
    """
    s_, r_, m_ = schedule.stages, schedule.repeats, schedule.microbatches
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    per_chunk = n_layers // (s_ * r_)
    # [L] -> [S, R, Lc], stage s holding chunks r * S + s: the stored order puts them in its own shard.
    staged = jax.tree.map(lambda p: p.reshape(s_, r_, per_chunk, *p.shape[1:]), layers)

    def run_chunk(stage_layers, repeat, x, ctx):
        # With one repeat the chunk is the stage's (a static slice): the loop's backward then keeps no
        # copy of its weights. Picked by a traced repeat, it keeps one per iteration (the memory model
        # counts them).
        if r_ == 1:
            chunk = jax.tree.map(lambda p: p[0], stage_layers)
        else:
            chunk = jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, repeat, 0, keepdims=False), stage_layers)
        return jax.lax.scan(lambda c, lp: (layer_fn(lp, c, ctx), None), x, chunk)[0]

    def stage_step(stage, t, stage_layers, arrived, inbox, outbox):
        """One stage at iteration t: `arrived` is what the previous stage sent."""
        returned = t - s_  # the micro-batch arriving at stage 0 from stage S-1, if it must go round again
        keep = (stage == 0) & (returned >= 0) & (returned < m_ * (r_ - 1))
        inbox = _put(inbox, returned % m_, arrived, keep)
        q = t - stage  # the micro-batch this stage works on
        valid = (q >= 0) & (q < m_ * r_)
        x = jax.tree.map(lambda a, b: jnp.where(stage == 0, b, a), arrived, _take(inbox, q % m_))
        x = jax.tree.map(lambda v: jnp.where(valid, v, jnp.zeros_like(v)), x)  # bubbles run on zeros
        y = run_chunk(stage_layers, jnp.clip(q // m_, 0, r_ - 1), x, _take(context, q % m_))
        outbox = _put(outbox, q % m_, y, (stage == s_ - 1) & valid & (q >= m_ * (r_ - 1)))
        return y, inbox, outbox

    stages = jnp.arange(s_)
    every_stage = lambda tree: jax.tree.map(lambda v: jnp.broadcast_to(v[None], (s_, *v.shape)), tree)
    state = jax.tree.map(lambda v: jnp.full((s_, *v.shape[1:]), bubble_value, v.dtype), carry)
    inbox, outbox = every_stage(carry), every_stage(jax.tree.map(jnp.zeros_like, carry))
    shift = _shifter(mesh, s_)

    def iteration(loop, t):
        state, inbox, outbox = loop
        step = jax.vmap(stage_step, in_axes=(0, None, 0, 0, 0, 0), spmd_axis_name=PP)
        state, inbox, outbox = step(stages, t, staged, jax.tree.map(shift, state), inbox, outbox)
        return (state, inbox, outbox), None

    (_, _, outbox), _ = jax.lax.scan(iteration, (state, inbox, outbox), jnp.arange(schedule.iterations))
    return jax.tree.map(lambda v: v[s_ - 1], outbox)


def _shifter(mesh, stages: int) -> Callable:
    """[S, ...] -> [S, ...] with stage s receiving stage s - 1's slice (stage 0: stage S-1's): one
    collective-permute over pp; the other mesh axes keep their layout."""
    ring = [(i, (i + 1) % stages) for i in range(stages)]
    return jax.shard_map(lambda v: jax.lax.ppermute(v, PP, ring), mesh=mesh, in_specs=P(PP), out_specs=P(PP),
                         axis_names={PP})


def _take(tree, index):
    return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, index, 0, keepdims=False), tree)


def _put(tree, index, value, when):
    """tree[index] = value where `when`: only that one slot is touched."""
    def one(buf, v):
        old = jax.lax.dynamic_index_in_dim(buf, index, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(when, v, old), index, 0)

    return jax.tree.map(one, tree, value)
