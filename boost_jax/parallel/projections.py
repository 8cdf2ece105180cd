"""How each tensor-parallel scheme runs a decoder block's projections: its strategy.

Attention and the MLP ask the strategy of their plan's scheme for their projections and never
look at the scheme themselves:

    proj = plan.projections(cfg, plan, latents)       # one per block call (it threads LaX's latents)
    y = proj.normed(x, norm, {"q": q, "k": k, "v": v}, out_axes)   # projections of norm(x)
    z = proj("o", o, attention_out, ("act_heads", "heads"))        # one projection of an activation
    heads = proj.attention(x, norm, {"q": q, "k": k, "v": v}, op, where)  # self-attention of norm(x), no cache

`normed` of a low-rank strategy is `up(latents(...))`: the two halves are separate so that a
caller may keep the rank-r latents (a latent cache) and project them later. `attention` is where
the plan's tokens meet: it makes attention's q, k, v (or the latents of k and v under
`parallel.cp_attention=latent`) and runs the attention op (`op`, ops/attention.py: the layer's
heads, RoPE and query block) on them where the plan keeps the tokens (parallel/context.py); the
layer hands over its q, k, v projections and its op, and never reads the scheme or the low-rank
factors.

- megatron (dense): the GEMMs as written, sharded by the layouts alone (XLA derives the two
  all-reduces per layer); with `model.grouping`, projections of one input and equal width as one
  stacked GEMM (Megatron's fused QKV) where their outputs are split over devices.
- vanilla (low-rank): every pair (A, B) split on r by the layouts: XLA all-reduces each full-width
  output; with `model.grouping` the A's of one input as one stacked GEMM (the authors' baseline).
- btp (low-rank): BOOST's fused path (`parallel/blocks.py`): norm + grouped down-projection and
  one all-reduce of the latents (and the norm's statistics), grouped up-projections.

Adding a scheme: an entry in `boost_jax/config/schemes.py` and its strategy in `STRATEGIES` here (a test
keeps the two tables' names equal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.config.archs import ARCHS
from boost_jax.ops.attention import AttentionOp, Positions
from boost_jax.parallel.blocks import btp_down, grouped_up
from boost_jax.parallel.context import KEYS, QUERIES, attend_gathered, attend_round_ring, gather, gathered_keys
from boost_jax.parallel.remat import LATENT
from boost_jax.parallel.view import PlanView

if TYPE_CHECKING:
    from boost_jax.config import ModelConfig

LATENT_AXES = ("batch", "seq", "act_latent")
KV_LATENT_AXES = ("batch", "seq", "act_kv_latent")  # k's and v's with latent heads: split by groups under btp
ROTARY_KEY_AXES = ("batch", "seq", "act_kv_rope")  # decoupled RoPE's keys [B, S, g d_r]: as k's latents under btp, else whole
ROTARY_KEY = "k_rope"  # the attention layer's name of its rotary key projection (layers.lowrank.RotaryKeys)


class LinearLike(Protocol):
    """What a strategy needs of a projection (`layers.lowrank.Linear`): its weights (`w`, or `a` and
    `b`), its output width and its math."""

    d_out: int
    groups: int  # latent heads: B block-diagonal in this many groups (1: one latent)
    rotary_key: bool  # decoupled RoPE's key projection: no B, its output kept as it is (never crossed)

    def down(self, x: jax.Array, *, flat: bool) -> jax.Array: ...  # x @ A (low-rank; `flat`: lowrank.matmul's)

    def activation(self, h: jax.Array) -> jax.Array: ...  # the arch's latent function

    def up(self, h: jax.Array, *, flat: bool) -> jax.Array: ...  # h @ B (low-rank)

    def up_with(self, h: jax.Array, b: jax.Array, *, flat: bool) -> jax.Array: ...  # h @ b, b its B or whole groups of it

    def __call__(self, x: jax.Array, *, flat: bool) -> jax.Array: ...  # x @ W (dense)

    def add_bias(self, y: jax.Array) -> jax.Array: ...  # y plus the projection's bias, if it has one


Linears = dict[str, LinearLike]
OutAxes = dict[str, tuple[str, str]]  # projection name -> (weight axis, activation axis) of its output


def latent_axes(linear: LinearLike) -> tuple[str, str, str]:
    """The logical axes of a projection's latent [B, S, r]: k's and v's with latent heads their own
    (split by groups under btp), decoupled RoPE's keys theirs, every other latent's LATENT_AXES."""
    if linear.rotary_key:
        return ROTARY_KEY_AXES
    return KV_LATENT_AXES if linear.groups > 1 else LATENT_AXES


class Projections:
    """A block's projections under one plan. `latents` holds the previous layer's latents by
    projection name (LaX crosses them in); `new` collects this layer's for the next."""

    def __init__(self, cfg: ModelConfig, plan: PlanView, latents: dict[str, jax.Array]):
        self.cfg, self.plan, self.prev, self.new = cfg, plan, latents, {}
        self.flat = plan.flat_tokens
        self.carries = ARCHS[cfg.arch].carries_latents

    def normed(self, x: jax.Array, norm, linears: Linears, out_axes: OutAxes) -> dict[str, jax.Array]:
        """{name: projection(norm(x))} for the projections that read the residual stream x."""
        return self.up(self.latents(x, norm, linears), linears, out_axes)

    def latents(self, x: jax.Array, norm, linears: Linears) -> dict[str, jax.Array]:
        """{name: latent(norm(x))}: each low-rank projection's input to B (LaX: crossed)."""
        raise NotImplementedError(f"{type(self).__name__} has no latents (a dense scheme)")

    def up(self, hs: dict[str, jax.Array], linears: Linears, out_axes: OutAxes) -> dict[str, jax.Array]:
        """{name: up-projection of its latent}."""
        raise NotImplementedError(f"{type(self).__name__} has no latents (a dense scheme)")

    def __call__(self, name: str, linear: LinearLike, x: jax.Array, x_axes: tuple[str, str]) -> jax.Array:
        """One projection of an activation; x_axes: (activation axis, weight axis) of x's last dim."""
        raise NotImplementedError

    def up_weight(self, linear: LinearLike) -> jax.Array:
        """B [r, d_out] of a low-rank projection: the up-projection a caller applies itself to latents
        it kept (attention over a latent cache, to its attention-weighted latents)."""
        return linear.b[...]

    def queries_keys_values(self, x: jax.Array, norm, linears: Linears, op: AttentionOp,
                            positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, S, H, d_h], k and v [B, S, H_kv, d_h] of norm(x) by the projections `linears` q, k
        and v, q and k rotated at `positions` [B, S]."""
        b, s, _ = x.shape
        kv = ("kv_heads", "act_kv_heads")
        out_axes = {"q": ("heads", "act_heads"), "k": kv, "v": kv}
        rotary = None
        if ROTARY_KEY in linears:  # decoupled RoPE: the rotary keys' projection beside the latents, no B
            hs = self.latents(x, norm, linears)
            rotary = hs.pop(ROTARY_KEY).reshape(b, s, -1, op.rope_dims)
            qkv = self.up(hs, linears, out_axes)
        else:
            qkv = self.normed(x, norm, linears, out_axes)
        qkv = {name: linears[name].add_bias(qkv[name]) for name in "qkv"}
        q, v = (qkv[name].reshape(b, s, -1, op.head_dim) for name in "qv")
        k = qkv["k"].reshape(b, s, -1, op.head_dim - op.rope_dims)
        constrain = self.plan.constrain
        return (constrain(op.rotate(q, positions), QUERIES), constrain(op.keys(k, rotary, positions), KEYS),
                constrain(v, KEYS))

    def attention(self, x: jax.Array, norm, linears: Linears, op: AttentionOp, where: Positions) -> jax.Array:
        """Causal self-attention of norm(x)'s tokens without a cache, [B, S, H, d_h] (what o reads):
        the queries, keys and values of the projections `linears` (q, k, v) attended by `op` where
        the plan keeps the tokens: each device its own, or under context parallelism
        (parallel/context.py, `parallel.cp_attention`) with k and v gathered over cp, passed round
        the ring, or rebuilt from their gathered latents."""
        b, s, _ = x.shape
        plan, cp = self.plan, self.plan.size("seq")
        if cp > 1 and plan.cp_attention == "latent":
            return self._attention_over_gathered_latents(x, norm, linears, op, where)
        q, k, v = self.queries_keys_values(x, norm, linears, op, where.of(b, s))
        if cp == 1:
            return op.attend(q, k, v, where.positions, where.positions, where.segments, where.segments,
                             impl=plan.attention)
        if plan.cp_attention == "ring":
            positions = where.of(b, s)
            return attend_round_ring(plan, q, k, v, positions, positions, where.segments, where.segments,
                                     n_heads=op.n_heads, rows=op.query_rows(s // cp))
        return attend_gathered(plan, op, q, where, (k, v), (KEYS, KEYS), gathered_keys)

    def _attention_over_gathered_latents(self, x: jax.Array, norm, linears: Linears, op: AttentionOp,
                                         where: Positions) -> jax.Array:
        """parallel.cp_attention=latent (low-rank archs): the rank-r latents of k and v are gathered
        over cp, and every device rebuilds the whole sequence's keys and values from them with its
        own columns of B (summed over the devices that split r, where the scheme does)."""
        b, s, _ = x.shape
        plan = self.plan
        hs = self.latents(x, norm, linears)
        rotary = hs.pop(ROTARY_KEY, None)
        q = self.up({"q": hs["q"]}, linears, {"q": ("heads", "act_heads")})["q"]
        q = plan.constrain(op.rotate(q.reshape(b, s, op.n_heads, op.head_dim), where.of(b, s)), QUERIES)
        k_lin = linears["k"]
        h_axes = latent_axes(k_lin)
        rank_axis = plan.axis(h_axes[-1])

        def up(h, w, width):  # [B, S/cp, r'] -> the whole sequence's [B, S, kv heads', width]
            y = k_lin.up_with(gather(h), w, flat=False)
            # A split rank sums over its devices; latent heads are whole groups, their heads the device's own.
            y = y if rank_axis is None or k_lin.groups > 1 else jax.lax.psum(y, rank_axis)
            return y.reshape(*y.shape[:2], -1, width)

        def rebuild(k_positions, h_k, h_v, b_k, b_v, *rotary):  # rotary: decoupled RoPE's keys, gathered
            keys = up(h_k, b_k, op.head_dim - op.rope_dims)
            rotary = gather(rotary[0]).reshape(*keys.shape[:2], -1, op.rope_dims) if rotary else None
            return op.keys(keys, rotary, k_positions), up(h_v, b_v, op.head_dim)

        # B's rows as the latents are split, its columns as the heads (latent heads: whole blocks)
        weights = ("latent_rows", None) if k_lin.groups > 1 else (LATENT_AXES[-1], "kv_heads")
        keys = (hs["k"], hs["v"], self.up_weight(linears["k"]), self.up_weight(linears["v"]))
        axes = (h_axes, h_axes, weights, weights)
        if rotary is not None:
            keys, axes = (*keys, rotary), (*axes, ROTARY_KEY_AXES)
        return attend_gathered(plan, op, q, where, keys, axes, rebuild)

    def _activate(self, linear: LinearLike, h: jax.Array, tag: bool) -> jax.Array:
        """The latent from x @ A: its layout, the LATENT checkpoint name (low-rank checkpointing;
        the fused btp path tags its all-reduce outputs itself), the arch's function."""
        h = self.plan.constrain(h, latent_axes(linear))
        if tag:
            h = checkpoint_name(h, LATENT)
        return linear.activation(h)

    def _cross(self, name: str, h: jax.Array) -> jax.Array:
        """LaX: add the previous layer's latent of the same projection (and keep this one)."""
        if not self.carries or name == ROTARY_KEY:
            return h
        self.new[name] = h
        return h + self.prev[name].astype(h.dtype)


