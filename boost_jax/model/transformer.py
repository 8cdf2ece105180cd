"""The LLaMA decoder for every arch: embedding -> scanned stack of blocks -> RMSNorm -> LM head.

Where the tokens sit comes from the caller (`Positions`: positions and document segments; by
default 0 .. S-1, one document per row), and so does the cache of decoding (`Model.decode`: one per
layer, `layers/kv_cache.py`); decoding runs the layers one by one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.config import ModelConfig
from boost_jax.config.archs import ARCHS
from boost_jax.layers.attention import Attention
from boost_jax.layers.cross_entropy import cross_entropy_sum
from boost_jax.layers.kv_cache import Cache, KVCache, LatentCache
from boost_jax.layers.lowrank import Linear, matmul
from boost_jax.layers.mlp import MLP
from boost_jax.layers.norm import RMSNorm
from boost_jax.ops.attention import Positions
from boost_jax.parallel.blocks import embed_lookup
from boost_jax.parallel.pipeline import merge_microbatches, run_pipeline, split_microbatches
from boost_jax.parallel.plan import Plan
from boost_jax.parallel.remat import RESIDUAL, remat

# Projections whose latents LaX carries from one layer to the next.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")

RESIDUAL_AXES = ("batch", "seq", "act_embed")


class Block(nnx.Module):
    """One decoder layer: x + attention(norm(x)), then + MLP(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtypes = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
        linear_kwargs = dict(arch=cfg.arch, init_std=cfg.init_std, **dtypes)
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **dtypes)
        self.attn = Attention(cfg, linear_kwargs, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **dtypes)
        self.mlp = MLP(cfg, linear_kwargs, rngs)

    def __call__(self, plan: Plan, x, latents, where: Positions, cache: KVCache | LatentCache | None = None):
        """(residual, the previous layer's latents (LaX), positions, this layer's cache) -> (residual,
        this layer's latents, its updated cache)."""
        proj = plan.projections(self.cfg, plan, latents)
        a, cache = self.attn(x, self.attn_norm, proj, where, cache)
        x = residual(plan, x + a)
        x = residual(plan, x + self.mlp(x, self.mlp_norm, proj))
        return x, proj.new, cache


def residual(plan: Plan, x: jax.Array) -> jax.Array:
    """The residual stream at a chunk boundary: its layout, and a name low-rank checkpointing saves."""
    return checkpoint_name(plan.constrain(x, RESIDUAL_AXES), RESIDUAL)


