"""The few blocks whose collectives must be exact, written with `jax.shard_map`.

Everything else is left to XLA's SPMD partitioner, which derives collectives from the plan's
layouts (`parallel/plan.py`); here the layout alone would let it pick something worse. Each block
takes the plan explicitly. docs/design.md derives the math.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from boost_jax.parallel.remat import LATENT
from boost_jax.parallel.view import PlanView
from pallas_kernels import grouped_matmul, norm_down


def embed_lookup(plan: PlanView, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Vocab-parallel embedding: each rank looks up the tokens in its slice of the vocabulary
    (zeros elsewhere), then one reduction over the vocab axis combines them. When the residual is
    split on d (btp) that reduction is a reduce-scatter, so each rank receives only its d/p slice:
    half the bytes of the paper's all-reduce + slice. Under a pipeline the vocabulary is split over
    pp too (`Scheme.rules_for`): the reduction over pp follows, on the d/p slice."""
    if plan.size("vocab") == 1:
        # The whole table on each device (FSDP's gather, as the shard_map below takes its rows): a
        # lookup in a table split on d would leave the rows split on d and the backward's
        # scatter-add a [B, S, d] cotangent to move from split on batch to split on d, which XLA
        # does by gathering the global batch onto every device (tests/test_resharding.py).
        return plan.constrain(table, ("vocab", None))[tokens]
    vocab_axes = jax.tree.leaves(tuple(plan.spec(("vocab",))))  # tp, or tp and pp
    out_spec = plan.spec(("batch", "seq", "act_embed"))
    scatter = [a for a in vocab_axes if a in jax.tree.leaves(tuple(out_spec))]  # the residual's d split
    rest = tuple(a for a in vocab_axes if a not in scatter)

    def local(table_shard, tokens_shard):
        rows = table_shard.shape[0]
        ids = tokens_shard - jax.lax.axis_index(tuple(vocab_axes)) * rows
        mine = (ids >= 0) & (ids < rows)
        x = jnp.where(mine[..., None], table_shard[jnp.clip(ids, 0, rows - 1)], 0)
        for axis in scatter:
            x = jax.lax.psum_scatter(x, axis, scatter_dimension=2, tiled=True)
        return jax.lax.psum(x, rest) if rest else x

    return jax.shard_map(
        local, mesh=plan.mesh, in_specs=(plan.spec(("vocab", None)), plan.spec(("batch", "seq"))),
        out_specs=out_spec,
    )(table, tokens)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def all_reduce(x: jax.Array, axis: str) -> jax.Array:
    """psum without a collective in its backward (Megatron's g), for a result that only feeds
    replicated computation leaving the shard_map: its cotangent arrives already summed (GSPMD
    all-reduces it at the column-parallel B that consumes the latent), and each partial's gradient
    is that cotangent. shard_map (check_vma=False) hands every rank 1/p of a replicated output's
    cotangent, which a plain psum would all-reduce again; scaling by p restores it locally. The
    equivalence tests (tests/test_parallel.py) pin this convention."""
    return jax.lax.psum(x, axis)


all_reduce.defvjp(lambda x, axis: (jax.lax.psum(x, axis), None),
                  lambda axis, _, g: (g * jax.lax.axis_size(axis),))