class MegatronProjections(Projections):
    """Dense weights as written; column/row parallelism comes from the layouts."""

    def normed(self, x, norm, linears, out_axes):
        x = norm(x)
        # Projections of one input and equal width as one stacked GEMM: under column parallelism the
        # input's gradient is then ONE partial sum, all-reduced once, where separate GEMMs leave XLA
        # one all-reduce per projection. With their outputs whole on every device there is no
        # all-reduce to save, only the weights' copy into the stack (and its gradient's out of it):
        # llama-60m dense fp32 b4 x 256 trains 1.11-1.17x faster on 2 CPU cores without it.
        out = {}
        for names in _by_width(linears).values():
            split = any(self.plan.size(out_axes[n][1]) > 1 for n in names)
            if not (self.cfg.grouping and split and len(names) > 1):
                out.update({n: linears[n](x, flat=self.flat) for n in names})
                continue
            out.update(zip(names, stacked_matmul(x, [linears[n].w[...] for n in names], flat=self.flat)))
        return out

    def __call__(self, name, linear, x, x_axes):
        return linear(x, flat=self.flat)


class VanillaProjections(Projections):
    """Each (A, B) pair split on r by the layouts (XLA all-reduces each full-width output). With
    `model.grouping` (the authors' baseline, docs/design.md section 2) the A's of one
    input and equal rank run as one stacked column-parallel GEMM where tp splits r, so their input
    gradient is one partial sum, all-reduced once: A_q|A_k|A_v and A_gate|A_up."""

    def latents(self, x, norm, linears):
        x = norm(x)
        pre = {}
        for names in _by_rank(linears).values():
            if self.cfg.grouping and len(names) > 1 and self.plan.size("act_latent") > 1:
                xd = x.astype(linears[names[0]].dtype)  # as Linear.down casts it
                pre.update(zip(names, stacked_matmul(xd, [linears[n].a[...] for n in names], flat=self.flat)))
            else:
                pre.update({n: linears[n].down(x, flat=self.flat) for n in names})
        return {name: self._cross(name, self._activate(lin, pre[name], tag=True)) for name, lin in linears.items()}

    def up(self, hs, linears, out_axes):
        return {name: linears[name].up(h, flat=self.flat) for name, h in hs.items()}

    def __call__(self, name, linear, x, x_axes):
        h = self._cross(name, self._activate(linear, linear.down(x, flat=self.flat), tag=True))
        return linear.up(h, flat=self.flat)


