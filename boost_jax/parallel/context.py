"""Context parallelism: the sequence of every activation split over the `cp` mesh axis.

Everything position-wise (norms, the projections, the MLP, the LM head and the loss) runs on its own
chunk with no added communication: the logical axis `seq` maps to `cp` in every scheme. Attention
is the one place a token needs others, and `parallel.cp_attention` says how it gets them:

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
see the order.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.schemes import CP

if TYPE_CHECKING:
    from boost_jax.parallel.plan import Plan

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


def over_cp(plan: Plan, fn, args: tuple, axes: tuple, out_axes: tuple):
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


def local_kv_heads(plan: Plan, x: jax.Array, n_heads: int, n_local: int) -> jax.Array:
    """Inside over_cp: keys or values [B, S, KVH, d] that the plan replicates while it splits the
    query heads (GQA with fewer kv heads than tp) -> the kv heads this device's n_local query heads
    (of n_heads) read; x as it is where both are split alike."""
    if plan.size("act_kv_heads") == plan.size("act_heads"):
        return x
    group, first = n_heads // x.shape[2], jax.lax.axis_index(plan.axis("act_heads")) * n_local
    if n_local % group == 0 or group % n_local == 0:  # whole groups, or one kv head: a slice
        return jax.lax.dynamic_slice_in_dim(x, first // group, max(1, n_local // group), axis=2)
    return jnp.take(x, (first + jnp.arange(n_local)) // group, axis=2)  # a kv head per query head


def layer_forward_bytes(plan: Plan, m, rows: int, seq_len: int) -> int:
    """Bytes one device receives per decoder layer forward for attention under context parallelism,
    per `plan.cp_attention` (`rows`: its sequences): the gathered k and v (gather), the cp - 1 blocks
    of k and v that reach it round the ring (ring), or the gathered latents of k and v (latent)."""
    cp, itemsize = plan.size("seq"), jnp.dtype(m.dtype).itemsize
    kv = m.n_kv_heads * m.head_dim // plan.size("act_kv_heads")
    per_token = {"gather": 2 * kv, "ring": 2 * kv * (cp - 1) / cp, "latent": 2 * m.attn_rank // plan.size("act_latent")}
    return int(rows * seq_len * per_token[plan.cp_attention] * itemsize)


def ring_attention(plan: Plan, q, k, v, q_positions, k_positions, q_segments, k_segments, n_heads: int):
    """Softmax attention of the local queries q [B, Sq, H, d] over every device's keys and values
    [B, Sk, H_kv, d] (each device its own chunk), passed round the cp ring: cp blocks folded into an
    online softmax. A query sees the keys at positions <= its own (and of its own segment); segments
    None: one document per row. n_heads: the model's query heads."""
    cp = plan.mesh.shape[CP]
    ring = [(i, (i + 1) % cp) for i in range(cp)]
    with_segments = q_segments is not None

    def local(q, k, v, q_pos, k_pos, *segments):
        b, sq, h, d = q.shape
        k, v = (local_kv_heads(plan, x, n_heads, h) for x in (k, v))
        kvh = k.shape[2]
        qg = q.reshape(b, sq, kvh, h // kvh, d)
        state = (jnp.full((b, kvh, h // kvh, sq), MASKED, jnp.float32), jnp.zeros((b, kvh, h // kvh, sq), jnp.float32),
                 jnp.zeros((b, sq, kvh, h // kvh, d), jnp.float32))

        @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        def fold(state, k, v, k_pos, k_seg):
            m, l, o = state
            # products in the inputs' dtype, sums in fp32 (as jax.nn.dot_product_attention): the
            # blocks travel in the compute dtype
            s = jnp.einsum("bqkgd,btkd->bkgqt", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
            seen = k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
            if with_segments:
                seen = seen & (k_seg[:, None, None, None, :] == segments[0][:, None, None, :, None])
            s = jnp.where(seen, s, MASKED)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
            scale = jnp.exp(m - m_new)
            l = l * scale + p.sum(-1)
            o = o * jnp.moveaxis(scale, -1, 1)[..., None] + jnp.einsum("bkgqt,btkd->bqkgd", p.astype(v.dtype), v,
                                                                         preferred_element_type=jnp.float32)
            return m_new, l, o

        blocks = (k, v, k_pos, segments[1] if with_segments else k_pos)
        for step in range(cp):
            # The next block is sent for before this one is folded: nothing orders the two, so the
            # transfer can run under the fold (XLA's async collective-permute on GPUs).
            arriving = tuple(jax.lax.ppermute(x, CP, ring) for x in blocks) if step < cp - 1 else None
            state = fold(state, *blocks)
            blocks = arriving
        m, l, o = state
        return (o / jnp.moveaxis(l, -1, 1)[..., None]).reshape(b, sq, h, d).astype(q.dtype)

    tokens = ("batch", "seq")
    args = (q, k, v, q_positions, k_positions, *((q_segments, k_segments) if with_segments else ()))
    axes = (QUERIES, KEYS, KEYS, *(tokens,) * (len(args) - 3))
    return over_cp(plan, local, args, axes, QUERIES)