def btp_down(
    plan: PlanView,
    x: jax.Array,
    weights: Sequence[jax.Array],
    *,
    x_axis: str,
    w_axis: str,
    gamma: jax.Array | None = None,
    norm: str = "online",
    grouping: bool = True,
    kernels: str = "xla",
    eps: float = 1e-6,
    split: Sequence[str | None] | None = None,
) -> list[jax.Array]:
    """Row-parallel down-projections of one BTP input: x [B, S, k] split on its last dim over tp,
    each weight [k, r_i] split on its rows -> the replicated pre-activation latents [B, S, r_i].

    With `gamma`, x is first RMS-normalised over its full (sharded) width: `online` computes each
    rank's statistics beside its GEMM (pallas_kernels.norm_down) and sends them in the same
    all-reduce as the latents (one buffer, one collective); `sync` all-reduces them first.
    `grouping` concatenates the weights into one GEMM and one all-reduce; without it each weight
    gets its own. Every collective here is an explicit psum, so the program issues exactly these.

    `split` names, per weight, the logical axis over tp its latent is split on (latent heads: each
    rank keeps only its own groups' columns, [B, S, r_i / tp]) or None (replicated): those latents
    are reduce-scattered instead, one reduce-scatter per GEMM, and the online statistic rides in the
    first of them (docs/design.md, latent heads).
    """
    dtype = x.dtype
    tp = plan.axis(x_axis)
    if tp is None:
        raise ValueError(f"btp_down: activation axis {x_axis!r} is not split under scheme {plan.scheme.name}")
    split = list(split or [None] * len(weights))
    if any(name is not None and plan.axis(name) != tp for name in split):
        raise ValueError(f"btp_down: latents split on {split} must be split over {tp!r}, as x is")
    scattered = [name is not None for name in split]

    def local(x, gamma, *ws):
        # Every all-reduce output is a latent for low-rank checkpointing: saving exactly these
        # means the backward pass recomputes everything after them and no collective.
        reduce = lambda v: checkpoint_name(all_reduce(v, tp), LATENT)
        # The sync statistic feeds each rank's own shard, so its gradient must be summed: plain psum.
        reduce_stat = lambda v: checkpoint_name(jax.lax.psum(v, tp), LATENT)
        b, s, k = x.shape
        x2 = x.reshape(b * s, k)
        d_total = k * jax.lax.axis_size(tp)
        groups = [list(range(len(ws)))] if grouping else [[i] for i in range(len(ws))]
        online = gamma is not None and norm == "online"
        # The statistics travel once: in the first reduce-scatter where one is, else the first all-reduce.
        carrier = next((n for n, group in enumerate(groups) if any(scattered[i] for i in group)), 0)
        if gamma is not None and norm == "sync":
            ssq = reduce_stat(jnp.sum(jnp.square(x2.astype(jnp.float32)), axis=-1, keepdims=True))
            x2 = (x2 * jax.lax.rsqrt(ssq / d_total + eps) * gamma).astype(dtype)
        outs, scale = [None] * len(ws), None
        for n in [carrier, *(m for m in range(len(groups)) if m != carrier)]:  # the statistic's GEMM first
            group = groups[n]
            a = jnp.concatenate([ws[i].astype(dtype) for i in group], axis=1)
            if online:
                h, ssq = norm_down(x2, gamma.astype(dtype), a, eps=eps, d_total=d_total, impl=kernels,
                                   interpret=plan.interpret_kernels)
                ssq = ssq[:, None].astype(dtype) if n == carrier else None
            else:
                h, ssq = jnp.dot(x2, a, preferred_element_type=jnp.float32), None
            sums, stat = _sum_over_tp(h.astype(dtype), [ws[i].shape[1] for i in group],
                                      [scattered[i] for i in group], ssq, reduce, tp)
            if stat is not None:
                scale = jax.lax.rsqrt(stat.astype(jnp.float32) / d_total + eps)
            for positions, buf, widths in sums:
                if online:  # each summed buffer scaled whole, then split: no copy of the latents
                    buf = (buf.astype(jnp.float32) * scale).astype(dtype)
                for j, v in zip(positions, jnp.split(buf, np.cumsum(widths)[:-1], axis=-1)):
                    outs[group[j]] = v
        return [o.reshape(b, s, o.shape[-1]) for o in outs]

    with_norm = gamma is not None
    fn = jax.shard_map(
        (lambda x, *rest: local(x, *rest)) if with_norm else (lambda x, *ws: local(x, None, *ws)),
        mesh=plan.mesh,
        in_specs=(plan.spec(("batch", "seq", x_axis)), *[plan.spec((w_axis,))] * with_norm,
                  *[plan.spec((w_axis, None))] * len(weights)),
        out_specs=[plan.spec(("batch", "seq", name)) for name in split],
        check_vma=False,  # Pallas kernels inside carry no varying-axis types
    )
    return fn(x, *([gamma] * with_norm), *weights)


