"""The attention op: the math of attention on plain arrays, below the plan and the layers, so that
the attention layer (layers/attention.py, its weights) and the plan's strategies (parallel/, where
the tokens meet under context parallelism) call one op and neither mirrors the other. It knows no
mesh, scheme or parameter: the ring's passes round a named axis are in `ops/ring.py`.

`AttentionOp` is a layer's heads, RoPE's theta and its query block: what a caller needs to rotate,
attend and block. Where the tokens sit is the caller's (`Positions`): each row's positions (RoPE,
and the causal mask: a query sees the keys at positions <= its own) and optionally each token's
document (a query sees only its own document's keys). Over a cache (`cached_attention`) the queries
attend to every slot at a position <= their own; with a latent cache the values stay rank-r
latents (`latent_value_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Positions:
    """Where a forward's tokens sit. `positions` int32 [B, S] (None: 0 .. S-1 in every row, as in
    training on packed windows); `segments` int32 [B, S], each token's document (None: one per row).
    Under context parallelism each device holds its chunk of them, in the load-balanced order."""

    positions: jax.Array | None = None
    segments: jax.Array | None = None

    def of(self, batch: int, seq: int) -> jax.Array:
        """The positions as an array [B, S]."""
        if self.positions is not None:
            return self.positions
        return jnp.broadcast_to(jnp.arange(seq), (batch, seq))


class RopeScaling(Protocol):
    """RoPE's frequency scaling (`model.rope_scaling`): its type (default | llama3) and llama3's numbers."""

    type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class AttentionOp:
    """An attention layer's op: its query heads and their width, RoPE's theta and scaling, the queries
    per block of XLA's attention (`model.attention_query_block`), and the rotary dimensions of each head
    (`model.attn_rope_dims`; 0: all of them)."""

    n_heads: int
    head_dim: int
    rope_theta: float
    query_block: int
    rope_scaling: RopeScaling | None = None
    rope_dims: int = 0

    def frequencies(self, dims: int) -> jax.Array:
        """RoPE's frequencies of a rotary part `dims` wide, scaled as this op's `rope_scaling` says."""
        return traced_frequencies(dims, self.rope_theta, self.rope_scaling)

    def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE of x [B, S, heads, d_h] at positions [B, S]: on its last `rope_dims` (decoupled RoPE:
        `rope_tail`), else on all of them."""
        if self.rope_dims:
            return rope_tail(x, positions, self.frequencies(self.rope_dims))
        return rope(x, positions, self.rope_theta, self.rope_scaling)

    def keys(self, k: jax.Array, rotary: jax.Array | None, positions: jax.Array) -> jax.Array:
        """The keys [B, S, H_kv, d_h] attention reads: k [B, S, H_kv, d_h] rotated (`rope_dims` 0), or
        with decoupled RoPE k's position-free part [B, S, H_kv, d_h - rope_dims] beside the rotary
        keys `rotary` [B, S, g, rope_dims] (one per latent head) rotated at `positions` and shared by
        their group's H_kv / g kv heads: each key [position-free | rotary], as the queries are."""
        if rotary is None:
            return rope(k, positions, self.rope_theta, self.rope_scaling)
        rotary = jnp.repeat(self.rotate_keys(rotary, positions), k.shape[2] // rotary.shape[2], axis=2)
        return jnp.concatenate([k, rotary.astype(k.dtype)], axis=-1)

    def rotate_keys(self, rotary: jax.Array, positions: jax.Array) -> jax.Array:
        """Decoupled RoPE's keys [B, S, g, rope_dims] rotated at positions [B, S], as `rotate` turns
        the queries' last `rope_dims`."""
        return rope_with(rotary, positions, self.frequencies(self.rope_dims))

    def attend(self, q, k, v, q_positions, k_positions, q_segments, k_segments, *, impl: str) -> jax.Array:
        """`causal_attention` of q over k and v at this op's query block."""
        return causal_attention(q, k, v, impl=impl, query_block=self.query_block, q_positions=q_positions,
                                k_positions=k_positions, q_segments=q_segments, k_segments=k_segments)

    def query_rows(self, seq: int) -> int:
        """Queries per block of `attend` over `seq` positions."""
        return query_rows(seq, self.query_block)


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """RoPE's inverse frequencies [dim / 2] float32 of a head of width `dim`: theta ** (-2i / dim),
    then scaled as `scaling` says (llama3: transformers' `_compute_llama3_parameters`: wavelengths
    longer than original / low_freq_factor divided by factor, shorter than original /
    high_freq_factor kept, the band between them interpolated smoothly). Constants at trace time."""
    half = dim // 2
    freq = np.float32(theta) ** (-np.arange(half, dtype=np.float32) / np.float32(half))
    if scaling is None or scaling.type == "default":
        return freq
    if scaling.type != "llama3":
        raise ValueError(f"rope scaling {scaling.type!r} is not implemented (default, llama3)")
    f, low, high, old = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                         scaling.original_max_position_embeddings)
    wavelen = 2 * np.pi / freq.astype(np.float64)
    smooth = (old / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old / low, freq / f, freq)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled).astype(np.float32)


