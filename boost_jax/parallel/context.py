"""Context parallelism: the sequence of every activation split over the `cp` mesh axis.

Everything position-wise (norms, the projections, the MLP, the LM head and the loss) runs on its own
chunk with no added communication: the logical axis `seq` maps to `cp` in every scheme. Attention
is the one place a token needs others, and `parallel.cp_attention` says how it gets them (the
projections' `attention` picks the way and hands the layer's math, `Attending`, to its region here):

- gather: each device all-gathers k and v over cp (its queries stay local); causality and documents
  are masked by the tokens' positions and segments, gathered once per step.
- ring: k and v travel round the cp ring in cp - 1 `ppermute`s, each device folding every block into
  an online softmax (max, sum, output in fp32) as it arrives: no device ever holds the whole
  sequence's keys.
- latent (low-rank archs): the rank-r latents of k and v are gathered instead, and each device
  rebuilds every key and value from them (d_kv / r fewer bytes on the wire, the up-projection of the
  whole sequence on every device).

Causal load balance: a sequence cut into 2 cp chunks puts chunks i and 2 cp - 1 - i on device i, so
every device holds as many early (cheap) as late (dear) queries. The train step reorders each batch
once (`balance`); positions travel with their tokens, and the loss, a mean over all tokens, does not
see the order. `query_group` tells the work analysis how many query heads share a kv head on one
device, as the plan splits (or, here, slices) them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.config.schemes import CP
from boost_jax.parallel.layout import Layout

if TYPE_CHECKING:
    from boost_jax.config import ModelConfig

# A masked score: finite, so a block whose every key is masked for a query adds exp(0) * 0, not NaN.
MASKED = -1e30
# The logical axes of attention's queries and of its keys and values [B, S, heads, d_head].
QUERIES = ("batch", "seq", "act_heads", None)
KEYS = ("batch", "seq", "act_kv_heads", None)


def balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """The token order whose cp equal slices give device i chunks i and 2 cp - 1 - i of 2 cp
    (cp = 2: [0..7] -> [0, 1, 6, 7, 2, 3, 4, 5])."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} does not divide into 2 x cp = {2 * cp} chunks")
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def balance(batch: dict, cp: int) -> dict:
    """A batch's tokens, targets and segments in the balanced order, with their positions."""
    b, s = batch["inputs"].shape
    order = balanced_order(s, cp)
    out = {k: v[:, order] for k, v in batch.items()}
    out["positions"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, s))
    return out


def over_cp(plan: Layout, fn, args: tuple, axes: tuple, out_axes: tuple):
    """fn(*args) on each device's own pieces: args[i] split by the logical axes axes[i] (the sequence
    over cp, the heads over tp as the plan splits them), the result by out_axes; inside, `gather`
    reaches the whole sequence. Manual over every mesh axis, as the blocks of parallel/blocks.py: a
    gather's gradient is then exactly one reduce-scatter of the partial sums each device made, and
    nothing outside the region is gathered to enter it."""
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=tuple(plan.spec(a) for a in axes),
                         out_specs=plan.spec(out_axes), check_vma=False)(*args)


def gather(x: jax.Array) -> jax.Array:
    """Inside `over_cp`: every device's chunk of x, the whole sequence (one all-gather over cp)."""
    return jax.lax.all_gather(x, CP, axis=1, tiled=True)


