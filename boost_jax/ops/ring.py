"""Ring attention's math: softmax attention of each device's queries over every device's keys and
values, passed round a named mesh axis in `ppermute`s and folded into an online softmax (max, sum,
output in fp32) as they arrive, with its backward written out. It runs inside a region manual over
that axis (parallel/context.py's `attend_round_ring` opens it, as the plan splits the tokens and
heads); here are only arrays and the axis' name and size.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

# A masked score: finite, so a block whose every key is masked for a query adds exp(0) * 0, not NaN.
MASKED = -1e30


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, k_positions: jax.Array,
                   q_segments: jax.Array | None, k_segments: jax.Array | None, *, axis: str, size: int,
                   rows: int) -> jax.Array:
    """Softmax attention of this device's queries q [B, Sq, H, d] over the keys and values [B, Sk,
    H_kv, d] of each of the `size` devices along `axis` (each holds its own chunk), `rows` queries
    at a time. A query sees the keys at positions <= its own (and of its own segment); segments
    None: one document per row."""
    with_segments = q_segments is not None
    # Without segments, the positions stand in for them unused: one program shape.
    q_seg, k_seg = (q_segments, k_segments) if with_segments else (q_positions, k_positions)
    return _ring(axis, size, rows, with_segments, q, k, v, q_positions, k_positions, q_seg, k_seg)


# The ring, flash-attention style: the forward keeps the local q, k, v, the output and each query's
# log-sum-exp, nothing per block; the backward passes k and v round the ring again together with
# the partial sums of their gradients (summed in fp32 on each device, sent in the compute dtype as a
# reduce-scatter's would be), recomputing each block's probabilities from the saved log-sum-exp, and
# one last permute brings every dk and dv home. So a device holds one block of other devices' keys
# at a time, forward and backward, and `rows` queries' scores against it.


def _ring_pairs(cp: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % cp) for i in range(cp)]


def _seen(q_pos, k_pos, q_seg, k_seg, with_segments: bool) -> jax.Array:
    """[B, 1, 1, rows, Sk]: which keys each query sees."""
    seen = k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
    if with_segments:
        seen = seen & (k_seg[:, None, None, None, :] == q_seg[:, None, None, :, None])
    return seen


def _blocks(x: jax.Array, rows: int) -> jax.Array:
    """[B, Sq, ...] -> [Sq / rows, B, rows, ...]: the query blocks a lax.map or scan walks."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // rows, rows, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
    n, b, rows = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * rows, *x.shape[3:])


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, cp, rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _ring_fwd(axis, cp, rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg)[0]


def _ring_fwd(axis, cp, rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg):
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    scale = 1.0 / np.sqrt(d)
    qg = q.reshape(b, sq, kvh, h // kvh, d)

    def fold(state, blocks):  # every query block against one device's keys
        k_j, v_j, kp_j, ks_j = blocks

        def one(xs):
            q_b, qp_b, qs_b, m, l, o = xs
            # Products in the inputs' dtype, sums in fp32 (as jax.nn.dot_product_attention): the
            # blocks travel in the compute dtype.
            s = jnp.einsum("bqkgd,btkd->bkgqt", q_b, k_j, preferred_element_type=jnp.float32) * scale
            seen = _seen(qp_b, kp_j, qs_b, ks_j, with_segments)
            s = jnp.where(seen, s, MASKED)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
            rescale = jnp.exp(m - m_new)
            o = o * jnp.moveaxis(rescale, -1, 1)[..., None] + jnp.einsum(
                "bkgqt,btkd->bqkgd", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, l * rescale + p.sum(-1), o

        m, l, o = state
        with jax.named_scope("attention"):  # the ops' name: analysis/work.py prices them as a flash kernel's
            return jax.lax.map(one, (_blocks(qg, rows), _blocks(q_pos, rows), _blocks(q_seg, rows), m, l, o))

    n = sq // rows
    state = (jnp.full((n, b, kvh, h // kvh, rows), MASKED, jnp.float32),
             jnp.zeros((n, b, kvh, h // kvh, rows), jnp.float32), jnp.zeros((n, b, rows, kvh, h // kvh, d), jnp.float32))
    # m, l are kept [n, B, kvh, g, rows]: each block's own; the [B, kvh, g, Sq] layout comes after.
    blocks = (k, v, k_pos, k_seg)
    for step in range(cp):
        # The next block is sent for before this one is folded: nothing orders the two, so the
        # transfer can run under the fold (XLA's async collective-permute on GPUs).
        arriving = tuple(jax.lax.ppermute(x, axis, _ring_pairs(cp)) for x in blocks) if step < cp - 1 else None
        state = fold(state, blocks)
        blocks = arriving
    m, l, o = state
    out = _unblocks(o / jnp.moveaxis(l, -1, 2)[..., None]).reshape(b, sq, h, d).astype(q.dtype)
    lse = m + jnp.log(l)  # [n, B, kvh, g, rows]
    return out, (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _ring_bwd(axis, cp, rows, with_segments, res, d_out):
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = res
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    scale = 1.0 / np.sqrt(d)
    grouped = lambda x: _blocks(x.reshape(b, sq, kvh, h // kvh, d), rows)
    q_b, do_b = grouped(q), grouped(d_out)
    # D = rowsum(dO * O), [n, B, kvh, g, rows] like lse
    delta = jnp.moveaxis(jnp.sum(do_b.astype(jnp.float32) * grouped(out).astype(jnp.float32), -1), 2, -1)

    def fold(dq, blocks):  # every query block against one device's keys: dq here, dk and dv travel on
        k_j, v_j, kp_j, ks_j, dk_j, dv_j = blocks

        def one(acc, xs):
            dk_j, dv_j = acc
            q_i, do_i, qp_i, qs_i, lse_i, delta_i = xs
            s = jnp.einsum("bqkgd,btkd->bkgqt", q_i, k_j, preferred_element_type=jnp.float32) * scale
            p = jnp.where(_seen(qp_i, kp_j, qs_i, ks_j, with_segments), jnp.exp(s - lse_i[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("bkgqt,bqkgd->btkd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,btkd->bkgqt", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None])).astype(q_i.dtype)
            dq_i = jnp.einsum("bkgqt,btkd->bqkgd", ds, k_j, preferred_element_type=jnp.float32) * scale
            dk_j = dk_j + jnp.einsum("bkgqt,bqkgd->btkd", ds, q_i, preferred_element_type=jnp.float32) * scale
            return (dk_j, dv_j), dq_i

        xs = (q_b, do_b, _blocks(q_pos, rows), _blocks(q_seg, rows), lse, delta)
        with jax.named_scope("attention"):
            (dk_j, dv_j), dq_blocks = jax.lax.scan(one, (dk_j.astype(jnp.float32), dv_j.astype(jnp.float32)), xs)
        return dq + dq_blocks, (k_j, v_j, kp_j, ks_j, dk_j.astype(k_j.dtype), dv_j.astype(v_j.dtype))

    dq = jnp.zeros(q_b.shape, jnp.float32)
    blocks = (k, v, k_pos, k_seg, jnp.zeros_like(k), jnp.zeros_like(v))
    for step in range(cp):
        dq, blocks = fold(dq, blocks)
        if step < cp - 1:
            blocks = tuple(jax.lax.ppermute(x, axis, _ring_pairs(cp)) for x in blocks)
    # The accumulators have visited every device: one more step brings each home.
    dk, dv = (jax.lax.ppermute(x, axis, _ring_pairs(cp)) if cp > 1 else x for x in blocks[4:])
    dq = _unblocks(dq).reshape(b, sq, h, d)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