class BTPProjections(Projections):
    """BOOST: row-parallel A with one all-reduce of the latents (norm statistics riding along),
    column-parallel B, grouped where `model.grouping` says (parallel/blocks.py)."""

    def latents(self, x, norm, linears):
        c = self.cfg
        # With latent heads each rank keeps only its own groups of k's and v's latents (a reduce-scatter).
        split = [latent_axes(lin)[-1] if lin.groups > 1 else None for lin in linears.values()]
        pre = btp_down(self.plan, x, [lin.a[...] for lin in linears.values()], x_axis="act_embed", w_axis="embed",
                       gamma=norm.scale[...], norm=c.norm, grouping=c.grouping, kernels=c.kernels, eps=c.norm_eps,
                       split=split)
        return {name: self._cross(name, self._activate(lin, h, tag=False)) for (name, lin), h in zip(linears.items(), pre)}

    def up(self, hs, linears, out_axes):
        if not self.cfg.grouping:
            return {name: linears[name].up(h, flat=self.flat) for name, h in hs.items()}
        out = {}
        # Equal widths batched (GQA: q apart from k and v), latent heads apart from one latent.
        for names in _grouped({n: linears[n] for n in hs}, lambda lin: (lin.d_out, lin.groups)).values():
            if linears[names[0]].groups > 1:  # latent heads: each rank's own blocks, nothing to sum
                out.update({n: linears[n].up(hs[n], flat=self.flat) for n in names})
                continue
            if len(names) == 1:
                out[names[0]] = linears[names[0]].up(hs[names[0]], flat=self.flat)
                continue
            w_axis, y_axis = out_axes[names[0]]
            ys = grouped_up(self.plan, [hs[n] for n in names], [linears[n].b[...] for n in names],
                            w_axis=w_axis, y_axis=y_axis, kernels=self.cfg.kernels)
            out.update(zip(names, ys))
        return out

    def __call__(self, name, linear, x, x_axes):
        pre = btp_down(self.plan, x, [linear.a[...]], x_axis=x_axes[0], w_axis=x_axes[1], kernels=self.cfg.kernels)[0]
        return linear.up(self._cross(name, self._activate(linear, pre, tag=False)), flat=self.flat)