def local_kv_heads(plan: Layout, x: jax.Array, n_heads: int, n_local: int) -> jax.Array:
    """Inside over_cp: keys or values [B, S, KVH, d] that the plan replicates while it splits the
    query heads (GQA with fewer kv heads than tp) -> the kv heads this device's n_local query heads
    (of n_heads) read; x as it is where both are split alike."""
    if plan.size("act_kv_heads") == plan.size("act_heads"):
        return x
    group, first = n_heads // x.shape[2], jax.lax.axis_index(plan.axis("act_heads")) * n_local
    if n_local % group == 0 or group % n_local == 0:  # whole groups, or one kv head: a slice
        return jax.lax.dynamic_slice_in_dim(x, first // group, max(1, n_local // group), axis=2)
    return jnp.take(x, (first + jnp.arange(n_local)) // group, axis=2)  # a kv head per query head


def query_group(plan: Layout, m: ModelConfig) -> int:
    """Query heads per kv head in one device's attention matmuls: the G of attention's heads-first
    [B, Hkv, G, S, D] (layers/attention.py), which XLA folds into the rows (k and v are broadcast
    over G), so a block of r queries is a matmul of G x r rows; the work analysis needs G to know
    attention's dots (analysis/work.py). Kv heads split like the query heads keep the model's G.
    Replicated ones (fewer kv heads than tp): under context parallelism `local_kv_heads` slices
    them; else GSPMD splits [Hkv, G] over the heads' devices, G where Hkv cannot take them all, and
    where it splits Hkv only partly it keeps G whole (computing some heads twice)."""
    n_heads, n_kv_heads = m.n_heads, m.n_kv_heads
    g, split = n_heads // n_kv_heads, plan.size("act_heads")
    if plan.size("act_kv_heads") == split:
        return g
    local = n_heads // split
    if plan.size("seq") > 1:
        return g if local % g == 0 else local if g % local == 0 else 1
    return g * n_kv_heads // split if split % n_kv_heads == 0 and g % (split // n_kv_heads) == 0 else g


class Tokens(Protocol):
    """Where a forward's tokens sit (layers/attention.py's `Positions`)."""

    @property
    def positions(self) -> jax.Array | None: ...  # [B, S]; None: 0 .. S-1 in every row

    @property
    def segments(self) -> jax.Array | None: ...  # [B, S], each token's document; None: one per row

    def of(self, batch: int, seq: int) -> jax.Array: ...  # the positions as an array [B, S]


class Attending(Protocol):
    """What the plan runs of an attention layer (layers/attention.py's `Attention`) where its tokens
    are, inside a shard_map region under context parallelism: its heads and projections, the
    queries, keys and values it makes of the normed residual, RoPE and softmax attention."""

    @property
    def n_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def linears(self) -> dict: ...  # q, k, v by name (layers/lowrank.py's `Linear`)

    def queries_keys_values(self, proj, x: jax.Array, norm, positions: jax.Array) -> tuple[jax.Array, ...]:
        """q [B, S, H, d_h], k and v [B, S, H_kv, d_h] of norm(x) by the projections `proj`, q and k rotated."""

    def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array: ...  # RoPE of [B, S, heads, d_h]

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array | None,
               k_positions: jax.Array | None, q_segments: jax.Array | None, k_segments: jax.Array | None, *,
               impl: str) -> jax.Array:
        """Causal softmax attention of q [B, Sq, H, d_h] over k, v [B, Sk, H_kv, d_h] -> [B, Sq, H, d_h]."""

    def query_rows(self, seq: int) -> int: ...  # queries per block of `attend` over `seq` positions


def attend_gathered(plan: Layout, attn: Attending, q: jax.Array, where: Tokens, keys: tuple, keys_axes: tuple,
                    rebuild: Callable) -> jax.Array:
    """Attention of each device's queries q [B, S, H, d_h] over the whole sequence's keys and values
    in one `over_cp` region: `rebuild(k_positions, *keys)` makes the whole sequence's k and v
    [B, S, H_kv, d_h] of this device's pieces of `keys` (split by `keys_axes`) with `gather`;
    causality and documents are masked by the tokens' positions and segments, gathered alike."""
    b, s = q.shape[:2]
    tokens = (where.of(b, s),) if where.segments is None else (where.of(b, s), where.segments)
    n = len(keys)

    def local(q, *args):
        positions, segments = args[n], (args[n + 1] if len(args) > n + 1 else None)
        k_positions = gather(positions)
        k, v = (local_kv_heads(plan, x, attn.n_heads, q.shape[2]) for x in rebuild(k_positions, *args[:n]))
        return attn.attend(q, k, v, positions, k_positions, segments, None if segments is None else gather(segments),
                           impl="xla")

    return over_cp(plan, local, (q, *keys, *tokens), (QUERIES, *keys_axes, *(("batch", "seq"),) * len(tokens)), QUERIES)


def gathered_keys(k_positions: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`attend_gathered`'s rebuild under parallel.cp_attention=gather: k and v, gathered whole."""
    return gather(k), gather(v)


def layer_forward_bytes(plan: Layout, m, rows: int, seq_len: int) -> int:
    """Bytes one device receives per decoder layer forward for attention under context parallelism,
    per `plan.cp_attention` (`rows`: its sequences): the gathered k and v (gather), the cp - 1 blocks
    of k and v that reach it round the ring (ring), or the gathered latents of k and v (latent)."""
    cp, itemsize = plan.size("seq"), jnp.dtype(m.dtype).itemsize
    kv = m.n_kv_heads * m.head_dim // plan.size("act_kv_heads")
    per_token = {"gather": 2 * kv, "ring": 2 * kv * (cp - 1) / cp, "latent": 2 * m.attn_rank // plan.size("act_kv_latent")}
    return int(rows * seq_len * per_token[plan.cp_attention] * itemsize)


def ring_attention(plan: Layout, q, k, v, q_positions, k_positions, q_segments, k_segments, *, n_heads: int,
                   rows: int) -> jax.Array:
    """Softmax attention of the local queries q [B, Sq, H, d] over every device's keys and values
    [B, Sk, H_kv, d] (each device its own chunk), passed round the cp ring and folded into an online
    softmax, `rows` queries at a time. A query sees the keys at positions <= its own (and of its own
    segment); segments None: one document per row. n_heads: the model's query heads."""
    with_segments = q_segments is not None

    def local(q, k, v, q_pos, k_pos, *segments):
        k, v = (local_kv_heads(plan, x, n_heads, q.shape[2]) for x in (k, v))
        q_seg, k_seg = segments if with_segments else (q_pos, k_pos)  # unused stand-ins: one program shape
        return _ring(plan.mesh.shape[CP], rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg)

    tokens = ("batch", "seq")
    args = (q, k, v, q_positions, k_positions, *((q_segments, k_segments) if with_segments else ()))
    axes = (QUERIES, KEYS, KEYS, *(tokens,) * (len(args) - 3))
    return over_cp(plan, local, args, axes, QUERIES)


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


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(cp, rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _ring_fwd(cp, rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg)[0]


def _ring_fwd(cp, rows, with_segments, q, k, v, q_pos, k_pos, q_seg, k_seg):
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
        arriving = tuple(jax.lax.ppermute(x, CP, _ring_pairs(cp)) for x in blocks) if step < cp - 1 else None
        state = fold(state, blocks)
        blocks = arriving
    m, l, o = state
    out = _unblocks(o / jnp.moveaxis(l, -1, 2)[..., None]).reshape(b, sq, h, d).astype(q.dtype)
    lse = m + jnp.log(l)  # [n, B, kvh, g, rows]
    return out, (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _ring_bwd(cp, rows, with_segments, res, d_out):
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
            blocks = tuple(jax.lax.ppermute(x, CP, _ring_pairs(cp)) for x in blocks)
    # The accumulators have visited every device: one more step brings each home.
    dk, dv = (jax.lax.ppermute(x, CP, _ring_pairs(cp)) if cp > 1 else x for x in blocks[4:])
    dq = _unblocks(dq).reshape(b, sq, h, d)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