class Model(nnx.Module):
    """The decoder: `model(tokens, plan=...)` gives logits; `decode` runs tokens against a KV cache."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.require_resolved("Model")
        self.cfg = cfg
        pdt, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        emb = cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), pdt)
        self.embed = nnx.Param(emb, logical_axes=("vocab", "table_embed"))

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers", "logical_axes": "layers"})
        def make_layers(rngs):
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        # Runs on the gathered residual, so its scale is not split like the blocks' norms.
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt, axis="final_norm")
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.d_model, cfg.vocab_size, rank=0, arch="dense", axes=("table_embed", "vocab"),
                                  init_std=cfg.init_std, dtype=dt, param_dtype=pdt, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, plan: Plan, where: Positions = Positions(),
                 remat_mode: str = "none") -> jax.Array:
        """tokens: int[B, S] -> fp32 logits [B, S, V], laid out and communicating as `plan` says."""
        return self.logits(self.hidden(tokens, plan=plan, where=where, remat_mode=remat_mode), plan)

    def hidden(self, tokens: jax.Array, *, plan: Plan, where: Positions = Positions(),
               remat_mode: str = "none") -> jax.Array:
        """tokens: int[B, S] -> the final-normed hidden states [B, S, d] the LM head reads."""
        cfg = self.cfg
        x = plan.constrain(embed_lookup(plan, self.embed[...].astype(cfg.dtype), tokens), RESIDUAL_AXES)
        carry = (x, self._initial_latents(tokens.shape))  # the residual, and the latents LaX crosses
        graphdef, state = nnx.split(self.layers)
        layer = decoder_layer(graphdef, plan, remat_mode)
        if plan.pipeline is None:
            (x, _), _ = jax.lax.scan(lambda c, s: layer(c, s, where), carry, state)
        else:  # the same layers as stages over pp, the micro-batches flowing through them
            split = lambda tree: jax.tree.map(lambda v: split_microbatches(v, plan.pipeline.microbatches), tree)
            x, _ = run_pipeline(plan.mesh, plan.pipeline, lambda p, c, w: layer(c, p, w)[0], state, split(carry),
                                split(where))
            x = plan.constrain(merge_microbatches(x), RESIDUAL_AXES)
        return self.final_norm(plan.constrain(x, ("batch", "seq", None)))  # BTP: the one all-gather along d

    def decode(self, tokens: jax.Array, cache: Cache, *, plan: Plan, positions: jax.Array,
               logits_at: jax.Array | None = None, layers: list | None = None) -> tuple[jax.Array, Cache]:
        """tokens int[B, S] at `positions` int[B, S] (each row's consecutive: a prompt's prefill, one
        decode step, a chunk of a long sequence), attending to what `cache` (one per layer) holds and
        written into it -> (fp32 logits [B, S, V], or [B, V] at each row's index `logits_at` [B] of
        the S tokens; the updated cache). The layers run one by one: `layers`, each layer's state as
        `unstack_layers` gives it (its weights its own buffers), or slices of the stacked layers."""
        if plan.pipeline is not None or plan.size("seq") > 1:
            raise ValueError("decoding runs without pipeline stages or context parallelism: use a plan with "
                             "parallel.pp=1 and parallel.cp=1")
        cfg = self.cfg
        x = plan.constrain(embed_lookup(plan, self.embed[...].astype(cfg.dtype), tokens), RESIDUAL_AXES)
        carry, where = (x, self._initial_latents(tokens.shape)), Positions(positions)
        graphdef, state = nnx.split(self.layers)
        layers = layers if layers is not None else unstack_layers(state, cfg.n_layers)
        layer, new = decoder_layer(graphdef, plan, "none"), []
        for layer_state, layer_cache in zip(layers, cache, strict=True):
            carry, layer_cache = layer(carry, layer_state, where, layer_cache)
            new.append(layer_cache)
        h, cache = self.final_norm(plan.constrain(carry[0], ("batch", "seq", None))), tuple(new)
        if logits_at is not None:  # the head on one position per row, not on the whole prompt
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)
            return self.logits(h, plan)[:, 0], cache
        return self.logits(h, plan), cache

    def logits(self, x: jax.Array, plan: Plan) -> jax.Array:
        """Hidden states [B, S, d] -> fp32 logits [B, S, V] (vocab-parallel where the plan splits the head)."""
        if self.cfg.tie_embeddings:
            logits = matmul(x, self.embed[...].astype(self.cfg.dtype).T, flat=plan.flat_tokens)
        else:
            logits = self.lm_head(x, flat=plan.flat_tokens)
        return plan.constrain(logits.astype(jnp.float32), ("batch", "seq", "act_vocab"))

    def _initial_latents(self, shape) -> dict[str, jax.Array]:
        cfg = self.cfg
        if not ARCHS[cfg.arch].carries_latents:
            return {}
        rank = lambda p: cfg.attn_rank if p in ("q", "k", "v", "o") else cfg.mlp_rank
        return {p: jnp.zeros((*shape, rank(p)), cfg.dtype) for p in PROJECTIONS}


def unstack_layers(state, n_layers: int) -> list:
    """The stacked layers' state [L, ...] as L states, one per layer (of abstract arrays, abstract
    arrays laid out as a layer of the stack is)."""
    return [jax.tree.map(lambda v: _layer(v, i), state) for i in range(n_layers)]


def _layer(v, i: int):
    if not isinstance(v, jax.ShapeDtypeStruct):
        return v[i]
    sharding = v.sharding and jax.sharding.NamedSharding(v.sharding.mesh, jax.sharding.PartitionSpec(*v.sharding.spec[1:]))
    return jax.ShapeDtypeStruct(v.shape[1:], v.dtype, sharding=sharding)


def decoder_layer(graphdef: nnx.GraphDef, plan: Plan, remat_mode: str):
    """One decoder layer as a function (carry, layer's state, positions, layer's cache) -> (carry,
    updated cache), under the remat policy: the body of the layer scan and of the pipeline's stages
    (and what the memory model compiles to read one layer's saved activations)."""

    def layer(carry, layer_state, where: Positions = Positions(), cache: KVCache | None = None):
        x, latents = carry
        x, latents, cache = nnx.merge(graphdef, layer_state)(plan, x, latents, where, cache)
        return (x, latents), cache

    return remat(layer, remat_mode)


def loss_fn(model: Model, batch: dict[str, jax.Array], plan: Plan, remat_mode: str = "none",
            loss_chunk: int = 0, z_loss: float = 0.0) -> jax.Array:
    """Mean next-token cross-entropy over all tokens of a packed batch (its `segment_ids` and
    `positions`, when the batch has them, keep attention within each document; its `weights`, a loss
    mask); with `loss_chunk`, the LM head and
    cross-entropy run that many positions at a time (`train.loss_chunk`); with `z_loss`, plus that
    weight times the mean log^2 Z of the softmax normaliser (PaLM's z-loss: it keeps log Z near 0)."""
    where = Positions(batch.get("positions"), batch.get("segment_ids"))
    x = model.hidden(batch["inputs"], plan=plan, where=where, remat_mode=remat_mode)
    targets = batch["targets"]
    # Instruction data weighs each target (0 off the completions; data/packing.py): the mean is
    # still over the batch's positions, the weights having been scaled to make it the targets' mean.
    weights = batch.get("weights", jnp.ones(targets.shape, jnp.float32))

    def xent_sum(x, t, w):
        return cross_entropy_sum(model.logits(x, plan), t, z_loss, w)

    b, s, d = x.shape
    if not loss_chunk or loss_chunk == s:
        return xent_sum(x, targets, weights) / targets.size
    # Chunks along the sequence keep the batch axis (and its data-parallel split) whole. Checkpointing
    # each chunk makes the backward recompute its logits rather than keep them: at most one chunk's
    # fp32 [B, loss_chunk, V] logits (and their gradient) are alive at a time. Under context
    # parallelism a chunk takes loss_chunk / cp positions from each device's own part of the
    # sequence, so no token moves.
    cp = plan.size("seq")
    n, k = s // loss_chunk, loss_chunk // cp

    def chunks(a):  # [B, S, ...] -> [S / loss_chunk, B, loss_chunk, ...]
        devices = (cp,) if cp > 1 else ()  # no size-1 axis: cp = 1 compiles to the program without cp
        a = jnp.moveaxis(a.reshape(b, *devices, n, k, *a.shape[2:]), 1 + len(devices), 0)
        return a.reshape(n, b, cp * k, *a.shape[3 + len(devices):])

    total, _ = jax.lax.scan(lambda acc, xt: (acc + jax.checkpoint(xent_sum)(*xt), None), jnp.float32(0),
                            (chunks(x), chunks(targets), chunks(weights)))
    return total / targets.size
