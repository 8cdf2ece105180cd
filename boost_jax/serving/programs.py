"""The serving engine's two programs over a paged pool, and the pool's size: what serving/engine.py
calls, and what `python -m boost_jax.compile` compiles for a GPU as `serve_decode` (nothing here
allocates but `empty_pool`, so a GPU topology's devices compile them without a GPU).

    programs = PagedPrograms(decoder, ServeConfig(slots=8), context=1024)
    programs.size                     # PoolSize: pages (the null page included) and bytes per page per device
    pool = programs.empty_pool()      # allocated under the plan: latent heads split 1/tp of the latents
    pool, out = programs.decode(params, pool, tables, last, start, count, temperature, top_p, seed, index, scored)
    programs.compiled_decode(rows=8, width=64)   # the same program, compiled on abstract inputs

`pool_size` is the one sizing rule: the engine's pool, the server's start-up check and
`bench memory --inference`'s serving line all read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from boost_jax.config import ServeConfig
from boost_jax.config.hardware import HARDWARE_FILE, machine_of
from boost_jax.layers import paged_cache
from boost_jax.layers.kv_cache import Cache
from boost_jax.model.decode import COMPILER_OPTIONS, Decoder, cache_bytes_per_token
from boost_jax.parallel.plan import Plan
from boost_jax.runtime.errors import ConfigError

TOP_LOGPROBS = 5  # the most likely tokens each step reports (OpenAI's completions allow up to 5)
GIB = 1 << 30
HEADROOM = 0.10  # of a GPU's memory kept free with serve.cache_gib=0 (CUDA's, XLA's own buffers): plan.py's default
# Each row's sampling arrays, after the program's own: temperature, top_p, seed, token index, scored.
SAMPLING = ((jnp.float32,), (jnp.float32,), (jnp.uint32,), (jnp.int32,), (jnp.bool_,))


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seed: jax.Array,
                index: jax.Array) -> jax.Array:
    """Token ids [B] from logits [B, V], each row its own way: greedy where temperature [B] is 0 (the
    argmax, as decode.sample), else drawn from the temperature-scaled distribution cut to its smallest
    set of top_p [B] probability, with fold_in(key(seed[B]), index[B]). A step where every row is
    greedy runs the argmax alone (a `cond`: the sort over the vocabulary costs more than the model's
    step on a small one)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        descending = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(descending, axis=-1)
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p[:, None], axis=-1)  # the first token always
        lowest = jnp.take_along_axis(descending, kept[:, None] - 1, axis=-1)  # the least likely kept
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed, index)
        token = jax.vmap(jax.random.categorical)(keys, jnp.where(scaled >= lowest, scaled, -jnp.inf))
        return jnp.where(temperature > 0, token.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: greedy)



@dataclass(frozen=True)
class PoolSize:
    """A page pool on one device: its pages (the null page included) and the bytes of one, all layers."""

    pages: int
    page_bytes: int

    @property
    def bytes(self) -> int:
        return self.pages * self.page_bytes