# Scheme name (boost_jax/config/schemes.py) -> its strategy.
STRATEGIES: dict[str, type[Projections]] = {
    "megatron": MegatronProjections,
    "vanilla": VanillaProjections,
    "btp": BTPProjections,
}


def stacked_matmul(x: jax.Array, weights: list[jax.Array], *, flat: bool) -> list[jax.Array]:
    """[x @ w for w in weights] as one GEMM on the weights stacked on a new axis [k, c, n]: with n
    split over devices the input's gradient is one partial sum (one all-reduce), where a
    concatenation on the split n would make XLA regather the weights."""
    w = jnp.stack([w.astype(x.dtype) for w in weights], axis=1)
    rows = x.reshape(-1, x.shape[-1]) if flat else x  # one tokens axis, as lowrank.matmul
    y = jnp.einsum("...d,dcn->...cn", rows, w).reshape(*x.shape[:-1], *w.shape[1:])
    return [y[..., i, :] for i in range(len(weights))]


def _by_rank(linears: Linears) -> dict[int, list[str]]:
    """Low-rank projection names grouped by rank (q|k|v share attn_rank, gate|up mlp_rank)."""
    return _grouped(linears, lambda lin: (lin.a[...].shape[1], lin.rotary_key))


def _by_width(linears: Linears) -> dict[int, list[str]]:
    """Projection names grouped by output width (GQA: q apart from k and v)."""
    return _grouped(linears, lambda lin: lin.d_out)


def _grouped(linears: Linears, key) -> dict:
    groups: dict = {}
    for name, lin in linears.items():
        groups.setdefault(key(lin), []).append(name)
    return groups