def traced_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """`rope_frequencies` for a traced program: unscaled, computed by the program itself (an iota, as
    RoPE always was), so no constant table rides into a layer's saved residuals; llama3's scaled table
    is a constant."""
    if scaling is None or scaling.type == "default":
        half = dim // 2
        return theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    return jnp.asarray(rope_frequencies(dim, theta, scaling))


def rope_with(x: jax.Array, positions: jax.Array, freq) -> jax.Array:
    """Rotary embedding in the rotate-half layout of x [B, S, H, 2 len(freq)] at positions [B, S] by
    the frequencies `freq` [D / 2] (whatever made them: `rope_frequencies`, scaled or not)."""
    angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [B, S, 1, D/2]
    return _rotate(x, jnp.cos(angle), jnp.sin(angle))


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding in the rotate-half layout (as Hugging Face LLaMA): x: [B, S, H, D]."""
    return rope_with(x, positions, traced_frequencies(x.shape[-1], theta, scaling))


def rope_tail(x: jax.Array, positions: jax.Array, freq) -> jax.Array:
    """Partial RoPE (decoupled RoPE's queries): x [B, S, H, D] with its last 2 len(freq) dimensions
    rotated by `rope_with` and the others left as they are (the position-free part)."""
    cut = x.shape[-1] - 2 * len(freq)
    return jnp.concatenate([x[..., :cut], rope_with(x[..., cut:], positions, freq)], axis=-1)


def rope_at_slots(x: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """`rope` of x [B, H, T, D] (heads-first, as a cache keeps keys) at positions 0 .. T-1: the
    cos and sin of those positions are a constant table [T, D/2] computed once at trace time. XLA:CPU
    recomputes the angles' cos and sin per element where they are traced (llama-60m, [32, 8, 128, 64]
    fp32: 40-70 ms against 1-2 ms from the table), a cost a decode step paid in every layer for every
    cached key it rebuilt."""
    length = x.shape[-2]
    angle = np.arange(length, dtype=np.float32)[:, None] * rope_frequencies(x.shape[-1], theta, scaling)  # [T, D/2]
    return _rotate(x, jnp.asarray(np.cos(angle)), jnp.asarray(np.sin(angle)))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., D] rotated in the rotate-half layout by cos, sin [..., D/2] (broadcast), in fp32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def query_rows(seq: int, query_block: int) -> int:
    """Queries per block of XLA's attention: `model.attention_query_block` when it divides a longer
    sequence, else the whole sequence (the work analysis needs the same number)."""
    return query_block if seq > query_block and seq % query_block == 0 else seq


# Queries per causal block where one block holds the sequence. On XLA:CPU, at [4, 256, 8, 64] fp32
# forward + backward, 2 blocks of 128 run 1.5-1.7x faster than one masked S x S block; at
# [2, 512, 8 (2 kv), 64], 4 blocks 1.9x.
CAUSAL_BLOCK = 128


def causal_blocks(seq: int) -> int:
    """How many blocks of queries plain causal self-attention over `seq` positions (one query block)
    runs, block i against the keys up to its own end only (the work analysis needs the same)."""
    return seq // CAUSAL_BLOCK if seq > CAUSAL_BLOCK and seq % CAUSAL_BLOCK == 0 else 1


_UNSEEN = -0.7 * float(jnp.finfo(jnp.float32).max)  # an unseen key's score, as jax.nn.dot_product_attention's


def _heads_first(x: jax.Array, kv_heads: int) -> jax.Array:
    """[B, S, H, D] -> [B, Hkv, H / Hkv, S, D]: each head's rows one matrix for the batched matmuls."""
    b, s, h, d = x.shape
    return jnp.transpose(x.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))