def _sum_over_tp(h: jax.Array, widths: list[int], scattered: list[bool], stat: jax.Array | None, reduce,
                 tp: str) -> tuple[list[tuple[list[int], jax.Array, list[int]]], jax.Array | None]:
    """Inside btp_down: one GEMM's partial latents h [T, sum r_i] summed over tp, the replicated ones
    in one all-reduce (`reduce`) and the split ones in one reduce-scatter, each rank keeping its
    r_i / tp columns of each (its own latent heads); `stat` [T, 1] rides in the reduce-scatter where
    there is one, a copy in each rank's share, so that its gradient, a partial sum over every rank's
    latents, is summed by the reduce-scatter's backward all-gather (the all-reduce's is only scaled),
    else in the all-reduce -> ([(the latents' positions in the GEMM, their summed buffer, its
    widths)], the summed statistic or None). Without split latents h is reduced as it is."""
    whole = [j for j, s in enumerate(scattered) if not s]
    parts = [j for j, s in enumerate(scattered) if s]
    pieces = jnp.split(h, np.cumsum(widths)[:-1], axis=-1) if parts else None
    sums, summed_stat = [], None
    if whole:
        buf = jnp.concatenate([pieces[j] for j in whole], axis=-1) if parts else h
        if stat is not None and not parts:
            buf = reduce(jnp.concatenate([buf, stat], axis=-1))
            buf, summed_stat = buf[:, :-1], buf[:, -1:]
        else:
            buf = reduce(buf)
        sums.append((whole, buf, [widths[j] for j in whole]))
    if parts:
        t, ways = h.shape[0], jax.lax.axis_size(tp)
        copies = [jnp.broadcast_to(stat[:, None], (t, ways, 1))] if stat is not None else []
        tiles = jnp.concatenate([pieces[j].reshape(t, ways, -1) for j in parts] + copies, axis=-1)  # [T, tp, sum r_i / tp]
        mine = checkpoint_name(jax.lax.psum_scatter(tiles, tp, scatter_dimension=1), LATENT)
        if stat is not None:
            mine, summed_stat = mine[:, :-1], mine[:, -1:]
        sums.append((parts, mine, [widths[j] // ways for j in parts]))
    return sums, summed_stat


def grouped_up(plan: PlanView, latents: Sequence[jax.Array], weights: Sequence[jax.Array], *, w_axis: str,
               y_axis: str, kernels: str = "xla") -> list[jax.Array]:
    """Column-parallel up-projections of same-width outputs as one batched GEMM:
    z [c, T, r] @ B [c, r, m/p] -> [c, T, m/p] (pallas_kernels.grouped_matmul). T is the batch and
    sequence flattened, except where the sequence is split over devices (context parallelism), which
    flattening would gather: there z stays [c, B, S, r]."""
    c, bsz, s, r = len(latents), *latents[0].shape
    split_seq = plan.size("seq") > 1
    z = jnp.stack(latents) if split_seq else jnp.stack(latents).reshape(c, bsz * s, r)
    b = jnp.stack([w.astype(z.dtype) for w in weights])
    if kernels == "xla":  # XLA partitions the batched GEMM from the layouts alone
        y = grouped_matmul(z, b, impl=kernels)
    else:
        rows = ("batch", "seq") if split_seq else ("batch",)
        y = jax.shard_map(
            lambda z, b: grouped_matmul(z, b, impl=kernels, interpret=plan.interpret_kernels), mesh=plan.mesh,
            in_specs=(plan.spec((None, *rows, None)), plan.spec((None, None, w_axis))),
            out_specs=plan.spec((None, *rows, y_axis)), check_vma=False,
        )(z, b)
    return list(y.reshape(c, bsz, s, -1))