def pool_size(serve: ServeConfig, kind: str, cfg, plan: Plan, context: int, left_bytes: int | None = None) -> PoolSize:
    """The pool of a cache `kind` for model `cfg` under `plan`: pages of `serve.page_tokens` positions
    laid out as the plan splits the kind (model/decode.py cache_bytes_per_token), `serve.cache_gib` of
    them per device; with cache_gib 0, `left_bytes` of them (a GPU's memory left, PagedPrograms) or,
    where that is None (CPU devices), every slot at the full context; never more than that (no
    sequence could own the rest). Refused when that holds less than one request at the context."""
    page_bytes = cache_bytes_per_token(kind, cfg, plan) * serve.page_tokens
    per_seq = -(-context // serve.page_tokens)
    if serve.cache_gib:
        n, source = int(serve.cache_gib * GIB // page_bytes), f"serve.cache_gib={serve.cache_gib}"
    elif left_bytes is not None:
        n, source = max(left_bytes, 0) // page_bytes, f"the {left_bytes / GIB:.2f} GiB the device has left (serve.cache_gib=0)"
    else:
        n, source = serve.slots * per_seq + 1, "every slot at the context"
    n = min(n, serve.slots * per_seq + 1)  # more pages than every slot at the context are never owned
    if n - 1 < per_seq:
        raise ConfigError(f"{source} holds {max(n - 1, 0)} pages of {serve.page_tokens} tokens ({page_bytes:,} bytes "
                          f"each per device): less than one request at the context ({context} positions, {per_seq} "
                          "pages); set serve.cache_gib, or fewer positions (train.seq_len)")
    return PoolSize(n, page_bytes)


class PagedPrograms:
    """The prefill and decode programs of `decoder`'s model over a pool of its cache kind sized by
    `serve` for `context` positions (see the module's docstring)."""

    def __init__(self, decoder: Decoder, serve: ServeConfig, context: int):
        self.decoder, self.plan, self.serve = decoder, decoder.plan, serve
        self.kind = decoder.cache_name
        self.max_pages = -(-context // serve.page_tokens)  # a table's entries: the context's pages
        self.replicated = NamedSharding(self.plan.mesh, PartitionSpec())
        self._make_pool = jax.jit(lambda n: paged_cache.constrain_pool(
            paged_cache.empty_pool(self.kind, decoder.cfg, n, serve.page_tokens), self.plan.constrain), static_argnums=0)
        options = COMPILER_OPTIONS.get(self.plan.platform, {})
        self.prefill = jax.jit(self._prefill_fn, donate_argnums=(1,), compiler_options=options)
        self.decode = jax.jit(self._decode_fn, donate_argnums=(1,), compiler_options=options)
        self.size = pool_size(serve, self.kind, decoder.cfg, self.plan, context)
        if not serve.cache_gib and self.plan.platform == "gpu":
            self.size = pool_size(serve, self.kind, decoder.cfg, self.plan, context, self.memory_left())

    def memory_left(self) -> int:
        """Bytes a GPU has for the pool: its memory less HEADROOM (the allocator's limit where the device
        reports one, else the HBM of the hardware file's machine of its device_kind: a GPU topology's,
        compiled for without one), less the weights and the working memory (temporaries) of the widest
        prefill and decode programs, compiled over the pool `self.size` holds (the pool is donated and
        updated in place: what they need beside it does not grow with it)."""
        device = self.plan.mesh.devices.flat[0]
        stats = device.memory_stats() if device in jax.local_devices() else None  # a GPU topology's has none
        if stats and "bytes_limit" in stats:
            limit = stats["bytes_limit"]
        elif (hw := machine_of(device.device_kind)) is not None:
            limit = hw.hbm_bytes
        else:
            raise ConfigError(f"serve.cache_gib=0 sizes the pool from the GPU's memory, which the device does not "
                              f"report and no machine of {HARDWARE_FILE} has (device_kind {device.device_kind!r}): "
                              "set serve.cache_gib")
        weights = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                      for a in jax.tree.leaves(self.decoder.params))
        prefill = self.compiled_prefill(min(self.serve.prefill_rows, self.serve.slots))
        decode = self.compiled_decode(self.serve.slots, self.max_pages)
        working = max(p.memory_analysis().temp_size_in_bytes for p in (prefill, decode))
        return int(limit * (1 - HEADROOM)) - weights - working

    def empty_pool(self) -> Cache:
        return self._make_pool(self.size.pages)

    def _abstract(self, program, rows: int, *shapes: tuple) -> jax.stages.Compiled:
        """`program` compiled for `rows` rows on abstract inputs laid out as the engine's: the pool as
        `empty_pool` makes it, then per row arrays of `shapes` ((dtype, *trailing dims) each), replicated."""
        made = self._make_pool.lower(self.size.pages).compile()
        pool = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(self._make_pool, self.size.pages), made.output_shardings)
        args = [jax.ShapeDtypeStruct((rows, *dims), dtype, sharding=self.replicated) for dtype, *dims in shapes]
        return program.lower(self.decoder.params, pool, *args).compile()

    def compiled_prefill(self, rows: int) -> jax.stages.Compiled:
        """The prefill program of `rows` rows (`_prefill_fn`), compiled on abstract inputs."""
        i32, chunk = jnp.int32, self.serve.prefill_chunk
        return self._abstract(self.prefill, rows, (i32, self.max_pages), (i32, chunk), (i32, chunk), (jnp.bool_, chunk),
                              (i32,), *SAMPLING)

    def compiled_decode(self, rows: int, width: int) -> jax.stages.Compiled:
        """The decode program of `rows` rows over `width` table pages (`_decode_fn`), compiled on abstract inputs."""
        i32 = jnp.int32
        return self._abstract(self.decode, rows, (i32, width), (i32,), (i32,), (i32,), *SAMPLING)

    def _pick(self, logits, temperature, top_p, seed, index, scored) -> tuple[jax.Array, ...]:
        """Each row's next token from its logits [B, V], its logprob, the top TOP_LOGPROBS tokens and
        theirs: computed where some row is `scored` [B] (asks for logprobs), else zeros (a `cond`: the
        top-k over the vocabulary is a tenth of a small model's step)."""
        token = sample_rows(logits, temperature, top_p, seed, index)

        def scores():
            logprobs = jax.nn.log_softmax(logits, axis=-1)
            top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
            return jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_logprobs

        none = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(scores))
        return token, *jax.lax.cond(jnp.any(scored), scores, none)

    def _view(self, pool, tables) -> Cache:
        return tuple(c.constrain(self.plan.constrain) for c in paged_cache.view(pool, tables))

    def _store(self, pool, rows, tables, positions, valid):
        return paged_cache.constrain_pool(paged_cache.store(pool, rows, tables, positions, valid), self.plan.constrain)

    def _prefill_fn(self, params, pool, tables, tokens, positions, valid, logits_at, temperature, top_p, seed, index,
                    scored):
        """Rows' prompt chunks [B, S] at positions [B, S] (`valid` [B, S]: a real token) through the model
        over their pages (tables [B, P]) -> (the pool with their keys and values, each row's next token
        at logits_at [B] and its logprobs as `_pick`'s, each [B, 1, ...])."""
        rows = self._view(pool, tables)
        logits, rows = self.decoder._decode(params, tokens, rows, positions, logits_at)  # noqa: SLF001 (the Decoder's model call)
        out = self._pick(logits, temperature, top_p, seed, index, scored)
        return self._store(pool, rows, tables, positions, valid), tuple(x[:, None] for x in out)

    def _decode_fn(self, params, pool, tables, last, start, count, temperature, top_p, seed, index, scored):
        """count [B] (<= serve.decode_steps) tokens for each row, fed back one at a time: row b's last
        token last [B] at position start [B] first. The rows' pages (tables [B, P]) are gathered once,
        decoded over in place for max(count) steps, and only the positions each row wrote for its
        count stored back: the gather costs once per call, not per token -> (the pool, each row's tokens
        and their logprobs as `_pick`'s, each [B, decode_steps, ...], the first count[b] of row b real)."""
        b, n = last.shape[0], self.serve.decode_steps
        out = jax.eval_shape(self._pick, jnp.zeros((b, self.decoder.cfg.vocab_size), jnp.float32),
                             temperature, top_p, seed, index, scored)
        out = tuple(jnp.zeros((b, n, *x.shape[1:]), x.dtype) for x in out)

        def step(carry):
            i, rows, last, out = carry
            logits, rows = self.decoder._decode(params, last[:, None], rows, (start + i)[:, None],  # noqa: SLF001
                                                jnp.zeros_like(last))
            new = self._pick(logits, temperature, top_p, seed, index + i, scored)
            return i + 1, rows, new[0], tuple(o.at[:, i].set(x) for o, x in zip(out, new))

        init = (0, self._view(pool, tables), last, out)
        _, rows, _, out = jax.lax.while_loop(lambda c: c[0] < jnp.max(count), step, init)
        positions = start[:, None] + jnp.arange(n)[None]
        valid = jnp.arange(n)[None] < count[:, None]
        return self._store(pool, rows, tables, positions, valid), out
