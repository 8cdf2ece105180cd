"""Context parallelism: the sequence of every activation split over the `cp` mesh axis.

Everything position-wise (norms, the projections, the MLP, the LM head and the loss) runs on its own
chunk with no added communication: the logical axis `seq` maps to `cp` in every scheme. Attention
is the one place a token needs others, and `parallel.cp_attention` says how it gets them (the
projections' `attention` picks the way and hands q, k and v, or the latents of k and v, to its
region here, which runs the attention op of boost_jax/ops/ on each device's pieces):

- gather: each device all-gathers k and v over cp (its queries stay local); causality and documents
  are masked by the tokens' positions and segments, gathered once per step.
- ring: k and v travel round the cp ring in cp - 1 `ppermute`s, each device folding every block into
  an online softmax (max, sum, output in fp32) as it arrives (ops/ring.py): no device ever holds the
  whole sequence's keys.
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
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.config.schemes import CP
from boost_jax.ops.attention import AttentionOp, Positions
from boost_jax.ops.ring import ring_attention
from boost_jax.parallel.view import PlanView

if TYPE_CHECKING:
    from boost_jax.config import ModelConfig

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
    if "positions" not in batch:  # a packed row's own positions (each document's from 0) move with their tokens
        out["positions"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, s))
    return out


def over_cp(plan: PlanView, fn, args: tuple, axes: tuple, out_axes: tuple):
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


def local_kv_heads(plan: PlanView, x: jax.Array, n_heads: int, n_local: int) -> jax.Array:
    """Inside over_cp: keys or values [B, S, KVH, d] that the plan replicates while it splits the
    query heads (GQA with fewer kv heads than tp) -> the kv heads this device's n_local query heads
    (of n_heads) read; x as it is where both are split alike."""
    if plan.size("act_kv_heads") == plan.size("act_heads"):
        return x
    group, first = n_heads // x.shape[2], jax.lax.axis_index(plan.axis("act_heads")) * n_local
    if n_local % group == 0 or group % n_local == 0:  # whole groups, or one kv head: a slice
        return jax.lax.dynamic_slice_in_dim(x, first // group, max(1, n_local // group), axis=2)
    return jnp.take(x, (first + jnp.arange(n_local)) // group, axis=2)  # a kv head per query head


def query_group(plan: PlanView, m: ModelConfig) -> int:
    """Query heads per kv head in one device's attention matmuls: the G of attention's heads-first
    [B, Hkv, G, S, D] (ops/attention.py), which XLA folds into the rows (k and v are broadcast
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


def attend_gathered(plan: PlanView, op: AttentionOp, q: jax.Array, where: Positions, keys: tuple, keys_axes: tuple,
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
        k, v = (local_kv_heads(plan, x, op.n_heads, q.shape[2]) for x in rebuild(k_positions, *args[:n]))
        return op.attend(q, k, v, positions, k_positions, segments, None if segments is None else gather(segments),
                         impl="xla")

    return over_cp(plan, local, (q, *keys, *tokens), (QUERIES, *keys_axes, *(("batch", "seq"),) * len(tokens)), QUERIES)


def gathered_keys(k_positions: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`attend_gathered`'s rebuild under parallel.cp_attention=gather: k and v, gathered whole."""
    return gather(k), gather(v)


def layer_forward_bytes(plan: PlanView, m, rows: int, seq_len: int) -> int:
    """Bytes one device receives per decoder layer forward for attention under context parallelism,
    per `plan.cp_attention` (`rows`: its sequences): the gathered k and v (gather), the cp - 1 blocks
    of k and v that reach it round the ring (ring), or the gathered latents of k and v (latent; with
    decoupled RoPE, and the rotary keys)."""
    cp, itemsize = plan.size("seq"), jnp.dtype(m.dtype).itemsize
    kv = m.n_kv_heads * m.head_dim // plan.size("act_kv_heads")
    latent = (2 * m.attn_rank // plan.size("act_kv_latent")
              + m.attn_latent_heads * m.attn_rope_dims // plan.size("act_kv_rope"))
    per_token = {"gather": 2 * kv, "ring": 2 * kv * (cp - 1) / cp, "latent": latent}
    return int(rows * seq_len * per_token[plan.cp_attention] * itemsize)


def attend_round_ring(plan: PlanView, q, k, v, q_positions, k_positions, q_segments, k_segments, *, n_heads: int,
                      rows: int) -> jax.Array:
    """Softmax attention of the local queries q [B, Sq, H, d] over every device's keys and values
    [B, Sk, H_kv, d] (each device its own chunk), passed round the cp ring (ops/ring.py) in one
    `over_cp` region, `rows` queries at a time. segments None: one document per row. n_heads: the
    model's query heads."""
    with_segments = q_segments is not None

    def local(q, k, v, q_pos, k_pos, *segments):
        k, v = (local_kv_heads(plan, x, n_heads, q.shape[2]) for x in (k, v))
        q_seg, k_seg = segments if with_segments else (None, None)
        return ring_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, axis=CP, size=plan.mesh.shape[CP], rows=rows)

    tokens = ("batch", "seq")
    args = (q, k, v, q_positions, k_positions, *((q_segments, k_segments) if with_segments else ()))
    axes = (QUERIES, KEYS, KEYS, *(tokens,) * (len(args) - 3))
    return over_cp(plan, local, args, axes, QUERIES)