def _tokens_first(x: jax.Array) -> jax.Array:
    """[B, Hkv, G, S, D] -> [B, S, Hkv * G, D]."""
    b, kvh, g, s, d = x.shape
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, s, kvh * g, d)


def _softmax_attention(qt: jax.Array, kt: jax.Array, vt: jax.Array, seen: jax.Array) -> jax.Array:
    """Heads-first softmax attention of qt [B, Hkv, G, Sq, D] over kt, vt [B, Hkv, 1, Sk, D] where
    `seen` [1 or B, Sq, Sk] (as jax.nn.dot_product_attention: fp32 scores and softmax, probabilities
    at v's dtype) -> [B, Hkv, G, Sq, D]."""
    scores = jnp.matmul(qt, jnp.swapaxes(kt, -1, -2), preferred_element_type=jnp.float32) * qt.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(seen[:, None, None], scores, _UNSEEN), axis=-1)
    return p.astype(vt.dtype) @ vt


def _causal_blocks_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal self-attention of q [B, S, H, D] over k, v [B, S, Hkv, D] in `causal_blocks(S)` query
    blocks, each against the keys up to its end: the blocks above the diagonal are never computed."""
    s, kvh = q.shape[1], k.shape[2]
    r = s // causal_blocks(s)
    qt, kt, vt = _heads_first(q, kvh), _heads_first(k, kvh), _heads_first(v, kvh)
    outs = [_softmax_attention(qt[..., end - r:end, :], kt[..., :end, :], vt[..., :end, :],
                               ((end - r + jnp.arange(r))[:, None] >= jnp.arange(end)[None])[None])
            for end in range(r, s + 1, r)]
    return _tokens_first(jnp.concatenate(outs, axis=3))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str, query_block: int,
                     q_positions: jax.Array | None = None, k_positions: jax.Array | None = None,
                     q_segments: jax.Array | None = None, k_segments: jax.Array | None = None) -> jax.Array:
    """Softmax attention of q [B, Sq, H, D] over k, v [B, Sk, Hkv, D]: a query sees the keys at
    positions <= its own (and of its own segment). Positions None: queries and keys are the same
    tokens at 0 .. S-1 (training's causal self-attention, which cuDNN's kernel runs).

    `impl` (the plan's): cudnn runs cuDNN's fused flash kernel where it applies (plain causal
    self-attention). xla materialises the scores. Where one block holds the sequence, plain causal
    attention runs `causal_blocks` blocks of queries, each against the keys up to its end. Else a
    loop over blocks of `query_rows` queries (each against every key, masked: the same FLOPs as one
    block), so one block's [B, H, rows, Sk] scores are live at a time instead of [B, H, Sq, Sk]
    (llama-7b, s=4096, tp=4: 2 GiB each). Either way each block's scores are recomputed in the
    backward pass instead of being kept for every layer (what a flash kernel does too)."""
    plain = q_positions is None and q_segments is None
    with jax.named_scope("attention"):  # the ops' name: `bench profile` and analysis/work.py find them by it
        if impl == "cudnn" and plain:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        recompute = partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        b, s, h, d = q.shape
        rows = query_rows(s, query_block)
        if plain and rows == s:
            return recompute(_causal_blocks_attention)(q, k, v)
        keys = jnp.arange(k.shape[1])[None] if k_positions is None else k_positions  # [1 or B, Sk]

        def mask(first):
            """[1 or B, rows, Sk]: which keys the queries first .. first + rows - 1 see."""
            if q_positions is None:
                seen = (first + jnp.arange(rows))[None, :, None] >= keys[:, None, :]
            else:
                seen = jax.lax.dynamic_slice_in_dim(q_positions, first, rows, axis=1)[:, :, None] >= keys[:, None, :]
            if q_segments is not None:
                mine = jax.lax.dynamic_slice_in_dim(q_segments, first, rows, axis=1)
                seen = seen & (mine[:, :, None] == k_segments[:, None, :])
            return seen

        kvh = k.shape[2]
        if rows == s:
            return recompute(lambda q, k, v: _tokens_first(_softmax_attention(
                _heads_first(q, kvh), _heads_first(k, kvh), _heads_first(v, kvh), mask(0))))(q, k, v)
        kt, vt = _heads_first(k, kvh), _heads_first(v, kvh)

        @recompute
        def block(q_rows, first):
            return _softmax_attention(_heads_first(q_rows, kvh), kt, vt, mask(first))

        blocks = jnp.moveaxis(q.reshape(b, s // rows, rows, h, d), 1, 0)
        out = jax.lax.map(lambda xs: block(*xs), (blocks, jnp.arange(0, s, rows)))  # [n, B, Hkv, G, rows, D]
        return _tokens_first(jnp.moveaxis(out, 0, 3).reshape(b, kvh, h // kvh, s, d))


def cached_attention(q: jax.Array, k: jax.Array, positions: jax.Array, combine, *, query_block: int) -> jax.Array:
    """Softmax attention of q [B, S, H, d_h] at `positions` [B, S] over a cache's keys k
    [B, H_kv, T, d_h] (slot j at position j; heads-first, so each (row, kv head) is one matrix and
    nothing is transposed per step): a query sees the slots at positions <= its own. `combine(p)`
    takes the fp32 probabilities p [B, H_kv, G, S', T] of a block of S' queries (query_rows: one
    block's scores live at a time, as in causal_attention) to that block's output [B, S', ...]."""
    b, s, h, dh = q.shape
    kvh = k.shape[1]
    slots = jnp.arange(k.shape[2])

    def block(q_rows, pos_rows):
        q_rows = q_rows.reshape(b, -1, kvh, h // kvh, dh)
        scores = jnp.einsum("bskgd,bktd->bkgst", q_rows, k, preferred_element_type=jnp.float32)
        seen = slots <= pos_rows[:, None, None, :, None]
        return combine(jax.nn.softmax(jnp.where(seen, scores / jnp.sqrt(jnp.float32(dh)), -jnp.inf), axis=-1))

    with jax.named_scope("attention"):
        return _by_query_blocks(block, q, positions, query_block)


def _by_query_blocks(block, q: jax.Array, positions: jax.Array, query_block: int) -> jax.Array:
    """block(q_rows, positions_rows) -> [B, S', ...] over blocks of `query_rows` queries of q [B, S, ...]
    (a loop where there are several: one block's scores live at a time)."""
    b, s = q.shape[:2]
    rows = query_rows(s, query_block)
    if rows == s:
        return block(q, positions)
    split = lambda x: jnp.moveaxis(x.reshape(b, s // rows, rows, *x.shape[2:]), 1, 0)
    out = jax.lax.map(lambda xs: block(*xs), (split(q), split(positions)))
    return jnp.moveaxis(out, 0, 1).reshape(b, s, *out.shape[3:])


def absorbed_attention(q: jax.Array, h_k: jax.Array, rotary: jax.Array, h_v: jax.Array, b_k: jax.Array,
                       b_v: jax.Array, positions: jax.Array, *, groups: int, query_block: int) -> jax.Array:
    """Attention with decoupled RoPE on a latent cache, B_k and B_v absorbed (MLA's decode): q
    [B, S, H, d_h] at `positions` [B, S] ([position-free | rotary], its rotary tail already rotated)
    over the cached latents h_k, h_v [B, T, r] (slot j at position j) and rotary keys `rotary`
    [B, g, T, d_r] (after RoPE, one per latent head) of the up-projections b_k [r, H_kv (d_h - d_r) / g]
    and b_v [r, H_kv d_h / g] (the stacked blocks of block-diagonal B's; g = 1: B itself) -> [B, S, H d_h].

    No key is rebuilt: q's position-free part goes into the latent space, q_n . (h_k B_k) =
    (q_n B_k^T) . h_k per kv head, so a score is (q_n B_k^T) . h_k + q_r . k_r, and the values'
    up-projection follows the attention-weighted latents, (p h_v) B_v. Per cached token and query head
    a step reads r / g + d_r values where a full cache's reads d_h (docs/design/absorbed-attention.md).
    Plain arrays in and out, so any cache that gathers these tensors (a paged one) can call it."""
    b, s, h, dh = q.shape
    t, dr = h_k.shape[1], rotary.shape[-1]
    dn = dh - dr
    kvh = b_k.shape[1] * groups // dn
    b_k = b_k.astype(q.dtype).reshape(groups, -1, kvh // groups, dn)  # [g, r / g, H_kv / g, d_n]
    b_v = b_v.astype(q.dtype).reshape(groups, -1, kvh // groups, dh)  # [g, r / g, H_kv / g, d_h]
    # Groups leading, each group's latents [B, T, r / g] as the cache holds them (a bitcast where a
    # device holds one group), as in `_grouped_latent_value_attention`.
    h_k, h_v = (jnp.moveaxis(x.reshape(b, t, groups, -1), 2, 0) for x in (h_k, h_v))  # [g, B, T, r / g]
    slots = jnp.arange(t)

    def block(q_rows, pos_rows):
        q_rows = q_rows.reshape(b, -1, groups, kvh // groups, h // kvh, dh)  # [B, S', g, H_kv / g, G, d_h]
        q_latent = jnp.einsum("bsjhgn,jrhn->jbhgsr", q_rows[..., :dn], b_k)  # into the latent space
        scores = (jnp.einsum("jbhgsr,jbtr->jbhgst", q_latent, h_k, preferred_element_type=jnp.float32)
                  + jnp.einsum("bsjhgd,bjtd->jbhgst", q_rows[..., dn:], rotary.astype(q.dtype),
                               preferred_element_type=jnp.float32))
        seen = slots <= pos_rows[None, :, None, None, :, None]
        p = jax.nn.softmax(jnp.where(seen, scores / jnp.sqrt(jnp.float32(dh)), -jnp.inf), axis=-1)
        z = jnp.einsum("jbhgst,jbtr->bsjhgr", p.astype(h_v.dtype), h_v)  # the attention-weighted latents
        return jnp.einsum("bsjhgr,jrhd->bsjhgd", z, b_v).reshape(b, -1, h * dh)

    with jax.named_scope("attention"):
        return _by_query_blocks(block, q, positions, query_block)


def latent_value_attention(q: jax.Array, k: jax.Array, positions: jax.Array, h_v: jax.Array, b_v: jax.Array, *,
                           query_block: int, groups: int = 1) -> jax.Array:
    """`cached_attention` of q [B, S, H, d_h] over keys k [B, H_kv, T, d_h] whose values are the
    latents h_v [B, T, r] of the up-projection b_v [r, H_kv d_h]: softmax(q k^T) (h_v B_v) computed
    as (softmax(q k^T) h_v) B_v per kv head, B_v applied once per query instead of once per cached
    token -> [B, S, H d_h]. With latent heads (`groups` > 1, b_v [r, H_kv d_h / g] the stacked blocks
    of a block-diagonal B_v), each kv head weighs only its own group's r / g latent columns."""
    if groups > 1:
        return _grouped_latent_value_attention(q, k, positions, h_v, b_v, query_block=query_block, groups=groups)
    b, s, h, dh = q.shape
    weighted = lambda p: jnp.einsum("bkgst,btr->bskgr", p.astype(h_v.dtype), h_v)  # the attention-weighted latents
    z = cached_attention(q, k, positions, weighted, query_block=query_block)
    with jax.named_scope("attention"):
        b_v = b_v.astype(z.dtype).reshape(-1, k.shape[1], dh)  # [r, H_kv, d_h]
        return jnp.einsum("bskgr,rkd->bskgd", z, b_v).reshape(b, s, h * dh)


def _grouped_latent_value_attention(q, k, positions, h_v, b_v, *, query_block: int, groups: int) -> jax.Array:
    """`latent_value_attention` with latent heads: kv head j h' (group j, head h' of it) weighs the
    latents h_v[..., j, :] [B, T, r / g] and applies block j of B_v."""
    b, s, h, dh = q.shape
    kvh, t = k.shape[1], k.shape[2]
    # Groups leading on both sides (a device's own groups under btp: a bitcast there), each group's
    # latents [B, T, r / g] the matmul's right side as the cache holds them. With the groups between
    # T and r, XLA:CPU copied the whole cache transposed to [B, r / g, T] every step (llama-60m tp = 4,
    # g = 4, batch 32, per layer and device: 1.09 -> 0.80 ms for the step's attention).
    h_v = jnp.moveaxis(h_v.reshape(b, t, groups, -1), 2, 0)  # [g, B, T, r / g]

    def weighted(p):  # [B, H_kv, G, S', T] -> [B, S', g, H_kv / g, G, r / g]
        p = jnp.moveaxis(p.reshape(b, groups, kvh // groups, *p.shape[2:]), 1, 0).astype(h_v.dtype)
        return jnp.transpose(jnp.einsum("jbhgst,jbtr->jbhgsr", p, h_v), (1, 4, 0, 2, 3, 5))

    z = cached_attention(q, k, positions, weighted, query_block=query_block)
    with jax.named_scope("attention"):
        b_v = b_v.astype(z.dtype).reshape(groups, -1, kvh // groups, dh)  # [g, r / g, H_kv / g, d_h]
        return jnp.einsum("bsjhgr,jrhd->bsjhgd", z, b_v).reshape(b, s, h * dh)

